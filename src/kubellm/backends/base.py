"""The four seams between the pipeline's stages and the systems that do the work.

A stage asks a `Trainer` to run a job, a `Tuner` to search, a `Server` to serve, and a
`Workspace` for files that jobs must see. `kubellm.backends.select` picks the local or the
Kubernetes implementation of each from `platform`; nothing else in kubellm branches on it.

The contract every implementation keeps: a job that does not succeed raises `JobFailed`
with the reason, and nothing waits past its timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from kubellm.serve.client import Endpoint
from kubellm.tune.search import SearchParam, TuneResult

# Where the shared workspace volume is mounted in step pods and job pods (cluster).
WORKSPACE_MOUNT = "/workspace"


def workspace_mount() -> str:
    """WORKSPACE_MOUNT, or $KUBELLM_WORKSPACE_MOUNT: the simulated cluster in tests/fakes maps
    the PVC to a local directory, and steps and job pods must agree on its path."""
    return os.environ.get("KUBELLM_WORKSPACE_MOUNT") or WORKSPACE_MOUNT


class Terminated(BaseException):
    """SIGTERM arrived while a step waited for its job (a BaseException: no `except
    Exception` eats it)."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While active, SIGTERM raises Terminated in the main thread; the old handler returns
    afterwards. Outside the main thread (where Python cannot handle signals) it does nothing.

    Only the first SIGTERM raises: a second one, while the job is being deleted or
    cancelled, must not cut that short. The trainers that wait for a job elsewhere
    (a PyTorchJob or TrainJob, a Slurm job) stop it on Terminated.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


class JobFailed(RuntimeError):
    """A job reached a failed terminal state; the message carries its reason, `exit_code`
    the job's own (2: bad config or data) where the launcher knows it."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class JobTimeout(JobFailed):
    """A job did not finish in time; it has been deleted (or killed)."""


# -- training ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainJob:
    """One run of `python -m <module>` (the training entrypoint by default) on some launcher.

    `module` is also `kubellm.train.fabric`: preflight's fabric check runs with the
    training topology on the same launcher.
    """

    name: str
    train_args: list[str]
    module: str = "kubellm.train"
    nnodes: int = 1
    nproc_per_node: int = 1
    timeout_s: float = 3600.0
    image: str = ""
    namespace: str = "default"
    env: dict[str, str] = field(default_factory=dict)
    workspace_pvc: str | None = None
    # torchrun restarts the worker group this many times after a worker dies (local runs;
    # on a cluster the PyTorchJob's ExitCode restart policy and backoffLimit do this).
    max_restarts: int = 0


@dataclass(frozen=True)
class JobResult:
    name: str
    logs: str
    metrics: dict[str, float]


class Trainer(ABC):
    """Runs one training job and returns its logs and metrics, or raises JobFailed."""

    @abstractmethod
    def run(self, job: TrainJob) -> JobResult: ...

    def release(self, run_tag: str, namespace: str) -> list[str]:
        """End of pipeline run `run_tag` (its exit handler): delete the jobs it created that
        are still there; returns what was done, a line each.

        A stopped step's own cleanup is a best effort that the platform can cut short
        (kubellm.backends.kubernetes.release says how); this one runs after every step has
        ended. By default (local: a job is its step's child process) nothing.
        """
        return []


# -- tuning --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TuneRequest:
    name: str
    trial_job: TrainJob  # the template; each trial appends `--set name=value` per parameter
    space: list[SearchParam]
    max_trials: int
    objective: str = "eval_loss"
    goal: Literal["minimize", "maximize"] = "minimize"
    parallel_trials: int = 1
    seed: int = 0
    timeout_s: float = 3600.0
    algorithm: Literal["random", "tpe", "bayesianoptimization", "grid"] = "tpe"
    max_failed_trials: int | None = None  # None: max_trials - 1 (fail when no trial can)
    early_stopping: bool = False  # median stopping (Katib's medianstop)


class Tuner(ABC):
    """Runs trials (training jobs with sampled hyperparameters) and returns the best."""

    @abstractmethod
    def tune(self, request: TuneRequest) -> TuneResult: ...

    def release(self, run_tag: str, namespace: str) -> list[str]:
        """End of pipeline run `run_tag`: delete its searches (and so their trials) that
        are still there; as Trainer.release. By default (local: in-process) nothing."""
        return []


# -- serving -------------------------------------------------------------------------------


SERVING_RUNTIMES = ("huggingface", "custom")


@dataclass(frozen=True)
class ServeResources:
    """What each serving replica asks for (requests = limits) and how many replicas run:
    KServe's predictor resources and minReplicas/maxReplicas. Local servers ignore them."""

    cpu: str = "1"
    memory: str = "4Gi"
    gpus: int = 0  # nvidia.com/gpu per replica
    min_replicas: int = 1  # 0 scales to zero; the smoke test's first call then waits for a pod
    max_replicas: int = 1
    # Where the replicas may run (the predictor's nodeSelector and tolerations, API form).
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class ServeRequest:
    name: str  # model / InferenceService name (DNS-1123)
    model_uri: str  # local directory (local) or storage URI / pvc:// path (cluster)
    namespace: str = "default"
    image: str = ""  # the custom runtime's image (runtime="custom")
    timeout_s: float = 600.0
    run_tag: str = ""  # the pipeline run that owns the server (for cleanup)
    version: str = ""  # the registered model version being served (for reports and rollback)
    # "huggingface": KServe's Hugging Face serving runtime (modelFormat huggingface);
    # "custom": our serving image running `kubellm serve`. Both answer the same routes.
    runtime: Literal["huggingface", "custom"] = "huggingface"
    # The new revision's share of traffic while it is smoke-tested, where a previous revision
    # serves; a first deployment takes all traffic.
    canary_traffic_percent: int = 10
    resources: ServeResources = field(default_factory=ServeResources)
    # The Hugging Face runtime's --dtype: "" leaves it to the runtime, whose default on a GPU
    # is half precision for a float32 checkpoint (vLLM's auto; the HF backend's float16).
    dtype: str = ""
    max_model_len: int = 0  # the Hugging Face runtime's --max_model_len; 0: the model's own
    # The predictor's serviceAccountName: KServe's storage initializer reads the storage
    # credentials from its secrets; "": the namespace's `default` account.
    service_account: str = ""
    # No public URL: the service and its tag URLs (the canary's) stay inside the cluster.
    cluster_local: bool = False


@dataclass(frozen=True)
class Rollout:
    """A deployment in progress: the new revision is ready but not yet promoted."""

    endpoint: Endpoint  # the new revision's own address: what the smoke test calls
    canary: bool = False  # a previous revision still serves the other traffic
    previous: str = ""  # what serves the rest (a revision name), "" on a first deployment
    # KServe's deployment mode ("Knative", "Standard"; "" where there is none: local).
    mode: str = ""
    # No canary was possible (KServe Standard mode without spec.canary): the new version
    # replaced `previous` in place and takes all traffic; a rollback restores `previous`.
    full_rollout: bool = False


class Server(ABC):
    """Serves a model directory behind KServe's protocols (V1, V2 and OpenAI-compatible).

    A deployment is two-phase: `deploy` brings the new version up (as a canary where a
    previous revision serves), then the caller either `promote`s it to all traffic or
    `rollback`s to the previous revision. Nothing that serves traffic is deleted while a
    previous revision could serve instead.
    """

    @abstractmethod
    def deploy(self, request: ServeRequest) -> Rollout:
        """Start serving and return once the new revision answers readiness checks."""

    @abstractmethod
    def promote(self, name: str, namespace: str = "") -> Endpoint:
        """The new revision of `name` takes all traffic; returns the public endpoint."""

    @abstractmethod
    def rollback(self, name: str, run_tag: str = "", namespace: str = "") -> str:
        """Traffic back to the previous revision, or, with none, stop serving `name`;
        returns what was done, for the failure message."""

    @abstractmethod
    def delete(self, name: str, run_tag: str = "") -> None:
        """Stop serving `name` (idempotent)."""

    def release(self, run_tag: str) -> int:
        """End of a pipeline run: stop what only lived for the run; returns how many.

        A cluster deployment outlives its run (it is the product), so by default nothing.
        """
        return 0

    def release_unpromoted(self, run_tag: str, champion: str | None) -> list[str]:
        """End of pipeline run `run_tag`: what it deployed and did not promote stops
        serving; returns what was done, a line each.

        `champion` is the registered version the `champion` alias points at ("" when none;
        None when the registry could not say). A deployment of the champion is never
        touched; a canary of the run gives its traffic back to the revision beside it; any
        other deployment of the run is rolled back, or deleted when nothing served before
        it. With the champion unknown, only deployments that serve nothing are deleted.
        By default (local: `release` stops every server of the run) nothing.
        """
        return []


# -- files ---------------------------------------------------------------------------------


class Workspace(ABC):
    """Where a step puts files that a job (another process or pod) must read or write."""

    pvc_name: str | None = None  # mounted at WORKSPACE_MOUNT in job pods, when there is one

    @abstractmethod
    def dir(self, *parts: str) -> Path:
        """A directory both the step and its jobs see, created if missing."""

    @abstractmethod
    def share(self, src: str | Path, *parts: str) -> Path:
        """Make `src` visible to jobs; returns the path jobs use."""

    @abstractmethod
    def collect(self, job_path: Path, dest: str | Path) -> None:
        """Bring a job's output at `job_path` into the step's `dest` (an artifact path)."""

    @abstractmethod
    def model_uri(self, path: Path) -> str:
        """How the server backend reaches a model directory at `path`."""


# Longest names the controllers accept for what they create from them: the Training
# Operator names pods `<job>-worker-<i>` (a pod name and its Service must stay a 63-character
# DNS-1035 label), Katib rejects Experiment names over 40 characters (its webhook: trial
# names append 9 characters, their jobs' pods more).
JOB_NAME_MAX = 50
KATIB_NAME_MAX = 40


def dns_name(*parts: str, max_len: int = JOB_NAME_MAX) -> str:
    """A DNS-1035 label from parts: lowercase letters, digits and '-', starting with a letter
    (the PyTorchJob webhook, Katib and KServe all require that), at most `max_len` long.

    A name that has to be cut keeps its start and ends in 8 hex digits of the full name's
    SHA-256, so two long names that differ only at the end stay different.
    """
    raw = "-".join(p for p in parts if p).lower()
    name = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]+", "-", raw)).strip("-")
    if not name:
        raise ValueError(f"cannot make a Kubernetes name from {parts!r}")
    if not name[0].isalpha():
        name = f"k-{name}"
    if len(name) > max_len:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = f"{name[: max_len - 9].rstrip('-')}-{digest}"
    return name
