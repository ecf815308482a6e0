"""What the simulated cluster's controllers share: an informer-fed work queue, and helpers.

A FAKE's helper, for tests only. Each controller stands in for a real one (kubelet, Training
Operator, Katib, KServe) and works the way controller-runtime controllers do: every change the
fake API server makes (its watch events) is mapped to the key of the object to reconcile,
queued once, and reconciled on the controller's own thread; `requeue(key, after_s)` is
controller-runtime's `Result{RequeueAfter}`. Controllers change cluster state only through
the fake's test controls, so every change is a watch event clients see.
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time
import traceback
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .fake_k8s import Event, FakeK8s

if TYPE_CHECKING:
    from .sim_cluster import SimCluster

Key = tuple[str, str, str]  # plural, namespace, name
PLURALS = {
    "Pod": "pods",
    "PyTorchJob": "pytorchjobs",
    "Experiment": "experiments",
    "Trial": "trials",
    "InferenceService": "inferenceservices",
    "TrainJob": "trainjobs",
    "JobSet": "jobsets",
    "Job": "jobs",
}


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the sim's stand-in for a Service port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def controller_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The ownerReference with controller: true (metav1.GetControllerOf)."""
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def find_condition(status: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in status.get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None


def is_true(status: dict[str, Any], ctype: str) -> bool:
    cond = find_condition(status, ctype)
    return cond is not None and cond.get("status") == "True"


class Controller:
    """A reconcile loop on its own thread, fed by the fake's events."""

    name = "controller"

    def __init__(self, sim: SimCluster) -> None:
        self.sim = sim
        self.fake: FakeK8s = sim.fake
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Key]] = []
        self._immediate: set[Key] = set()
        self._seq = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"sim-{self.name}", daemon=True)

    def start(self) -> None:
        self.fake.add_listener(self._on_event)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def enqueue(self, key: Key, after_s: float = 0.0) -> None:
        """client-go's workqueue: Add is deduplicated while the key waits; AddAfter always
        schedules (a later reconcile is never swallowed by an earlier one)."""
        with self._cv:
            if after_s <= 0:
                if key in self._immediate:
                    return
                self._immediate.add(key)
            due = time.monotonic() + max(after_s, 0.0)
            heapq.heappush(self._heap, (due, next(self._seq), key))
            self._cv.notify_all()

    requeue = enqueue

    def _on_event(self, event: Event) -> None:
        for key in self.keys_for(event):
            self.enqueue(key)

    def keys_for(self, event: Event) -> Iterable[Key]:
        """The keys an event asks to reconcile (EnqueueRequestForObject / ForOwner)."""
        raise NotImplementedError

    def reconcile(self, key: Key) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stopping:
                        return
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        _, _, key = heapq.heappop(self._heap)
                        self._immediate.discard(key)
                        break
                    wait = self._heap[0][0] - now if self._heap else None
                    self._cv.wait(wait)
            try:
                self.reconcile(key)
            except Exception:  # a controller bug must fail the test, not hang it
                self.sim.errors.append(f"{self.name} {key}: {traceback.format_exc()}")

    # ---------------------------------------------------------------- helpers

    def get(self, key: Key) -> dict[str, Any] | None:
        return self.fake.get_object(key[0], key[2], key[1])

    @staticmethod
    def own_key(event: Event, plural: str) -> list[Key]:
        return [(plural, event.namespace, event.name)] if event.plural == plural else []

    @staticmethod
    def owner_key(event: Event, kind: str) -> list[Key]:
        ref = controller_of(event.obj)
        if ref is None or ref.get("kind") != kind:
            return []
        return [(PLURALS[kind], event.namespace, ref["name"])]

    def owned(self, plural: str, owner: dict[str, Any]) -> list[dict[str, Any]]:
        """The objects of `plural` whose controller is `owner` (by uid)."""
        uid = owner["metadata"]["uid"]
        ns = owner["metadata"]["namespace"]
        return [
            o
            for o in self.fake.list_objects(plural, ns)
            if (ref := controller_of(o)) is not None and ref.get("uid") == uid
        ]


def new_condition(
    status: dict[str, Any], ctype: str, cstatus: str, reason: str, message: str
) -> dict[str, Any] | None:
    """The condition both operators' setCondition would write, or None when the current one
    already has that status and reason (a no-op); lastTransitionTime moves only when the
    status does."""
    current = find_condition(status, ctype)
    if current and current.get("status") == cstatus and current.get("reason") == reason:
        return None
    now = now_rfc3339()
    new = {
        "type": ctype,
        "status": cstatus,
        "reason": reason,
        "message": message,
        "lastUpdateTime": now,
        "lastTransitionTime": now,
    }
    if current and current.get("status") == cstatus:
        new["lastTransitionTime"] = current.get("lastTransitionTime", now)
    return new
