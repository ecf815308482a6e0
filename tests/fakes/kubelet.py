"""The simulated cluster's scheduler and kubelet: pods run as local processes.

A FAKE, for tests only. One node ("sim-node") runs every pod. What it does, and what the
real component does it for:

- scheduler (kube-scheduler): a pod whose containers ask, in `resources.limits`, for more of
  an extended resource (`nvidia.com/gpu`, `rdma/...`: anything but cpu, memory,
  ephemeral-storage and hugepages) than the node has free stays Pending with condition
  PodScheduled=False, reason Unschedulable, message `0/1 nodes are available: 1
  Insufficient nvidia.com/gpu.`, and is retried when another pod ends. A pod whose
  persistentVolumeClaim does not exist (no `sim.pvc_dir(name)` yet) is unschedulable with
  `persistentvolumeclaim "x" not found`. cpu and memory are not accounted.
- kubelet: runs the pod's first container's `command + args` as a subprocess (`$(VAR)`
  references expanded as the kubelet does; `python`/`python3` as argv[0] becomes
  sys.executable; other executables are looked up on PATH with the venv's bin first). The
  environment is os.environ (PATH etc.: the "image" is this venv) plus the container's
  `envFrom` and `env`: values, `secretKeyRef` / `configMapKeyRef` from `sim.secrets` /
  `sim.config_maps[(ns, name)]` (missing and optional: unset; missing and required: the
  pod stays Pending with the container waiting in CreateContainerConfigError and the
  kubelet's message, and is retried, as a real kubelet does), `fieldRef` (metadata.name,
  namespace, uid, labels['k'], annotations['k'], spec.nodeName, spec.serviceAccountName,
  status.podIP, status.hostIP). cwd is `workingDir` when it exists locally, else a per-pod
  directory under the sim's tmp dir. stdout and stderr go to the pod log as they come.
  Exit: phase Succeeded (0) or Failed, with the container's terminated state (exitCode;
  reason Completed or Error; a signal N is exit 128+N). restartPolicy Always/OnFailure
  restarts the container in place (restartCount+1, lastState terminated, state waiting
  CrashLoopBackOff for a short back-off, 0.2 s here instead of 10 s doubling). A missing
  executable is the runtime's StartError (exitCode 128).
- volumes: a `persistentVolumeClaim` volume is the directory `sim.pvc_dir(claim)`, and the
  sim cannot remap paths, so the container must mount it exactly there
  (mountPath == str(sim.pvc_dir(claim)), or that plus `/subPath`); the code under test runs
  with KUBELLM_WORKSPACE_MOUNT set to that directory so it does. Any other mountPath fails
  the pod at once with reason FailedMount and a message naming both paths (a real kubelet
  would keep it Pending with a FailedMount event; failing fast names the mistake). Other
  volume kinds (emptyDir, configMap, ...) are not provided.
- deletion: the pod object goes at once (see fake_k8s); its process gets SIGTERM, then
  SIGKILL after terminationGracePeriodSeconds (default 30, capped by the sim, 5 s default).
  Every process is killed when the sim stops.

Pods stored by a test as Running or finished (FakeK8s.add_pod(phase=...)) are left alone.
Not simulated: init containers, sidecars (only the first container runs; the others mirror
its state), probes, images, resource limits, ports (programs use 127.0.0.1 and real ports).
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fake_k8s import ApiError, Event
from .sim_base import Controller, Key, now_rfc3339

NODE = "sim-node"
POD_IP = "127.0.0.1"
_STANDARD = ("cpu", "memory", "ephemeral-storage")


class ConfigError(Exception):
    """CreateContainerConfigError: the kubelet cannot build the container's environment."""


def expand(text: str, env: dict[str, str]) -> str:
    """`$(VAR)` expansion as the kubelet does it (third_party/forked/golang/expansion):
    a defined VAR is replaced, an undefined one stays as written, `$$` is a literal `$`."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2 : end]
            out.append(env.get(name, text[i : end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def extended_requests(pod: dict[str, Any]) -> dict[str, int]:
    """The extended resources a pod's containers ask for (their limits, as for GPUs)."""
    out: dict[str, int] = {}
    for c in (pod.get("spec") or {}).get("containers") or []:
        limits = (c.get("resources") or {}).get("limits") or {}
        for name, qty in limits.items():
            if name in _STANDARD or name.startswith("hugepages-"):
                continue
            out[name] = out.get(name, 0) + int(str(qty))
    return out


@dataclass
class _Proc:
    key: Key
    uid: str
    grace_s: float
    proc: subprocess.Popen[bytes] | None = None
    deleted: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Kubelet(Controller):
    """Scheduler and kubelet of the one node."""

    name = "kubelet"

    def __init__(self, sim: Any) -> None:
        super().__init__(sim)
        self._lock = threading.Lock()
        self._procs: dict[str, _Proc] = {}  # by pod uid
        self._allocated: dict[str, dict[str, int]] = {}  # pod uid -> extended resources
        self._unschedulable: set[Key] = set()
        self._threads: list[threading.Thread] = []

    @property
    def capacity(self) -> dict[str, int]:
        cap = {"nvidia.com/gpu": self.sim.gpus_per_node}
        cap.update(self.sim.extended)
        return cap

    def start(self) -> None:
        self.fake.on_delete("pods", self._on_pod_deleted)
        super().start()

    def keys_for(self, event: Event) -> Iterable[Key]:
        if event.plural != "pods" or event.type == "DELETED":
            return []
        return [("pods", event.namespace, event.name)]

    # ------------------------------------------------------------ reconcile

    def reconcile(self, key: Key) -> None:
        pod = self.get(key)
        if pod is None:
            return
        uid = pod["metadata"]["uid"]
        status = pod.get("status") or {}
        with self._lock:
            # Only Pending pods are for this node to run: a pod a test stored as Running or
            # finished (FakeK8s.add_pod) is someone else's.
            if uid in self._procs or status.get("phase", "Pending") != "Pending":
                return
        spec = pod.get("spec") or {}
        if not spec.get("containers"):
            return
        why = self._unschedulable_reason(pod)
        if why:
            self._unschedulable.add(key)
            cond = {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": why,
                "lastTransitionTime": now_rfc3339(),
            }
            current = find_cond(status, "PodScheduled") or {}
            if (current.get("status"), current.get("message")) != ("False", why):
                self._set_status(key, {"phase": "Pending", "conditions": [cond]})
            return
        self._unschedulable.discard(key)
        with self._lock:
            self._allocated[uid] = extended_requests(pod)
        container = spec["containers"][0]
        mount_error = self._mount_error(pod, container)
        if mount_error:
            self._set_status(
                key,
                self._status(pod, "Failed", None, reason="FailedMount", message=mount_error),
            )
            self._release(uid)
            return
        try:
            env = self._env(pod, container)
        except ConfigError as e:
            waiting = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            self._set_status(key, self._status(pod, "Pending", waiting))
            self._release(uid)
            self.requeue(key, 0.5)  # the kubelet retries; a secret created later lets it run
            return
        grace = spec.get("terminationGracePeriodSeconds", 30)
        proc = _Proc(key, uid, min(float(grace), self.sim.grace_cap_s))
        with self._lock:
            self._procs[uid] = proc
        thread = threading.Thread(
            target=self._run_pod,
            args=(proc, pod, container, env),
            name=f"pod-{key[2]}",
            daemon=True,
        )
        self._threads.append(thread)
        thread.start()

    def _unschedulable_reason(self, pod: dict[str, Any]) -> str | None:
        for vol in (pod.get("spec") or {}).get("volumes") or []:
            claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and not self.sim.pvc_exists(claim):
                return f'0/1 nodes are available: persistentvolumeclaim "{claim}" not found.'
        wanted = extended_requests(pod)
        with self._lock:
            used: dict[str, int] = {}
            for alloc in self._allocated.values():
                for name, n in alloc.items():
                    used[name] = used.get(name, 0) + n
        short = sorted(
            name for name, n in wanted.items() if n > self.capacity.get(name, 0) - used.get(name, 0)
        )
        if short:
            insufficient = ", ".join(f"1 Insufficient {s}" for s in short)
            return f"0/1 nodes are available: {insufficient}."
        return None

    def _mount_error(self, pod: dict[str, Any], container: dict[str, Any]) -> str | None:
        volumes = {v.get("name"): v for v in (pod.get("spec") or {}).get("volumes") or []}
        for mount in container.get("volumeMounts") or []:
            vol = volumes.get(mount.get("name"))
            if vol is None:
                return f"volumeMount {mount.get('name')!r} names no volume of the pod"
            claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
            if not claim:
                continue
            expected = self.sim.pvc_dir(claim)
            if mount.get("subPath"):
                expected = expected / mount["subPath"]
                expected.mkdir(parents=True, exist_ok=True)
            if mount.get("mountPath") != str(expected):
                return (
                    f'MountVolume.SetUp failed for volume "{vol["name"]}": the sim provides '
                    f"persistentVolumeClaim {claim} only at {expected} (sim.pvc_dir), but the "
                    f"container mounts it at {mount.get('mountPath')}; run the code under test "
                    "with KUBELLM_WORKSPACE_MOUNT set to the sim's directory (sim.env())"
                )
        return None

    def _env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        ns = pod["metadata"]["namespace"]
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        declared: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            for kind, store in (
                ("secretRef", self.sim.secrets),
                ("configMapRef", self.sim.config_maps),
            ):
                ref = source.get(kind)
                if ref is None:
                    continue
                data = store.get((ns, ref["name"]))
                if data is None:
                    if ref.get("optional"):
                        continue
                    what = "secret" if kind == "secretRef" else "configmap"
                    raise ConfigError(f'{what} "{ref["name"]}" not found')
                declared.update({prefix + k: v for k, v in data.items()})
        for var in container.get("env") or []:
            name = var["name"]
            if "valueFrom" not in var:
                declared[name] = expand(str(var.get("value", "")), declared)
                continue
            value = self._value_from(pod, container, var["valueFrom"], ns)
            if value is None:
                declared.pop(name, None)
            else:
                declared[name] = value
        env.update(declared)
        return env

    def _value_from(
        self, pod: dict[str, Any], container: dict[str, Any], source: dict[str, Any], ns: str
    ) -> str | None:
        for kind, store, what in (
            ("secretKeyRef", self.sim.secrets, "Secret"),
            ("configMapKeyRef", self.sim.config_maps, "ConfigMap"),
        ):
            ref = source.get(kind)
            if ref is None:
                continue
            data = store.get((ns, ref["name"]))
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    return None
                if data is None:
                    raise ConfigError(f'{what.lower()} "{ref["name"]}" not found')
                raise ConfigError(f"couldn't find key {ref['key']} in {what} {ns}/{ref['name']}")
            return str(data[ref["key"]])
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            meta = pod["metadata"]
            simple = {
                "metadata.name": meta["name"],
                "metadata.namespace": meta["namespace"],
                "metadata.uid": meta["uid"],
                "spec.nodeName": NODE,
                "spec.serviceAccountName": (pod.get("spec") or {}).get(
                    "serviceAccountName", "default"
                ),
                "status.podIP": POD_IP,
                "status.hostIP": POD_IP,
            }
            if path in simple:
                return simple[path]
            if m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
                return str((meta.get(m[1]) or {}).get(m[2], ""))
            raise ConfigError(f"unsupported fieldPath {path!r}")
        if "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            kind, _, res = ref["resource"].partition(".")
            value = ((container.get("resources") or {}).get(kind) or {}).get(res)
            return str(value if value is not None else 0)
        raise ConfigError(f"unsupported valueFrom {sorted(source)}")

    # ------------------------------------------------------------ running

    def _argv(self, container: dict[str, Any], env: dict[str, str]) -> list[str]:
        argv = [expand(str(a), env) for a in (container.get("command") or [])]
        argv += [expand(str(a), env) for a in (container.get("args") or [])]
        if not container.get("command"):
            raise FileNotFoundError("the sim has no image ENTRYPOINT: give the container a command")
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        elif os.sep not in argv[0]:
            found = shutil.which(argv[0], path=env.get("PATH"))
            if found is None:
                raise FileNotFoundError(f'exec: "{argv[0]}": executable file not found in $PATH')
            argv[0] = found
        return argv

    def _workdir(self, pod: dict[str, Any], container: dict[str, Any]) -> Path:
        wanted = container.get("workingDir")
        if wanted and Path(wanted).is_dir():
            return Path(wanted)
        meta = pod["metadata"]
        path = self.sim.tmp_path / "pods" / meta["namespace"] / f"{meta['name']}-{meta['uid'][:8]}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _run_pod(
        self, proc: _Proc, pod: dict[str, Any], container: dict[str, Any], env: dict[str, str]
    ) -> None:
        ns, name = proc.key[1], proc.key[2]
        policy = (pod.get("spec") or {}).get("restartPolicy") or "Always"
        restarts = 0
        last: dict[str, Any] | None = None
        try:
            while not proc.deleted:
                started = now_rfc3339()
                try:
                    argv = self._argv(container, env)
                    with self._lock:
                        if proc.deleted:
                            return
                        proc.proc = subprocess.Popen(
                            argv,
                            cwd=self._workdir(pod, container),
                            env=env,
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                except OSError as e:
                    message = (
                        "failed to create containerd task: failed to create shim task: OCI "
                        f"runtime create failed: unable to start container process: {e}: unknown"
                    )
                    terminated = {
                        "exitCode": 128,
                        "reason": "StartError",
                        "message": message,
                        "startedAt": "1970-01-01T00:00:00Z",
                        "finishedAt": now_rfc3339(),
                    }
                    self.fake.append_log(ns, name, message + "\n")
                else:
                    running = {"running": {"startedAt": started}}
                    self._set_status(
                        proc.key, self._status(pod, "Running", running, restarts, last)
                    )
                    self._pump(proc, ns, name)
                    code = proc.proc.wait()
                    if code < 0:
                        code = 128 - code  # killed by signal N: 128+N, as the runtime reports
                    terminated = {
                        "exitCode": code,
                        "reason": "Completed" if code == 0 else "Error",
                        "startedAt": started,
                        "finishedAt": now_rfc3339(),
                    }
                if proc.deleted:
                    return
                state = {"terminated": terminated}
                if policy == "Always" or (policy == "OnFailure" and terminated["exitCode"] != 0):
                    restarts, last = restarts + 1, state
                    backoff = {
                        "waiting": {
                            "reason": "CrashLoopBackOff",
                            "message": "back-off 10s restarting failed container="
                            + container["name"],
                        }
                    }
                    self._set_status(
                        proc.key, self._status(pod, "Running", backoff, restarts, last)
                    )
                    time.sleep(0.2)
                    continue
                phase = "Succeeded" if terminated["exitCode"] == 0 else "Failed"
                self._set_status(proc.key, self._status(pod, phase, state, restarts, last))
                return
        finally:
            proc.done.set()
            self._release(proc.uid)

    def _pump(self, proc: _Proc, ns: str, name: str) -> None:
        """Copy the process's output to the pod log as it comes."""
        assert proc.proc is not None and proc.proc.stdout is not None
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        out = proc.proc.stdout
        while chunk := out.read1(65536):  # type: ignore[attr-defined]
            text = decoder.decode(chunk)
            if text:
                self.fake.append_log(ns, name, text)
        tail = decoder.decode(b"", final=True)
        if tail:
            self.fake.append_log(ns, name, tail)

    def _release(self, uid: str) -> None:
        with self._lock:
            self._allocated.pop(uid, None)
        for key in list(self._unschedulable):
            self.enqueue(key)

    # ------------------------------------------------------------ status

    def _status(
        self,
        pod: dict[str, Any],
        phase: str,
        state: dict[str, Any] | None,
        restarts: int = 0,
        last: dict[str, Any] | None = None,
        *,
        reason: str | None = None,
        message: str | None = None,
    ) -> dict[str, Any]:
        now = now_rfc3339()
        ready = phase == "Running" and state is not None and "running" in state
        prior = pod.get("status") or {}
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": POD_IP,
            "podIP": POD_IP,
            "startTime": prior.get("startTime") or now,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                *(
                    {"type": t, "status": str(ready), "lastTransitionTime": now}
                    for t in ("ContainersReady", "Ready")
                ),
            ],
        }
        if state is not None:
            status["containerStatuses"] = [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": ready,
                    "started": ready,
                    "restartCount": restarts,
                    "state": state,
                    **({"lastState": last} if last else {}),
                }
                for c in pod["spec"]["containers"]
            ]
        if reason:
            status["reason"] = reason
        if message:
            status["message"] = message
        return status

    def _set_status(self, key: Key, status: dict[str, Any]) -> None:
        with contextlib.suppress(ApiError):  # the pod was deleted meanwhile
            self.fake.set_status("pods", key[2], status, namespace=key[1])

    def signal_pod(self, namespace: str, name: str, signum: int) -> None:
        """Send `signum` to a running pod's process group. Tests play a hung container this
        way (SIGSTOP: it keeps its port and answers nothing; SIGCONT resumes it), a failure
        a real node shows when a process deadlocks or is starved."""
        key = ("pods", namespace, name)
        with self._lock:
            popen = next((p.proc for p in self._procs.values() if p.key == key), None)
        if popen is None or popen.poll() is not None:
            raise LookupError(f"pod {namespace}/{name} has no running process")
        os.killpg(popen.pid, signum)

    # ------------------------------------------------------------ deletion

    def _on_pod_deleted(self, _fake: Any, pod: dict[str, Any]) -> None:
        """Called under the fake's lock: only starts the termination."""
        key = ("pods", pod["metadata"]["namespace"], pod["metadata"]["name"])
        self._unschedulable.discard(key)
        with self._lock:
            proc = self._procs.get(pod["metadata"]["uid"])
            if proc is None:
                self._allocated.pop(pod["metadata"]["uid"], None)
                return
            proc.deleted = True
        threading.Thread(target=self._terminate, args=(proc,), daemon=True).start()

    def _terminate(self, proc: _Proc) -> None:
        """SIGTERM, then SIGKILL after the grace period (to the whole process group)."""
        with self._lock:
            popen = proc.proc
        if popen is None or popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=proc.grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()

    def stop(self) -> None:
        """Kill every pod process (none may outlive the sim), then stop reconciling."""
        with self._lock:
            procs = list(self._procs.values())
            for p in procs:
                p.deleted = True
        for p in procs:
            if p.proc is not None and p.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 2
        for p in procs:
            if p.proc is None:
                continue
            try:
                p.proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait()
        super().stop()
        for t in self._threads:
            t.join(timeout=5)


def find_cond(status: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in status.get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None
