"""Following the logs of a job's pods while it runs (`KubeClient.run(follow_logs=...)`).

Each pod the selector picks is followed by uid in its own thread: its log streamed with
`follow=true`, every line echoed into the step's own log prefixed with the pod's name,
and the bytes kept, so the trainer parses metrics from the complete text afterwards.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import urllib3
from kubernetes.client.rest import ApiException

from kubellm.backends.kubernetes.responses import (
    TRANSIENT,
    Lister,
    api_message,
    chunks,
    interrupt,
)


class LogSource(Protocol):
    """What PodLogs asks of the Kubernetes client (kubellm.backends.kubernetes.client's
    KubeClient is the one there is). Typed here, so that this module does not import
    client.py, which imports it to follow a job's logs."""

    request_timeout_s: float

    @property
    def core(self) -> Any: ...  # kubernetes.client.CoreV1Api

    def events(
        self,
        lister: Lister,
        selector: dict[str, str],
        deadline: float | Callable[[], float],
        stopped: Callable[[], bool] = ...,
        on_open: Callable[[Any], None] | None = None,
    ) -> Iterator[Any]: ...

    def pause(self, failures: int, deadline: float, stopped: Callable[[], bool] = ...) -> None: ...

    def pod_log(
        self, namespace: str, label_selector: str, container: str | None = None
    ) -> tuple[str, str]: ...


def not_started(e: ApiException) -> bool:
    """A 400 for a log asked for too early: `container "x" in pod "y" is waiting to start:
    ContainerCreating` (or PodInitializing); other 400s will not pass by themselves."""
    return e.status == 400 and any(
        word in api_message(e) for word in ("waiting to start", "PodInitializing")
    )


@dataclass
class Segment:
    """The log of one container run: a pod (by uid) and its restart count."""

    pod: str
    data: bytearray = field(default_factory=bytearray)
    partial: bytearray = field(default_factory=bytearray)  # a line not yet ended by "\n"
    complete: bool = False  # read up to the end of a container that has terminated


class PodLogs:
    """Follows the logs of the pods a label selector picks, in background threads.

    A discovery thread watches the pods; each pod (by uid) whose container has started gets
    a follower thread that streams its log (`follow=true`), echoes each line prefixed with
    the pod's name and keeps the bytes. A stream that ends while the container runs (the
    connection dropped) is opened again and what was already read is skipped; a pod
    replaced under the same name (new uid) gets its own follower. Pods controlled by
    another incarnation of the job (`kind` with a different uid) are not followed.
    """

    def __init__(
        self,
        kube: LogSource,
        namespace: str,
        selector: str,
        container: str | None,
        echo: Callable[[str], None],
        owner_kind: str,
        owner_uid: str | None,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.selector = selector
        self.container = container
        self.echo = echo
        self.owner_kind = owner_kind
        self.owner_uid = owner_uid
        self._lock = threading.Lock()
        self._segments: dict[tuple[str, int], Segment] = {}  # in the order they started
        self._followed: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._open: set[Any] = set()  # log streams being read, for close() to cut
        self._watch: Any = None  # the discovery's current watch response, likewise
        self._closing = threading.Event()  # the job is over: finish current streams
        self._stop = threading.Event()  # stop now
        self._closed = False
        self._errors: list[str] = []

    def start(self) -> None:
        self._spawn(self._discover, f"logs:{self.selector}")

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            if self._stop.is_set():
                return
            thread.start()
            self._threads.append(thread)

    def _track(self, resp: Any) -> None:
        with self._lock:
            self._open.add(resp)
        if self._stop.is_set():
            interrupt(resp)

    def _watching(self, resp: Any) -> None:
        """The discovery opened a watch (Watch.stream closes it when done)."""
        with self._lock:
            self._watch = resp
        if self._stop.is_set():
            interrupt(resp)

    def _untrack(self, resp: Any) -> None:
        with self._lock:
            self._open.discard(resp)

    # ----------------------------------------------------------- threads

    def _discover(self) -> None:
        lister = Lister(self.kube.core.list_namespaced_pod, (self.namespace,))
        try:
            for event in self.kube.events(
                lister,
                {"label_selector": self.selector},
                math.inf,
                stopped=self._stop.is_set,
                on_open=self._watching,
            ):
                pods = event.items if event.type == "LIST" else (event.obj,)
                if event.type == "DELETED":
                    continue
                for pod in pods:
                    self._maybe_follow(pod)
        except Exception as e:  # a log we cannot read is reported, never fatal to the job
            self._errors.append(f"watching pods {self.selector}: {e}")

    def _maybe_follow(self, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        name = str(meta.get("name") or "")
        uid = str(meta.get("uid") or name)
        if not name or uid in self._followed or self._stop.is_set():
            return
        if (pod.get("status") or {}).get("phase") not in ("Running", "Succeeded", "Failed"):
            return  # its container has not started: no log yet
        for ref in meta.get("ownerReferences") or []:
            theirs = ref.get("controller") and ref.get("kind") == self.owner_kind
            if theirs and self.owner_uid and ref.get("uid") != self.owner_uid:
                return  # a pod of an earlier job of this name, on its way out
        self._followed.add(uid)
        self._spawn(self._follow, f"log:{name}", name, uid)

    def _follow(self, pod: str, uid: str) -> None:
        failures = 0
        restarts = -1
        segment: Segment | None = None
        while not self._stop.is_set():
            state, restarts_now = self._pod_state(pod, uid)
            if state == "gone":
                return
            if segment is None or restarts_now != restarts:
                restarts = restarts_now
                with self._lock:
                    segment = self._segments.setdefault((uid, restarts), Segment(pod))
            ended = self._stream(pod, segment)
            if ended in ("fatal", "stopped"):
                return  # a stopped stream may have missed the end: close() reads it again
            if ended == "retry":
                failures += 1
                self.kube.pause(failures, math.inf, self._stop.is_set)
                continue
            failures = 0
            state, _ = self._pod_state(pod, uid)
            if state in ("terminated", "gone"):
                segment.complete = state == "terminated"
                return
            if self._closing.is_set():
                return
            # The stream ended with the container still running (a dropped connection, a
            # restart): open it again, after a pause so a stream that ends at once is no loop.
            self.kube.pause(1, math.inf, self._stop.is_set)

    def _stream(self, pod: str, segment: Segment) -> Literal["end", "retry", "fatal", "stopped"]:
        """Read the log from its start, skipping what `segment` already has: `end` when the
        stream ended, `stopped` when close() cut it, `retry` after an error worth retrying,
        `fatal` after one that is not."""
        kwargs: dict[str, Any] = {"container": self.container} if self.container else {}
        try:
            resp = self.kube.core.read_namespaced_pod_log(
                pod,
                self.namespace,
                follow=True,
                _preload_content=False,
                _request_timeout=(self.kube.request_timeout_s, None),
                **kwargs,
            )
        except ApiException as e:
            if e.status in (404, *TRANSIENT) or not_started(e):  # gone, a hiccup, too early
                return "retry"
            self._errors.append(f"reading the log of {pod}: {_why(e)}")
            return "fatal"  # e.g. 400 for a container the pod does not have, 403
        except (OSError, urllib3.exceptions.HTTPError):
            return "retry"
        self._track(resp)
        skip = len(segment.data)
        try:
            for chunk in chunks(resp):
                if skip:
                    dropped = min(skip, len(chunk))
                    chunk, skip = chunk[dropped:], skip - dropped
                if chunk:
                    self._append(segment, chunk)
        except Exception:  # a dropped connection (or one shut down by close())
            return "stopped" if self._stop.is_set() else "retry"
        finally:
            self._untrack(resp)
            with contextlib.suppress(Exception):
                resp.close()
        return "stopped" if self._stop.is_set() else "end"

    def _pod_state(self, pod: str, uid: str) -> tuple[str, int]:
        """(`running` | `terminated` | `gone`, restart count of the log's container)."""
        try:
            obj = self.kube.core.read_namespaced_pod(
                pod,
                self.namespace,
                _preload_content=False,
                _request_timeout=self.kube.request_timeout_s,
            )
            data = json.loads(obj.data)
        except ApiException as e:
            if e.status == 404:
                return "gone", 0
            return "running", 0
        except (OSError, urllib3.exceptions.HTTPError, ValueError):
            return "running", 0
        meta = data.get("metadata") or {}
        if (meta.get("uid") or meta.get("name")) != uid:
            return "gone", 0
        status = data.get("status") or {}
        statuses = status.get("containerStatuses") or []
        mine = [s for s in statuses if s.get("name") == self.container] or statuses[:1]
        restarts = int(mine[0].get("restartCount") or 0) if mine else 0
        if status.get("phase") in ("Succeeded", "Failed"):
            return "terminated", restarts
        return "running", restarts

    def _append(self, segment: Segment, chunk: bytes) -> None:
        with self._lock:
            segment.data += chunk
            segment.partial += chunk
            *lines, rest = bytes(segment.partial).split(b"\n")
            segment.partial = bytearray(rest)
        for line in lines:
            self.echo(f"[{segment.pod}] {line.decode('utf-8', 'replace')}")

    # ----------------------------------------------------------- the end

    def close(self, drain_s: float) -> str:
        """Stop following (after up to `drain_s` for the streams to reach their end) and
        return the whole text. Idempotent: later calls return the same text."""
        if not self._closed:
            self._closed = True
            self._closing.set()
            end = time.monotonic() + drain_s
            # Followers may still start (a pod seen late): wait for those too, to the end.
            while (left := end - time.monotonic()) > 0 and (alive := self._followers()):
                alive[0].join(left)
            with self._lock:
                self._stop.set()  # no follower starts after this
                streams = [*self._open, *([self._watch] if self._watch is not None else [])]
            for resp in streams:
                interrupt(resp)
            for thread in list(self._threads):
                thread.join(1.0)
            if drain_s > 0:
                self._complete()
            for segment in list(self._segments.values()):
                if segment.partial:
                    self.echo(f"[{segment.pod}] {segment.partial.decode('utf-8', 'replace')}")
                    segment.partial.clear()
            if not self._segments and drain_s > 0:
                self._fallback(time.monotonic() + drain_s)
        return self.text()

    def _followers(self) -> list[threading.Thread]:
        """The follower threads still running."""
        with self._lock:
            return [t for t in self._threads if t.name.startswith("log:") and t.is_alive()]

    def _complete(self) -> None:
        """Read once more (no follow) the pods whose stream ended before their container
        did, and keep what the stream missed."""
        for (uid, _), segment in list(self._segments.items()):
            if segment.complete:
                continue
            state, _ = self._pod_state(segment.pod, uid)
            if state == "gone":
                continue
            try:
                data = self._read(segment.pod)
            except Exception as e:
                self._errors.append(f"reading the log of {segment.pod}: {_why(e)}")
                continue
            if len(data) > len(segment.data) and data.startswith(bytes(segment.data)):
                self._append(segment, data[len(segment.data) :])

    def _fallback(self, deadline: float) -> None:
        """No pod was followed (it came and went between two looks, or the API server
        answered the discovery with errors until the job ended): read the log once, of the
        pod `KubeClient.pod_log` picks, retrying transient errors until `deadline`."""
        failures = 0
        while True:
            try:
                pod, text = self.kube.pod_log(self.namespace, self.selector, self.container)
                break
            except (ApiException, OSError, urllib3.exceptions.HTTPError) as e:
                transient = not isinstance(e, ApiException) or e.status in TRANSIENT
                if transient and time.monotonic() < deadline:
                    failures += 1
                    self.kube.pause(failures, deadline)
                    continue
                self._errors.append(f"reading the log of {self.selector}: {_why(e)}")
                return
            except Exception as e:  # e.g. LookupError: no pod matches
                self._errors.append(f"reading the log of {self.selector}: {_why(e)}")
                return
        data = text.encode()
        segment = Segment(pod)
        self._segments[(pod, 0)] = segment
        self._append(segment, data)

    def _read(self, pod: str) -> bytes:
        kwargs: dict[str, Any] = {"container": self.container} if self.container else {}
        resp = self.kube.core.read_namespaced_pod_log(
            pod,
            self.namespace,
            _preload_content=False,
            _request_timeout=self.kube.request_timeout_s,
            **kwargs,
        )
        data = resp.data
        return data if isinstance(data, bytes) else str(data).encode()

    def text(self) -> str:
        """Every segment's text in the order they started, each but the last ended by a
        newline so one's last line does not run into the next one's first."""
        with self._lock:
            parts = [bytes(s.data) for s in self._segments.values() if s.data]
        ended = [p if p.endswith(b"\n") else p + b"\n" for p in parts[:-1]]
        return b"".join([*ended, *parts[-1:]]).decode("utf-8", "replace")

    def tail(self, lines: int) -> str:
        """The last `lines` lines of the newest log, headed by its pod's name; empty if none."""
        with self._lock:
            segments = [s for s in self._segments.values() if s.data.strip()]
        if not segments:
            return ""
        last = segments[-1]
        text = bytes(last.data).decode("utf-8", "replace").rstrip()
        return f"\n--- last lines of {last.pod} ---\n" + "\n".join(text.splitlines()[-lines:])

    def error(self, text: str) -> str | None:
        """Why no log came back, if none did."""
        if text or not self._errors:
            return None
        return "; ".join(dict.fromkeys(self._errors))  # each once


def _why(e: Exception) -> str:
    """An API error as `HTTP <status> <message>`, any other as its text."""
    return f"HTTP {e.status} {api_message(e)}" if isinstance(e, ApiException) else str(e)
