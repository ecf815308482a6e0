"""The simulated cluster's KServe: serving.kserve.io/v1beta1 InferenceService.

A FAKE, for tests only. It follows kserve/kserve (pkg/apis/serving/v1beta1
inference_service_status.go for the status it writes) for a predictor given as custom
`containers` (the shape kubellm deploys):

- on create, and on each spec change (metadata.generation), a new revision
  `<name>-predictor-<generation, 5 digits>` starts: a predictor pod (labels
  `serving.kserve.io/inferenceservice`, `component: predictor`, `app:
  isvc.<name>-predictor`; owned by the InferenceService) that the sim's kubelet runs.
  Sim differences, because the pod is a local process: the storage initializer is emulated
  for `STORAGE_URI=pvc://<claim>/<path>` by mounting the claim (at `sim.pvc_dir(claim)`, the
  kubelet's rule) and replacing the string "/mnt/models" in command and args with
  `sim.pvc_dir(claim)/<path>` (other schemes fail the revision with ModelLoadFailed); the
  value after `--port` (or `--port=`) becomes a free port and the value after `--host`
  becomes 127.0.0.1, so the container needs a `--port` argument; the pod's restartPolicy is
  Never (a Deployment's pods restart Always), so a crash is a failed revision at once.
- readiness: `GET http://127.0.0.1:<port>/v1/models/<name>` answering 200 (KServe's V1
  protocol model-ready route, what the runtime's readiness probe asks) makes the revision
  ready: conditions IngressReady, PredictorReady, Ready True; `url` and `address.url`
  `http://127.0.0.1:<port>` (the real ones are the ingress host
  `http://<name>.<namespace>.<domain>` and the cluster-local Service); components.predictor
  {url, latestCreatedRevision, latestReadyRevision, latestRolledoutRevision};
  observedGeneration; modelStatus {transitionStatus UpToDate, states {activeModelState
  Loaded, targetModelState Loaded}, copies {failedCopies 0, totalCopies 1}}. The previous
  revision's pod is then deleted (the rollout).
- while it starts: PredictorReady and Ready False, reason RevisionMissing (`Configuration
  "<name>-predictor" does not have any ready Revision.`), modelStatus transitionStatus
  InProgress, targetModelState Loading.
- a predictor process that exits before it is ready: PredictorReady and Ready False, reason
  RevisionFailed (`Revision "<rev>" failed with message: Container failed with: <log tail>.`),
  modelStatus transitionStatus BlockedByFailedLoad, targetModelState FailedToLoad,
  lastFailureInfo {reason ModelLoadFailed, message (the log tail), exitCode,
  modelRevisionName}. A previous ready revision keeps serving (activeModelState Loaded).
- a predictor without `containers` (model/runtime predictors): the sim runs no serving
  runtimes, so Ready False reason InvalidSpec, modelStatus transitionStatus InvalidSpec,
  lastFailureInfo reason NoSupportingRuntime.
- delete: the garbage collector deletes the predictor pods; the kubelet stops them.
"""

from __future__ import annotations

import contextlib
import copy
import random
import string
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .fake_k8s import ApiError, Event, owner_reference
from .sim_base import Controller, Key, find_condition, free_port, now_rfc3339

ISVC_LABEL = "serving.kserve.io/inferenceservice"
MODEL_DIR = "/mnt/models"


@dataclass
class _Revision:
    generation: int
    name: str  # <isvc>-predictor-00001
    pod: str
    port: int
    ready: bool = False


def _cond(ctype: str, status: str, reason: str = "", message: str = "") -> dict[str, Any]:
    out = {"type": ctype, "status": status, "lastTransitionTime": now_rfc3339()}
    if reason:
        out["reason"] = reason
    if message:
        out["message"] = message
    return out


def replace_flag(argv: list[str], flag: str, value: str) -> tuple[list[str], bool]:
    """argv with the value of `flag` (`--flag v` or `--flag=v`) replaced; and whether found."""
    out, found, skip = [], False, False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == flag and i + 1 < len(argv):
            out += [arg, value]
            found, skip = True, True
        elif arg.startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(arg)
    return out, found


class KServe(Controller):
    name = "kserve"

    def __init__(self, sim: Any) -> None:
        super().__init__(sim)
        self._revisions: dict[str, list[_Revision]] = {}  # isvc uid -> revisions, oldest first

    def keys_for(self, event: Event) -> Iterable[Key]:
        if event.plural == "inferenceservices" and event.type != "DELETED":
            return self.own_key(event, "inferenceservices")
        if event.plural == "pods":
            return self.owner_key(event, "InferenceService")
        return []

    def reconcile(self, key: Key) -> None:
        isvc = self.get(key)
        if isvc is None:
            return
        uid = isvc["metadata"]["uid"]
        generation = int(isvc["metadata"].get("generation", 1))
        predictor = (isvc.get("spec") or {}).get("predictor") or {}
        if not predictor.get("containers"):
            self._write(key, isvc, self._invalid(isvc))
            return
        revisions = self._revisions.setdefault(uid, [])
        latest = revisions[-1] if revisions else None
        if latest is None or latest.generation != generation:
            latest = self._start(isvc, generation)
            if latest is None:
                return
            revisions.append(latest)
        pod = self.fake.get_object("pods", latest.pod, key[1])
        phase = ((pod or {}).get("status") or {}).get("phase")
        if pod is None:  # deleted under us: a ReplicaSet would make a new one
            revisions.pop()
            self.requeue(key)
            return
        if phase in ("Failed", "Succeeded"):
            self._write(key, isvc, self._failed(isvc, latest, pod, revisions))
            return
        if phase == "Running" and self._probe(latest, isvc["metadata"]["name"]):
            latest.ready = True
            for old in revisions[:-1]:
                with contextlib.suppress(ApiError):
                    self.fake.delete_object("pods", old.pod, key[1])
            del revisions[:-1]
            self._write(key, isvc, self._ready(isvc, latest))
            return
        self._write(key, isvc, self._progressing(isvc, latest, revisions))
        self.requeue(key, 0.1)

    # ------------------------------------------------------------ revisions

    def _start(self, isvc: dict[str, Any], generation: int) -> _Revision | None:
        meta = isvc["metadata"]
        name, ns = meta["name"], meta["namespace"]
        predictor = copy.deepcopy(isvc["spec"]["predictor"])
        containers = predictor.pop("containers")
        container = containers[0]
        revision = f"{name}-predictor-{generation:05d}"
        port = free_port()
        volumes = list(predictor.get("volumes") or [])
        argv_keys = [k for k in ("command", "args") if container.get(k)]
        env = {e.get("name"): e.get("value") for e in container.get("env") or []}
        uri = env.get("STORAGE_URI") or ""
        if uri:
            if not uri.startswith("pvc://"):
                self._write(
                    ("inferenceservices", ns, name),
                    isvc,
                    self._load_failed(
                        isvc,
                        revision,
                        f"the sim's storage initializer supports pvc:// only, not {uri}",
                    ),
                )
                return None
            claim, _, path = uri[len("pvc://") :].partition("/")
            local = self.sim.pvc_dir(claim) / path
            for k in argv_keys:
                container[k] = [str(a).replace(MODEL_DIR, str(local)) for a in container[k]]
            volumes.append(
                {
                    "name": "kserve-pvc-source",
                    "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
                }
            )
            container.setdefault("volumeMounts", []).append(
                {
                    "name": "kserve-pvc-source",
                    "mountPath": str(self.sim.pvc_dir(claim)),
                    "readOnly": True,
                }
            )
        for k in argv_keys:
            container[k], _ = replace_flag([str(a) for a in container[k]], "--port", str(port))
            container[k], _ = replace_flag(container[k], "--host", "127.0.0.1")
        for p in container.get("ports") or []:
            p["containerPort"] = port
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        pod_name = f"{revision}-{suffix}"
        spec = {
            k: v
            for k, v in predictor.items()
            if k
            in (
                "serviceAccountName",
                "securityContext",
                "nodeSelector",
                "tolerations",
                "affinity",
                "imagePullSecrets",
                "terminationGracePeriodSeconds",
            )
        }
        spec.update(containers=[container, *containers[1:]], restartPolicy="Never")
        if volumes:
            spec["volumes"] = volumes
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "labels": {
                    ISVC_LABEL: name,
                    "component": "predictor",
                    "app": f"isvc.{name}-predictor",
                },
                "annotations": {"sim.kubellm/revision": revision},
                "ownerReferences": [owner_reference(isvc)],
            },
            "spec": spec,
        }
        try:
            self.fake.create_object("pods", pod, ns)
        except ApiError as e:
            self.sim.errors.append(f"{self.name}: predictor pod for {name}: {e}")
            return None
        return _Revision(generation, revision, pod_name, port)

    def _probe(self, rev: _Revision, name: str) -> bool:
        url = f"http://127.0.0.1:{rev.port}/v1/models/{name}"
        try:
            with urllib.request.urlopen(url, timeout=0.5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    # ------------------------------------------------------------ statuses

    def _base(self, isvc: dict[str, Any]) -> dict[str, Any]:
        status = copy.deepcopy(isvc.get("status") or {})
        status["observedGeneration"] = int(isvc["metadata"].get("generation", 1))
        return status

    def _ready(self, isvc: dict[str, Any], rev: _Revision) -> dict[str, Any]:
        url = f"http://127.0.0.1:{rev.port}"
        status = self._base(isvc)
        status.update(
            url=url,
            address={"url": url},
            components={
                "predictor": {
                    "url": url,
                    "latestCreatedRevision": rev.name,
                    "latestReadyRevision": rev.name,
                    "latestRolledoutRevision": rev.name,
                }
            },
            conditions=[
                _cond("IngressReady", "True"),
                _cond("PredictorReady", "True"),
                _cond("Ready", "True"),
            ],
            modelStatus={
                "transitionStatus": "UpToDate",
                "states": {"activeModelState": "Loaded", "targetModelState": "Loaded"},
                "copies": {"failedCopies": 0, "totalCopies": 1},
            },
        )
        return status

    def _progressing(
        self, isvc: dict[str, Any], rev: _Revision, revisions: list[_Revision]
    ) -> dict[str, Any]:
        status = self._base(isvc)
        serving = any(r.ready for r in revisions[:-1])
        name = isvc["metadata"]["name"]
        message = f'Configuration "{name}-predictor" does not have any ready Revision.'
        if serving:  # the old revision serves while the new one starts
            message = f'Revision "{rev.name}" is not yet ready.'
        status["conditions"] = [
            c for c in status.get("conditions") or [] if c.get("type") == "IngressReady"
        ] + [
            _cond("PredictorReady", "False", "RevisionMissing", message),
            _cond("Ready", "False", "RevisionMissing", message),
        ]
        components = status.setdefault("components", {}).setdefault("predictor", {})
        components["latestCreatedRevision"] = rev.name
        status["modelStatus"] = {
            "transitionStatus": "InProgress",
            "states": {
                "activeModelState": "Loaded" if serving else "Pending",
                "targetModelState": "Loading",
            },
            "copies": {"failedCopies": 0, "totalCopies": 1 if serving else 0},
        }
        return status

    def _failed(
        self,
        isvc: dict[str, Any],
        rev: _Revision,
        pod: dict[str, Any],
        revisions: list[_Revision],
    ) -> dict[str, Any]:
        log = self.fake.pod_log(pod["metadata"]["namespace"], pod["metadata"]["name"])
        tail = " ".join(log.strip().splitlines()[-3:]) or "the container exited"
        terminated: dict[str, Any] = {}
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (cs.get("state") or {}).get("terminated") or terminated
        status = self._load_failed(isvc, rev.name, tail, terminated.get("exitCode"))
        if any(r.ready for r in revisions[:-1]):
            status["modelStatus"]["states"]["activeModelState"] = "Loaded"
        return status

    def _load_failed(
        self, isvc: dict[str, Any], revision: str, tail: str, code: int | None = None
    ) -> dict[str, Any]:
        status = self._base(isvc)
        message = f'Revision "{revision}" failed with message: Container failed with: {tail}.'
        status["conditions"] = [
            c for c in status.get("conditions") or [] if c.get("type") == "IngressReady"
        ] + [
            _cond("PredictorReady", "False", "RevisionFailed", message),
            _cond("Ready", "False", "RevisionFailed", message),
        ]
        info: dict[str, Any] = {
            "reason": "ModelLoadFailed",
            "message": tail,
            "modelRevisionName": revision,
            "time": now_rfc3339(),
        }
        if code is not None:
            info["exitCode"] = code
        status["modelStatus"] = {
            "transitionStatus": "BlockedByFailedLoad",
            "states": {"activeModelState": "", "targetModelState": "FailedToLoad"},
            "lastFailureInfo": info,
            "copies": {"failedCopies": 1, "totalCopies": 0},
        }
        return status

    def _invalid(self, isvc: dict[str, Any]) -> dict[str, Any]:
        status = self._base(isvc)
        message = "the sim runs predictors given as containers only (no serving runtimes)"
        status["conditions"] = [
            _cond("PredictorReady", "False", "InvalidSpec", message),
            _cond("Ready", "False", "InvalidSpec", message),
        ]
        status["modelStatus"] = {
            "transitionStatus": "InvalidSpec",
            "states": {"activeModelState": "", "targetModelState": "FailedToLoad"},
            "lastFailureInfo": {"reason": "NoSupportingRuntime", "message": message},
        }
        return status

    def _write(self, key: Key, isvc: dict[str, Any], status: dict[str, Any]) -> None:
        old = isvc.get("status") or {}
        same = {k: v for k, v in status.items() if k != "conditions"} == {
            k: v for k, v in old.items() if k != "conditions"
        } and [(c["type"], c["status"], c.get("reason")) for c in status.get("conditions", [])] == [
            (c["type"], c["status"], c.get("reason")) for c in old.get("conditions") or []
        ]
        if same:
            return
        for c in status.get("conditions") or []:  # keep transition times of unchanged ones
            prior = find_condition(old, c["type"])
            if prior and prior.get("status") == c["status"] and "lastTransitionTime" in prior:
                c["lastTransitionTime"] = prior["lastTransitionTime"]
        with contextlib.suppress(ApiError):
            self.fake.set_status(key[0], key[2], status, namespace=key[1])
