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
  would keep it Pending with a FailedMount event; failing fast names the mistake). An
  `emptyDir` volume is a per-pod directory, `empty_dir(pod, name)` (the kubelet's
  pods/<uid>/volumes/kubernetes.io~empty-dir/<name>), kept after the pod ends. SIMPLIFIED:
  a process here cannot see that directory at its mountPath, so when the mountPath does not
  exist on this machine (Katib's /var/log/katib) the kubelet rewrites that path, where it
  appears in the container's command, args and env values, to the directory; a mountPath
  that exists here (/tmp, /dev/shm) is this machine's own directory, shared. Other volume
  kinds (configMap, ...) are not provided.
- processes of a container: the container's first process (its main process) and all it
  starts carry SIM_KUBELET_CONTAINER=<pod uid>/<container> in their environment, the sim's
  stand-in for the container's cgroup (`container_pids`). When the main process exits, the
  rest of the container is SIGKILLed at once: the kernel does it when PID 1 of a private
  PID namespace exits, and with a shared one (shareProcessNamespace) containerd's shim does
  (handleInitExit -> ShouldKillAllOnExit -> KillAll, `runc kill --all` SIGKILL).
- deletion (kubelet killContainer -> CRI StopContainer(timeout = the grace period);
  containerd stopContainer): the pod object goes at once (see fake_k8s); SIGTERM goes to the
  container's main process ONLY (task.Kill without --all: `runc kill`), not to its process
  group or its children; after terminationGracePeriodSeconds (default 30, capped by the
  sim, 5 s default) SIGKILL, and with it the rest of the container. Without
  shareProcessNamespace the main process is PID 1 of its PID namespace, and the kernel
  delivers a signal from outside to it only if it has a handler for it (pid_namespaces(7);
  SigCgt in /proc/<pid>/status here): a `sh -c` or a plain `python` without a SIGTERM
  handler ignores the SIGTERM and is SIGKILLed after the grace period. With
  shareProcessNamespace the pause container is PID 1 and the main process gets the signal's
  default action (dash dies of SIGTERM; its children live on until the kill above).
  Every process is SIGKILLed when the sim stops.

Pods stored by a test as Running or finished (FakeK8s.add_pod(phase=...)) are left alone.
Not simulated: init containers, sidecars (only the first container runs; the others mirror
its state; Katib's metrics collector is played by katib_controller.py), probes but a
numeric tcpSocket readinessProbe (Ready once 127.0.0.1:<port> accepts a connection, polled
every 0.1 s, no failure threshold: KServe's raw Deployments set one), images,
resource limits, ports (programs use 127.0.0.1 and real ports), the image's STOPSIGNAL
(always SIGTERM).
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import shutil
import signal
import socket
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
CONTAINER_ENV = "SIM_KUBELET_CONTAINER"  # marks every process of a container (its "cgroup")
EMPTY_DIR = "kubernetes.io~empty-dir"


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


def container_pids(container_id: str) -> list[int]:
    """Every live process of the container `container_id` (`<pod uid>/<name>`): those whose
    environment carries SIM_KUBELET_CONTAINER=<id>, inherited from the container's first
    process (a real runtime finds them by the container's cgroup)."""
    needle = f"\0{CONTAINER_ENV}={container_id}\0".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                environ = b"\0" + fh.read()
        except OSError:  # gone, or not ours
            continue
        if needle in environ:
            found.append(int(entry.name))
    return found


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (SigCgt, /proc/pid/status)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    m = re.search(r"^SigCgt:\s*([0-9a-fA-F]+)$", text, re.M)
    return m is not None and bool(int(m[1], 16) >> (signum - 1) & 1)


def remap_paths(text: str, remap: dict[str, Path]) -> str:
    """`text` with each mountPath in `remap` (a whole path component, or a prefix of one
    followed by `/`) replaced by its directory on this machine."""
    for mount, host in remap.items():
        pattern = r"(?<![\w./-])" + re.escape(mount.rstrip("/")) + r"(?![\w.-])"
        text = re.sub(pattern, lambda _m, h=str(host): h, text)
    return text


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
    container_id: str = ""  # <pod uid>/<container name>: SIM_KUBELET_CONTAINER
    pid_one: bool = True  # the main process is PID 1 of its own PID namespace
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
        self._main_pids: dict[str, int] = {}  # pod uid -> its container's last main process

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
        if not spec.get("containers") or spec.get("schedulingGates"):
            return  # kube-scheduler's SchedulingGates plugin: a gated pod waits (kueue.py)
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
        remap = self._empty_dirs(pod, container)
        env = {k: remap_paths(v, remap) for k, v in env.items()} if remap else env
        grace = spec.get("terminationGracePeriodSeconds", 30)
        proc = _Proc(
            key,
            uid,
            min(float(grace), self.sim.grace_cap_s),
            container_id=f"{uid}/{container['name']}",
            # shareProcessNamespace: the pause container is PID 1; hostPID: the node's init
            pid_one=not (spec.get("shareProcessNamespace") or spec.get("hostPID")),
        )
        with self._lock:
            self._procs[uid] = proc
        thread = threading.Thread(
            target=self._run_pod,
            args=(proc, pod, container, env, remap),
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

    def _empty_dirs(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, Path]:
        """The container's emptyDir mounts the sim must remap: mountPath -> the directory
        (created), for each mountPath that does not exist on this machine."""
        volumes = {v.get("name"): v for v in (pod.get("spec") or {}).get("volumes") or []}
        remap: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            vol = volumes.get(mount.get("name")) or {}
            if "emptyDir" not in vol:
                continue
            host = self.empty_dir(pod, vol["name"])
            if not Path(mount["mountPath"]).exists():
                remap[mount["mountPath"]] = host
        return remap

    def empty_dir(self, pod: dict[str, Any], volume: str) -> Path:
        """The directory that is emptyDir `volume` of `pod` (created)."""
        path = self._pod_dir(pod) / "volumes" / EMPTY_DIR / volume
        path.mkdir(parents=True, exist_ok=True)
        return path

    def main_pid(self, pod: dict[str, Any]) -> int | None:
        """The host pid of the pod's container's last main process (running or not)."""
        with self._lock:
            return self._main_pids.get(pod["metadata"]["uid"])

    def _argv(
        self, container: dict[str, Any], env: dict[str, str], remap: dict[str, Path]
    ) -> list[str]:
        argv = [expand(str(a), env) for a in (container.get("command") or [])]
        argv += [expand(str(a), env) for a in (container.get("args") or [])]
        argv = [remap_paths(a, remap) for a in argv]
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
        return self._pod_dir(pod)

    def _pod_dir(self, pod: dict[str, Any]) -> Path:
        meta = pod["metadata"]
        path = self.sim.tmp_path / "pods" / meta["namespace"] / f"{meta['name']}-{meta['uid'][:8]}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _run_pod(
        self,
        proc: _Proc,
        pod: dict[str, Any],
        container: dict[str, Any],
        env: dict[str, str],
        remap: dict[str, Path],
    ) -> None:
        ns, name = proc.key[1], proc.key[2]
        policy = (pod.get("spec") or {}).get("restartPolicy") or "Always"
        restarts = 0
        last: dict[str, Any] | None = None
        try:
            while not proc.deleted:
                started = now_rfc3339()
                try:
                    argv = self._argv(container, env, remap)
                    with self._lock:
                        if proc.deleted:
                            return
                        proc.proc = subprocess.Popen(
                            argv,
                            cwd=self._workdir(pod, container),
                            env={**env, CONTAINER_ENV: proc.container_id},
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                        self._main_pids[proc.uid] = proc.proc.pid
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
                    probe = tcp_readiness_port(container)
                    self._set_status(
                        proc.key,
                        self._status(pod, "Running", running, restarts, last, ready=probe is None),
                    )
                    if probe is not None:
                        threading.Thread(
                            target=self._await_ready,
                            args=(proc, proc.proc, probe, pod, running, restarts, last),
                            daemon=True,
                        ).start()
                    pump = threading.Thread(
                        target=self._pump, args=(proc.proc, ns, name), daemon=True
                    )
                    pump.start()
                    code = proc.proc.wait()
                    # the rest of the container dies with its main process (see the docstring)
                    self._kill_container(proc)
                    pump.join(timeout=5)
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

    def _await_ready(
        self,
        proc: _Proc,
        popen: subprocess.Popen[bytes],
        port: int,
        pod: dict[str, Any],
        running: dict[str, Any],
        restarts: int,
        last: dict[str, Any] | None,
    ) -> None:
        """The readiness prober (tcpSocket): Ready once the port accepts a connection, while
        this run of the container lives."""
        while not proc.deleted and popen.poll() is None:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=0.5),
            ):
                with self._lock:
                    if proc.deleted or popen.poll() is not None:
                        return
                    status = self._status(pod, "Running", running, restarts, last)
                self._set_status(proc.key, status)
                return
            time.sleep(0.1)

    def _pump(self, popen: subprocess.Popen[bytes], ns: str, name: str) -> None:
        """Copy the container's output to the pod log as it comes."""
        assert popen.stdout is not None
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        out = popen.stdout
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
        ready: bool = True,
    ) -> dict[str, Any]:
        now = now_rfc3339()
        ready = ready and phase == "Running" and state is not None and "running" in state
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
        """A test control, not a kubelet action: send `signum` to every process of a running
        pod's container. Tests play a hung container this way (SIGSTOP: it keeps its port
        and answers nothing; SIGCONT resumes it), a failure a real node shows when a
        process deadlocks or is starved."""
        key = ("pods", namespace, name)
        with self._lock:
            proc = next((p for p in self._procs.values() if p.key == key), None)
        if proc is None or proc.proc is None or proc.proc.poll() is not None:
            raise LookupError(f"pod {namespace}/{name} has no running process")
        for pid in {proc.proc.pid, *container_pids(proc.container_id)}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def _kill_container(self, proc: _Proc) -> None:
        """SIGKILL every process of the container (`runc kill --all`; the kernel for PID 1)."""
        popen = proc.proc
        pids = set(container_pids(proc.container_id))
        if popen is not None and popen.poll() is None:
            pids.add(popen.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def _stop_signal(self, proc: _Proc, pid: int) -> None:
        """The CRI stop signal, SIGTERM, to the container's main process only; dropped by
        the kernel when the main process is PID 1 of its namespace without a handler."""
        if proc.pid_one and not catches(pid, signal.SIGTERM):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)

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
        """SIGTERM to the main process, then SIGKILL to the container after the grace
        period (containerd stopContainer: task.Kill(sig), wait timeout, task.Kill(SIGKILL))."""
        with self._lock:
            popen = proc.proc
        if popen is None or popen.poll() is not None:
            return
        self._stop_signal(proc, popen.pid)
        try:
            popen.wait(timeout=proc.grace_s)
        except subprocess.TimeoutExpired:
            self._kill_container(proc)
            popen.wait()

    def stop(self) -> None:
        """SIGKILL every pod process (none may outlive the sim), then stop reconciling."""
        with self._lock:
            procs = list(self._procs.values())
            for p in procs:
                p.deleted = True
        for p in procs:
            self._kill_container(p)
        for p in procs:
            if p.proc is not None:
                p.proc.wait()
        super().stop()
        for t in self._threads:
            t.join(timeout=5)


def tcp_readiness_port(container: dict[str, Any]) -> int | None:
    """The port of a container's tcpSocket readinessProbe (numeric only), else None."""
    probe = (container.get("readinessProbe") or {}).get("tcpSocket") or {}
    port = probe.get("port")
    return port if isinstance(port, int) else None


def find_cond(status: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in status.get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None
