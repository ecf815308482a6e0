"""Credentials out of what kubellm logs, prints or stores.

A tracking URI (or any URL) may carry a password: `http://user:secret@mlflow:5000`. MLflow
would send it as basic auth, and kubellm would copy it into MLflow params, stage reports,
error messages and job logs, where anyone who can read the experiment can read it. Every
such text goes through `redact`, which keeps the user and replaces the password (or a lone
token) with `***`. The way to give MLflow credentials is MLFLOW_TRACKING_USERNAME and
MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) from the Secret the pods read, never a
parameter: a pipeline parameter is shown in KFP's UI and stored with the run.
"""

from __future__ import annotations

import re

HIDDEN = "***"
# scheme://userinfo@ where userinfo has no '/', '@' or whitespace
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^/@\s]+)@")


def _hide(m: re.Match[str]) -> str:
    user, sep, _ = m["info"].partition(":")
    shown = f"{user}:{HIDDEN}" if sep else HIDDEN  # a lone userinfo is a token
    return f"{m['scheme']}{shown}@"


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it hidden (`user:***@`, `***@`)."""
    return _USERINFO.sub(_hide, text) if "@" in text else text
