"""What a pipeline parameter may make a step read: `data_source`, `eval_data`, `tokenizer`.

A parameter is typed by whoever starts a run, and the step reads it with the pod's rights:
the ServiceAccount token under /var/run/secrets, the node's /proc and /sys, and whatever
fsspec can reach (http, ftp, github, webhdfs, the "reference" and "data" filesystems, zip
and tar archives, chained URLs). So a source is one of:

- a local path (or `file://`) outside the system's own trees: /proc, /sys, /dev, /run,
  /var/run and /etc are refused, checked on the real path, so a symbolic link into them is
  refused too;
- an object store: s3 (s3a), gs (gcs), abfs (abfss, az); `memory://` (in-process, for tests);
- http(s) and hf (the Hugging Face Hub) only with `allow_http_sources=true`: a URL the pod
  fetches can be the cluster's own services or a cloud metadata endpoint.

Everything else is refused in one DataError line naming the parameter, the value and what
is accepted, before anything is read. (Kubernetes' NetworkPolicy egress rules are the
cluster's half of this: manifests/overlays.)
"""

from __future__ import annotations

import os
import re
from typing import Any

import fsspec
from fsspec.core import split_protocol

from kubellm.data.records import DataError

OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "memory"})
NETWORK = frozenset({"http", "https", "hf"})  # with allow_http_sources only
LOCAL = frozenset({"file", "local"})
REFUSED_ROOTS = ("/proc", "/sys", "/dev", "/run", "/var/run", "/etc")
_GLOB = re.compile(r"[*?\[]")
_ACCEPTED = (
    "a local path, file://, s3://, gs://, gcs:// or abfs:// (http://, https:// and hf:// "
    "with allow_http_sources=true)"
)


# The package each object store needs, and the kubellm extra that installs it
FILESYSTEMS = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
    "az": ("adlfs", "azure"),
}


def open_filesystem(value: str, what: str) -> tuple[Any, str]:
    """fsspec's (filesystem, path) for `value`; a filesystem whose package is not installed
    is one DataError line naming the extra that installs it (fsspec raises ImportError)."""
    try:
        return fsspec.core.url_to_fs(value)
    except ImportError as err:
        raise DataError(missing_filesystem(value, what, err)) from None


def missing_filesystem(value: str, what: str, err: ImportError) -> str:
    protocol = split_protocol(value)[0] or "file"
    package, extra = FILESYSTEMS.get(protocol, (str(err.name or "its fsspec package"), ""))
    how = f"pip install 'kubellm[{extra}]'" if extra else f"pip install {package}"
    return f"{what} {value!r}: reading {protocol}:// needs {package}, not installed ({how})"


def check_source(value: str, what: str, allow_http: bool = False) -> str | None:
    """Refuse `value` (one source, as a parameter gives it) unless it is a local path outside
    the system's trees or an accepted protocol; returns its protocol, None for a local path.
    `what` names the parameter in the error ("data_source", "eval_data", ...)."""
    if "::" in value:
        raise DataError(
            f"{what} {value!r}: chained fsspec URLs ('::') are not accepted; give {_ACCEPTED}"
        )
    protocol, path = split_protocol(value)
    if protocol is None or protocol in LOCAL:
        check_local(path, what)
        return None
    if protocol in NETWORK and not allow_http:
        raise DataError(
            f"{what} {value!r}: {protocol}:// sources are fetched by the step's pod, which can "
            "reach the cluster's own services; set allow_http_sources=true to allow them"
        )
    if protocol not in OBJECT_STORES | NETWORK:
        raise DataError(
            f"{what} {value!r}: the {protocol}:// protocol is not accepted; give {_ACCEPTED}"
        )
    return protocol


def check_local(path: str, what: str) -> None:
    """Refuse a local path (a glob's fixed part, or a file found) whose real path lies in
    one of REFUSED_ROOTS."""
    fixed = _GLOB.split(path, maxsplit=1)[0] or "."
    real = os.path.realpath(fixed)
    for root in REFUSED_ROOTS:
        if real == root or real.startswith(root + os.sep):
            shown = f" (really {real})" if os.path.normpath(path) != real else ""
            raise DataError(
                f"{what} {path!r}{shown} is under {root}: system and secret files are not data"
            )
