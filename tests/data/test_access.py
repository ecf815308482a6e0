"""What a parameter may make a step read (kubellm.data.access): the sources issue 23 tried are
refused in one line before anything is written, and the sources users need still work.

Before the rules, `data_source=synthetic,<a service-account token file>` put the token's
text into the training shards and an `http://127.0.0.1:PORT/x.jsonl` source was fetched and
trained on: the first tests here fail that way without them.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubellm.data.access import check_source
from kubellm.data.prepare import PrepareParams, prepare
from kubellm.data.records import DataError
from kubellm.evaluate.tasks import load_task

TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
HOSTILE = [
    (f"synthetic,{TOKEN}", "is under /"),
    ("/proc/self/environ", "is under /proc"),
    ("/etc/passwd", "is under /etc"),
    ("file:///sys/kernel/notes", "is under /sys"),
    ("ftp://example.com/x.jsonl", "the ftp:// protocol is not accepted"),
    ("github://org:repo@/x.jsonl", "the github:// protocol is not accepted"),
    ("reference://x.jsonl", "the reference:// protocol is not accepted"),
    ("webhdfs://host/x.jsonl", "the webhdfs:// protocol is not accepted"),
    ("zip://x.jsonl::file:///tmp/a.zip", "chained fsspec URLs"),
    ("simplecache::s3://bucket/x.jsonl", "chained fsspec URLs"),
    ("https://example.com/x.jsonl", "set allow_http_sources=true"),
    ("hf://datasets/org/name/x.jsonl", "set allow_http_sources=true"),
]


def _params(source: str, **kw: object) -> PrepareParams:
    return PrepareParams(source=source, num_records=50, vocab_size=300, seq_len=16, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("source", "why"), HOSTILE)
def test_a_hostile_data_source_is_refused_in_one_line_and_nothing_is_written(
    tmp_path: Path, source: str, why: str
) -> None:
    out = tmp_path / "out"
    with pytest.raises(DataError) as err:
        prepare(_params(source), out)
    message = str(err.value)
    assert why in message and "\n" not in message
    assert not out.exists()


@pytest.fixture()
def http_source(tmp_path: Path) -> Iterator[str]:
    """A JSONL file behind a real HTTP server on loopback, as a cluster service would be."""
    (tmp_path / "site").mkdir()
    rows = [{"text": f"{i}+{i}={2 * i}"} for i in range(40)]
    (tmp_path / "site" / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: object, **k: object) -> None:
            super().__init__(*a, directory=str(tmp_path / "site"), **k)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/x.jsonl"
    finally:
        server.shutdown()


def test_an_http_source_needs_the_parameter(tmp_path: Path, http_source: str) -> None:
    with pytest.raises(DataError, match="allow_http_sources=true"):
        prepare(_params(http_source), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    manifest = prepare(_params(http_source, allow_http=True), tmp_path / "allowed")
    assert manifest["records"]["read"] == 40


def test_a_link_in_a_data_folder_into_proc_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text('{"text": "1+1=2"}\n')
    (data / "b.jsonl").symlink_to("/proc/self/environ")
    with pytest.raises(DataError, match=r"b.jsonl.*really /proc/.*is under /proc"):
        prepare(_params(str(data)), tmp_path / "out")
    assert not list((tmp_path / "out").glob("**/*.parquet"))


def test_a_tokenizer_folder_under_a_system_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        DataError, match=r"tokenizer '/proc/self' \(really /proc/\d+\) is under /proc"
    ):
        prepare(_params("synthetic", tokenizer="/proc/self"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_hostile_eval_data_is_refused() -> None:
    with pytest.raises(DataError, match=r"eval_data '/proc/self/environ' .* is under /proc"):
        load_task("/proc/self/environ")
    with pytest.raises(DataError, match=r"eval_data 'ftp://h/t\.jsonl': the ftp:// protocol"):
        load_task("ftp://h/t.jsonl")


def test_local_paths_file_uris_and_object_stores_still_work(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"{i}+1={i + 1}"}) + "\n" for i in range(30)))
    for i, source in enumerate((str(data), f"file://{data}", f"synthetic,{data}")):
        manifest = prepare(_params(source), tmp_path / f"out{i}")
        assert manifest["records"]["kept"] == 30 + (50 if "synthetic" in source else 0), source
    for uri in ("s3://b/x.jsonl", "gs://b/x", "gcs://b/x", "abfs://c/x", "memory://x"):
        assert check_source(uri, "data_source") == uri.split("://")[0]
    assert check_source("https://h/x", "eval_data", allow_http=True) == "https"


@pytest.mark.parametrize(
    ("uri", "module", "extra"),
    [
        ("s3://b/x.jsonl", "s3fs", "s3"),
        ("gs://b/x.jsonl", "gcsfs", "gcs"),
        ("abfs://c/x", "adlfs", "azure"),
    ],
)
def test_an_object_store_without_its_package_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, uri: str, module: str, extra: str
) -> None:
    import importlib
    import sys

    registry = importlib.import_module("fsspec.registry")._registry  # classes imported so far
    monkeypatch.setitem(sys.modules, module, None)  # not installed, whatever this venv has
    for protocol in ("s3", "gs", "gcs", "abfs"):
        monkeypatch.delitem(registry, protocol, raising=False)
    with pytest.raises(DataError) as err:
        prepare(_params(uri), tmp_path / "out")
    assert str(err.value) == (
        f"data_source {uri!r}: reading {uri.split(':')[0]}:// needs {module}, not installed "
        f"(pip install 'kubellm[{extra}]')"
    )
    with pytest.raises(DataError, match=rf"eval_data .*kubellm\[{extra}\]"):
        load_task(uri)
