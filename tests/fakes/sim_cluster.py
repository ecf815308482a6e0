"""A small SIMULATED Kubernetes cluster in the test process, for what cannot run here.

A FAKE, for tests only: the fake API server (fake_k8s.py: schemas, RBAC, watch, logs, the
garbage collector) plus controllers that act like the real ones, each on a thread, with
pods run as local processes:

- kubelet.py: the scheduler (extended resources such as nvidia.com/gpu against
  `gpus_per_node` / `extended`) and the kubelet (processes, env, secrets, logs, exit codes,
  restarts, graceful deletion). PVCs are directories: `sim.pvc_dir(name)` is
  tmp_path/pvc/<name>, and a pod must mount a claim exactly at that path (code under test
  runs with KUBELLM_WORKSPACE_MOUNT set to it; see `env()`), else it fails with FailedMount.
- training_operator.py: kubeflow.org/v1 PyTorchJob as release-1.9 runs it (pods, PET_* env,
  the workers' init-pytorch init container, conditions, restartPolicy ExitCode retried
  without a bound, backoffLimit, activeDeadlineSeconds checked on events only, suspend and
  resume, TTL, cleanPodPolicy).
- trainer_v2.py: trainer.kubeflow.org/v1alpha1 TrainJob with ClusterTrainingRuntime as
  Trainer v2.3.0 runs it (the runtimeRef webhook, the JobSet built from the runtime template
  and the trainer fields, the torch plugin's PET_* env, Suspended/Complete/Failed, jobsStatus).
- jobset.py: jobset.x-k8s.io/v1alpha2 JobSet at v0.12.0 (child Jobs, failurePolicy
  maxRestarts and restarts, success, suspend) and batch/v1 Indexed Jobs (pods per
  completion index, JOB_COMPLETION_INDEX, backoffLimit).
- katib_controller.py: kubeflow.org/v1beta1 Experiment and Trial (suggestions, trial jobs,
  the StdOut metrics collector, experiment conditions and currentOptimalTrial).
- kserve_controller.py: serving.kserve.io/v1beta1 InferenceService in Knative and Standard
  mode (`crds_without_canary` for a KServe before spec.canary) (serving
  runtimes, one with KServe's Hugging Face runtime installed; revisions, each a predictor
  process on a free port, ready through the V1 protocol; canary traffic and tags; KServe's
  status). `sim.kserve.add_runtime(...)` installs more runtimes.
- kueue.py (opt-in, `kueue=KueueSettings(...)`): Kueue v0.19.0's integrations, queue-name
  label, Workloads and quota admission (`sim.kueue.workloads()`).

Each module's docstring cites the upstream code it follows and lists what it simplifies.

    with SimCluster(tmp_path) as sim:
        api = k8s.CustomObjectsApi(sim.api_client())
        api.create_namespaced_custom_object("kubeflow.org", "v1", "default", "pytorchjobs", job)
        sim.wait_for(lambda: sim.condition("pytorchjobs", "job", "Succeeded"), timeout_s=30)
        assert sim.errors == [] and sim.fake.errors == []
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

from .fake_k8s import FakeK8s
from .jobset import JobController, JobSetController
from .k8s_rbac import REPO_RBAC
from .katib_controller import INJECTION_LABEL, Katib
from .kserve_controller import KServe
from .kubelet import Kubelet
from .kueue import Kueue, KueueSettings
from .sim_base import Controller, is_true
from .trainer_v2 import TrainerV2
from .training_operator import TrainingOperator

WORKSPACE_PVC = "kubellm-workspace"


class NamespaceLabels(dict[str, dict[str, str]]):
    """Labels per namespace; a namespace not set here has Katib's injection label, as
    manifests/base/namespace.yaml gives kubellm's namespace."""

    def __missing__(self, ns: str) -> dict[str, str]:
        labels = {INJECTION_LABEL: "enabled"}
        self[ns] = labels
        return labels


class SimCluster:
    """The fake API server and the simulated controllers; a context manager.

    tmp_path: where PVC directories, pod working directories and the kubeconfig go.
    gpus_per_node / extended: the one node's allocatable extended resources
      (`extended={"rdma/hca": 1}`); a pod asking for more stays Pending (Unschedulable).
    rbac: the Role enforced on HTTP requests (default the repo's; None: allow all).
    seed: Katib's suggestion seed when an experiment sets no random_state.
    grace_cap_s: the cap on terminationGracePeriodSeconds for deleted pods.
    kueue: run Kueue v0.19.0 (kueue.py) with these integrations and queues; None: no Kueue.
    """

    def __init__(
        self,
        tmp_path: Path,
        *,
        gpus_per_node: int = 0,
        extended: dict[str, int] | None = None,
        crds: Path | None = None,
        rbac: Path | str | None = REPO_RBAC,
        seed: int = 0,
        grace_cap_s: float = 5.0,
        kueue: KueueSettings | None = None,
    ) -> None:
        self.tmp_path = Path(tmp_path)
        self.gpus_per_node = gpus_per_node
        self.extended = dict(extended or {})
        self.seed = seed
        self.grace_cap_s = grace_cap_s
        self.fake = FakeK8s(crds, rbac=rbac)
        # (namespace, name) -> string data: the kubelet's env source, and what the fake
        # API server answers GET configmaps/secrets with (the same dicts)
        self.secrets: dict[tuple[str, str], dict[str, str]] = self.fake.secrets
        self.config_maps: dict[tuple[str, str], dict[str, str]] = self.fake.config_maps
        self.namespace_labels = NamespaceLabels()
        self.errors: list[str] = []  # controller failures (tracebacks); a test asserts none
        self.kubelet = Kubelet(self)
        self.kserve = KServe(self)
        self.controllers: list[Controller] = [
            self.kubelet,
            TrainingOperator(self),
            TrainerV2(self),
            JobSetController(self),
            JobController(self),
            Katib(self),
            self.kserve,
        ]
        # Kueue (kueue.py) only where a test asks for it: without it, nothing is queued.
        self.kueue = Kueue(self, kueue) if kueue is not None else None
        if self.kueue is not None:
            self.controllers.append(self.kueue)
        self.pvc_dir(WORKSPACE_PVC)

    def __enter__(self) -> SimCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.fake.start()
        for c in self.controllers:
            c.start()

    def stop(self) -> None:
        """Stop every controller and kill every pod process, then the API server."""
        for c in self.controllers:
            c.stop()
        self.fake.stop()

    # ------------------------------------------------------------ for tests and code under test

    @property
    def url(self) -> str:
        return self.fake.url

    def api_client(self) -> k8s.ApiClient:
        return self.fake.api_client()

    def pvc_dir(self, name: str) -> Path:
        """The directory that is PVC `name` (created, so the claim exists from now on)."""
        path = self.tmp_path / "pvc" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def pvc_exists(self, name: str) -> bool:
        return (self.tmp_path / "pvc" / name).is_dir()

    def kubeconfig(self, path: Path | None = None, namespace: str = "default") -> Path:
        """A kubeconfig file pointing at the fake (for code in child processes)."""
        return self.fake.write_kubeconfig(path or self.tmp_path / "kubeconfig", namespace)

    def env(self, namespace: str = "default") -> dict[str, str]:
        """What a step process needs to use this cluster: KUBECONFIG, and
        KUBELLM_WORKSPACE_MOUNT (the workspace PVC kubellm-workspace's directory)."""
        return {
            "KUBECONFIG": str(self.kubeconfig(namespace=namespace)),
            "KUBELLM_WORKSPACE_MOUNT": str(self.pvc_dir(WORKSPACE_PVC)),
        }

    def condition(self, plural: str, name: str, ctype: str, namespace: str = "default") -> bool:
        """Whether the object has condition `ctype` True."""
        obj = self.fake.get_object(plural, name, namespace)
        return obj is not None and is_true(obj.get("status") or {}, ctype)

    def wait_for(
        self, predicate: Callable[[], Any], timeout_s: float = 30.0, what: str = ""
    ) -> Any:
        """Poll `predicate` until it is truthy; TimeoutError naming `what` and the errors."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            if self.errors:
                raise AssertionError(f"controller error while waiting for {what}: {self.errors}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not within {timeout_s}s: {what or predicate}")
            time.sleep(0.02)


def crds_without_canary(directory: Path) -> Path:
    """A copy of the vendored CRDs whose InferenceService has no spec.canary and no
    status.canaryStatuses (KServe before 0.20), for SimCluster(crds=...): the API server
    then refuses a spec.canary as an unknown field (k8s_schemas.py unknown_fields)."""
    import shutil

    import yaml

    from .k8s_schemas import crds_dir

    out = Path(directory) / "crds-no-canary"
    shutil.copytree(crds_dir(), out, dirs_exist_ok=True)
    path = out / "serving.kserve.io_inferenceservices.yaml"
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(path.read_text(), Loader=loader)
    for version in crd["spec"]["versions"]:
        props = version["schema"]["openAPIV3Schema"]["properties"]
        props["spec"]["properties"].pop("canary", None)
        props.get("status", {}).get("properties", {}).pop("canaryStatuses", None)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    path.write_text(yaml.dump(crd, Dumper=dumper))
    return out
