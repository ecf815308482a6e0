"""The vendored upstream schemas: present, listed with their provenance, and required.

tests/fixtures/crds/README.md has one table row per file (file, upstream repository, path,
commit, sha256); `make update-crds` reads the same rows. These tests keep the directory and
the table in step, and check that a missing schema fails the Kubernetes tests instead of
letting them skip.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from fakes.fake_k8s import FakeK8s
from fakes.k8s_schemas import (
    INFERENCESERVICE_CRD,
    KATIB_SWAGGER,
    PYTORCHJOB_CRD,
    REQUIRED_FILES,
    VENDORED_CRDS,
)

README = VENDORED_CRDS / "README.md"
# The kinds the project creates or reads (issue 8): each has its schema vendored.
EXPECTED = {
    PYTORCHJOB_CRD,
    "trainer.kubeflow.org_trainjobs.yaml",
    "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    "jobset.x-k8s.io_jobsets.yaml",
    "kubeflow.org_experiments.yaml",
    KATIB_SWAGGER,
    INFERENCESERVICE_CRD,
    "serving.kserve.io_servingruntimes.yaml",
}


@dataclass(frozen=True)
class Row:
    file: str
    repo: str
    path: str
    commit: str
    sha256: str


def readme_rows() -> list[Row]:
    rows = []
    for line in README.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.search(r"\.(yaml|json)$", cells[0]):
            rows.append(Row(*cells))
    return rows


ROWS = readme_rows()


def test_readme_lists_exactly_the_vendored_files() -> None:
    listed = [r.file for r in ROWS]
    on_disk = {p.name for p in VENDORED_CRDS.iterdir() if p.name != "README.md"}
    assert len(listed) == len(set(listed)), f"listed twice: {listed}"
    assert set(listed) == on_disk, (
        f"in README only: {sorted(set(listed) - on_disk)}; "
        f"on disk only: {sorted(on_disk - set(listed))}"
    )
    assert set(listed) == EXPECTED
    assert set(REQUIRED_FILES) <= set(listed)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.file)
def test_each_file_is_pinned_and_unchanged(row: Row) -> None:
    assert re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", row.repo), row.repo
    assert re.fullmatch(r"[0-9a-f]{40}", row.commit), f"{row.file}: commit must be a full SHA"
    assert row.path and not row.path.startswith("/") and not row.path.endswith("/")
    digest = hashlib.sha256((VENDORED_CRDS / row.file).read_bytes()).hexdigest()
    assert digest == row.sha256, (
        f"{row.file} differs from the copy the README pins (sha256 {digest}); "
        "vendored schemas are not edited by hand: `make update-crds`"
    )


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.file)
def test_each_file_is_the_schema_its_name_says(row: Row) -> None:
    text = (VENDORED_CRDS / row.file).read_text()
    if row.file == KATIB_SWAGGER:
        doc = json.loads(text)
        assert "v1beta1.Experiment" in doc["components"]["schemas"]
        return
    crd = yaml.safe_load(text)
    group, _, plural = Path(row.file).stem.partition("_")
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == f"{plural}.{group}"
    assert crd["spec"]["group"] == group
    assert crd["spec"]["names"]["plural"] == plural
    assert all("openAPIV3Schema" in v["schema"] for v in crd["spec"]["versions"])


def test_missing_schema_fails_the_fake_k8s_fixture_never_skips(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / PYTORCHJOB_CRD).write_bytes((VENDORED_CRDS / PYTORCHJOB_CRD).read_bytes())
    monkeypatch.setenv("KUBELLM_CRDS_DIR", str(tmp_path))
    try:
        request.getfixturevalue("fake_k8s")
    except BaseException as e:  # pytest's skip and fail outcomes are BaseExceptions
        outcome: BaseException = e
    else:
        pytest.fail("fake_k8s started without its schemas")
    assert type(outcome) is pytest.fail.Exception, f"expected a failure, got {outcome!r}"
    # It names exactly the missing files.
    assert f"): {INFERENCESERVICE_CRD}, {KATIB_SWAGGER}. " in str(outcome), str(outcome)


def test_fake_refuses_to_start_without_schemas(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(KATIB_SWAGGER)):
        FakeK8s(tmp_path)
