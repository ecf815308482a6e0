"""Reading the API server's answers: Status messages, streamed bodies, transient errors.

Shared by the job lifecycle (client.py) and the pod log follower (pod_logs.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kubernetes.client.rest import ApiException

# HTTP status codes worth another try: the API server or the network hiccuped.
TRANSIENT = {429, 500, 502, 503, 504}


def api_message(e: ApiException) -> str:
    """The message of the API server's Status in `e`, else its HTTP reason."""
    try:
        status = json.loads(e.body or "")
    except (TypeError, ValueError):
        status = None
    message = status.get("message") if isinstance(status, dict) else None
    return str(message or e.reason or "")


def interrupt(resp: Any) -> None:
    """Wake a thread blocked reading `resp` (a urllib3 response) from another thread: shut
    its socket down, and leave closing the response to the reader (closing it under the
    reader's feet races inside http.client)."""
    try:
        resp.shutdown()  # urllib3 >= 2.3
    except AttributeError:
        with contextlib.suppress(Exception):
            resp.close()
    except Exception:  # already released or closed: nothing is blocked on it
        pass


def chunks(resp: Any) -> Iterator[bytes]:
    """The body of a streamed response as it arrives (chunked or not)."""
    if hasattr(resp, "read1"):
        while data := resp.read1(65536):
            yield data
    else:  # urllib3 < 2.3: chunked responses (what the API server sends) stream per chunk
        yield from resp.stream(None)


def uid_of(obj: dict[str, Any]) -> str | None:
    uid = (obj.get("metadata") or {}).get("uid")
    return str(uid) if uid else None


@dataclass(frozen=True)
class Lister:
    """A list call of the generated client (custom objects or pods) and its positional args."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]

    def opened(self, on_open: Callable[[Any], None] | None) -> Callable[..., Any]:
        """`fn` for Watch.stream: without the generated docstring, Watch hands back raw dicts
        (no model deserialization), and `on_open` sees each response (to shut it down)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            resp = self.fn(*args, **kwargs)
            if on_open is not None:
                on_open(resp)
            return resp

        return call
