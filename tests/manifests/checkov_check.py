"""Run checkov on Kubernetes YAML and say which checks failed.

checkov pins old versions of packages the project also uses, so it lives in its own venv,
`.venv-checkov` (`make checkov` creates it; `make test` depends on it). KUBELLM_CHECKOV
points at another checkov executable.

    checkov_failures(yaml_text, name) -> ["CKV_K8S_8 on Pod.kubellm.x: Liveness ...", ...]

Findings we accept are skipped in one of two ways, each with its reason:

- in a manifest, with checkov's annotation on the object,
  `checkov.io/skip1: CKV_K8S_43=<reason>` (the reason may not contain "=": checkov splits
  on it), so that anyone who runs checkov on the manifest gets the same answer;
- here, with an allowlist `{check_id: reason}` passed as `accepted`, for YAML we generate
  (e.g. the output of `kubellm render`). `allowlist_problems` checks such a dict.

checkov knows only built-in kinds: it skips a PyTorchJob, a Katib Experiment or a KServe
InferenceService entirely (it reports zero resources). So before scanning, every pod
template inside a custom resource is copied out as a Pod of its own
(`pods_from_custom_resources`), named `<Kind>/<name>:<path to the template>`, and checkov
checks those. A scan that still sees no resource is reported as a failure, not a pass.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHECKOV_VENV = REPO / ".venv-checkov"
CHECKOV = Path(os.environ.get("KUBELLM_CHECKOV") or CHECKOV_VENV / "bin" / "checkov")
CHECK_ID = re.compile(r"CKV2?_K8S_\d+")
# JSON on stdout, failed checks only; --skip-download: no call to Prisma Cloud for check
# guidelines (there is no network where the tests run, and nothing here needs them).
CHECKOV_FLAGS = ("-o", "json", "--quiet", "--skip-download")

# Accepted findings for the manifests under manifests/: none here, they are annotated on
# the objects themselves (see manifests/base/mlflow-deployment.yaml).
MANIFEST_ACCEPTED: dict[str, str] = {}


def checkov_available() -> bool:
    return CHECKOV.is_file() and os.access(CHECKOV, os.X_OK)


def allowlist_problems(accepted: Mapping[str, str]) -> list[str]:
    """Entries of an allowlist that are not a checkov Kubernetes check id with a reason."""
    problems = []
    for check_id, reason in accepted.items():
        if not CHECK_ID.fullmatch(check_id):
            problems.append(f"{check_id!r} is not a checkov Kubernetes check id")
        if not isinstance(reason, str) or len(reason.split()) < 3:
            problems.append(f"{check_id}: no reason given (a sentence, not a word)")
    return problems


def _pod_templates(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(path, pod metadata, pod spec) of every pod template or pod spec under `node`."""
    if isinstance(node, dict):
        spec = node.get("spec")
        if isinstance(spec, dict) and isinstance(spec.get("containers"), list):
            # A pod template ({metadata, spec: PodSpec}).
            yield path, node.get("metadata") or {}, spec
            return
        if isinstance(node.get("containers"), list):
            # A PodSpec inlined with other fields, as in KServe's predictor.
            yield path, {}, node
            return
        for key, value in node.items():
            yield from _pod_templates(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _pod_templates(value, f"{path}[{i}]")


def _is_builtin(obj: dict[str, Any]) -> bool:
    group = str(obj.get("apiVersion", "")).rpartition("/")[0]
    return "." not in group or group.endswith(".k8s.io")


def pods_from_custom_resources(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Pod for every pod template inside a custom resource (built-in kinds are left to
    checkov, which already looks into Deployments, Jobs, ...)."""
    pods = []
    for obj in docs:
        if _is_builtin(obj):
            continue
        meta = obj.get("metadata") or {}
        for path, pod_meta, spec in _pod_templates(obj.get("spec"), "spec"):
            name = f"{obj.get('kind')}/{meta.get('name')}:{path}"
            pod_metadata = {**pod_meta, "name": name}
            if meta.get("namespace"):
                pod_metadata["namespace"] = meta["namespace"]
            pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": pod_metadata, "spec": spec})
    return pods


def _reports(stdout: str) -> list[dict[str, Any]]:
    data = json.loads(stdout)
    return data if isinstance(data, list) else [data]


def checkov_failures(
    yaml_text: str, name: str, accepted: Mapping[str, str] | None = None
) -> list[str]:
    """Failed checkov checks on `yaml_text` (one or more Kubernetes documents), as
    `"<check id> on <resource>: <check name>"`, minus the checks in `accepted`
    (`{check_id: reason}`; default MANIFEST_ACCEPTED). `name` names the scanned file
    in messages. Empty means checkov passed."""
    accepted = MANIFEST_ACCEPTED if accepted is None else accepted
    if problems := allowlist_problems(accepted):
        raise ValueError("bad checkov allowlist:\n" + "\n".join(problems))
    if not checkov_available():
        raise FileNotFoundError(
            f"checkov is not installed at {CHECKOV}: run `make checkov` (make test does)"
        )
    docs = [d for d in yaml.safe_load_all(yaml_text) if d is not None]
    if not docs:
        return [f"{name}: no Kubernetes object to scan"]
    docs += pods_from_custom_resources(docs)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "scan"
    with tempfile.TemporaryDirectory(prefix="kubellm-checkov-") as tmp:
        path = Path(tmp) / f"{safe}.yaml"
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False), encoding="utf-8")
        proc = subprocess.run(
            [str(CHECKOV), "-f", str(path), "--framework", "kubernetes", *CHECKOV_FLAGS],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env={**os.environ, "LOG_LEVEL": "WARNING"},
        )
    # checkov exits 1 when a check fails; anything else without JSON is checkov failing.
    try:
        reports = _reports(proc.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(
            f"checkov on {name} exited {proc.returncode} without a JSON report:\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        ) from None
    failures: list[str] = []
    scanned = 0
    for report in reports:
        summary = report.get("summary", report)
        scanned += int(summary.get("resource_count") or 0)
        if summary.get("parsing_errors"):
            failures.append(f"{name}: checkov could not parse the YAML")
        for failed in (report.get("results") or {}).get("failed_checks") or []:
            if failed["check_id"] not in accepted:
                failures.append(
                    f"{failed['check_id']} on {failed['resource']}: {failed['check_name']}"
                )
    if not scanned:
        failures.append(f"{name}: checkov recognised no resource (nothing was checked)")
    return failures
