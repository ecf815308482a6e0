"""A FAKE of the KFP v2 runtime in each step pod: the driver's and the launcher's own
Kubernetes API calls, made as the run's ServiceAccount, and the exit handler's
PipelineTaskFinalStatus as the backend fills it. For tests only.

kfp.local runs the compiled YAML without any of KFP's runtime, so the requests that fail a
first run on a real cluster (the run's ServiceAccount may not read what the driver and the
launcher read) never happen there, and the exit handler sees kfp.local's `SUCCEEDED` where
the backend says `COMPLETE`. This module puts both back, as kubeflow/pipelines backend
2.17.0 does them (paths in that repository at tag 2.17.0):

- Every pod of a run, the driver's and the launcher's included, runs as the run's
  ServiceAccount (backend/src/apiserver/template/template.go#L310 `setDefaultServiceAccount`).
  The fake API server treats every request as the Role's ServiceAccount (k8s_rbac.py), which
  is that account here.
- Root driver, once per run (driver/root_dag.go#L103): `config.FromConfigMap` GETs ConfigMap
  `kfp-launcher` in the run's namespace (config/env.go#L73); NotFound means the defaults
  (env.go#L75-78), any other error fails the driver (env.go#L80), wrapped as
  `driver.RootDAG(pipelineName=..., runID=..., runtimeConfig) failed: ...` (root_dag.go#L87,
  driver.go#L123 `Options.info`), and then no task of the run starts. The pipeline root is
  the run's (kubellm submits none), else the ConfigMap's `defaultPipelineRoot`, else
  `minio://mlpipeline/v2/artifacts` (env.go#L38, #L85-92). The store's session info follows
  from its scheme (env.go#L118-161): minio without a `providers` entry is the default minio
  session, whose credentials are Secret `mlpipeline-minio-artifact`, keys `accesskey` /
  `secretkey` (config/minio.go#L35-36, env.go#L177-192); s3 and gs without one read
  credentials from the environment (config/s3.go#L90-95, config/gcs.go#L70-75).
- Container driver, once per task: no API call for what this pipeline uses (secrets and
  ConfigMaps as env and PVC mounts are only written into the pod spec patch,
  driver/k8s.go#L347-455; only the PVC-creating platform tasks and the pipeline-job-time
  placeholders call the API, cmd/driver/main.go#L166-183, and this pipeline has neither).
- Launcher, once per container task, before the task's command runs
  (component/launcher_v2.go#L269 `objectstore.OpenBucket` in `Execute`): for a minio or s3
  store with `fromEnv` false it GETs the credentials Secret (objectstore/object_store.go#L53,
  #L310, #L391); any error, NotFound included, fails the task as
  `failed to execute component: Failed to open bucket "B": failed to retrieve credentials
  for bucket B: failed to get Bucket credentials from secret name="S" namespace="N": ...`
  (launcher_v2.go#L181, object_store.go#L46, #L55, #L388), and a Secret without both keys
  fails with `could not find specified keys 'accesskey' or 'secretkey'` (#L406). Then, with
  logs published (the API server sets PUBLISH_LOGS "true",
  manifests/kustomize/base/pipeline/ml-pipeline-apiserver-deployment.yaml#L114) and no
  KFP_RETRY_INDEX (only tasks with a retry policy get one,
  compiler/argocompiler/container.go#L582-588), it GETs its own pod for Argo's retry index
  and only warns when that fails (launcher_v2.go#L583-592, #L607).
- Exit handler: the driver hands it the producer's MLMD execution state as a string,
  `COMPLETE` or `FAILED` for the exit handler's DAG (driver/resolve.go#L471-477,
  metadata/client.go#L849-854), `pipelineJobResourceName` the run's workflow name,
  `pipelineTaskName` the producer task, and an empty `error` ("TODO: Implement fields
  Message and Code", resolve.go#L475-476). protojson writes the camelCase names; the SDK
  reads both spellings (kfp/dsl/executor.py).
- KFP's profile controller, for the test's set-up: a namespace labelled
  `pipelines.kubeflow.org/enabled: "true"` gets ConfigMap kfp-launcher (defaultPipelineRoot
  `minio://mlpipeline/private-artifacts/<ns>/v2/artifacts`) and Secret
  mlpipeline-minio-artifact; any other namespace gets nothing
  (manifests/kustomize/base/installs/multi-user/pipelines-profile-controller/sync.py#L259-263,
  #L281-287, #L498-511; decorator-controller.yaml#L10-12). `profile_controller_sync`.

Simplified: MLMD, the cache server, artifact uploads and downloads are not modelled (kfp.local
keeps its artifacts on local disk); a kfp-launcher `providers` entry is refused with a clear
error instead of being interpreted; the launcher's calls run in the kfp.local process
before the task's subprocess (in a real pod the launcher is the container's entrypoint and
the task its child), once per task (kfp.local's retries of a task do not repeat them).

Run the committed pipeline through it (what tests/e2e/test_cluster_pipeline.py does; the
environment of SimCluster.env() gives KUBECONFIG, whose context names the namespace):

    PYTHONPATH=tests python -m fakes.kfp_runtime pipelines/llm_train.yaml ROOT '{"platform": ...}'

`--run-subprocess MODULE:FUNCTION` replaces how each task's process is run (kfp.local's
`subprocess_task_handler.run_local_subprocess(full_command, env_vars) -> exit code`), the
seam for running it under Argo's emissary stop semantics.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import random
import re
import string
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

LAUNCHER_CONFIGMAP = "kfp-launcher"  # config/env.go#L37
DEFAULT_PIPELINE_ROOT = "minio://mlpipeline/v2/artifacts"  # config/env.go#L38
ARTIFACT_SECRET = "mlpipeline-minio-artifact"  # config/env.go#L41
ACCESS_KEY_KEY, SECRET_KEY_KEY = "accesskey", "secretkey"  # config/env.go#L43-44
# What the runtime GETs as the run's ServiceAccount, by (apiGroup, resource): the objects a
# Role must grant `get` on (tests/manifests/test_manifests.py derives its table from this).
RUNTIME_GETS: dict[tuple[str, str], str] = {
    ("", "configmaps"): LAUNCHER_CONFIGMAP,
    ("", "secrets"): ARTIFACT_SECRET,
}
# The label KFP's profile controller acts on (decorator-controller.yaml#L10-12).
PIPELINES_ENABLED = "pipelines.kubeflow.org/enabled"
PROFILE_BUCKET = "mlpipeline"  # sync.py S3_BUCKET_NAME
# kfp.local's final states, as the backend's MLMD states (resolve.go#L472; client.go#L852-854)
BACKEND_STATE = {"SUCCEEDED": "COMPLETE", "FAILED": "FAILED"}
_SCHEMES = ("gs://", "s3://", "minio://", "mem://")  # objectstore/config.go#L137
_BUCKET = re.compile(r"(^[a-z][a-z0-9]+:///?)([^/?]+)(/[^?]*)?(\?.+)?$")  # config.go#L118

RunSubprocess = Callable[[list[str], dict[str, str] | None], int]


class KfpRuntimeError(Exception):
    """The driver or launcher failed, with its own error text."""


class ApiRefusal(Exception):
    """A Kubernetes API error, worded as client-go's StatusError (the Status message)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------ the API, as client-go


class KubeApi:
    """GETs to the API server from a kubeconfig (the step pod's in-cluster config)."""

    def __init__(self, kubeconfig: str | Path) -> None:
        from kubernetes import config as k8s_config

        self.client = k8s_config.new_client_from_config(config_file=str(kubeconfig))
        _, active = k8s_config.list_kube_config_contexts(config_file=str(kubeconfig))
        # config.InPodNamespace (env.go#L95): the pod's namespace, here the context's
        self.namespace = str(active["context"].get("namespace") or "default")

    def get(self, path: str) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        try:
            response = self.client.call_api(
                path, "GET", response_type="object", auth_settings=["BearerToken"]
            )
        except ApiException as e:
            raise ApiRefusal(int(e.status or 0), _status_message(e)) from None
        return dict(response[0] or {})

    def get_core(self, plural: str, name: str, namespace: str) -> dict[str, Any]:
        return self.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")


def _status_message(e: Any) -> str:
    try:
        body = json.loads(e.body or "")
    except (TypeError, ValueError):
        body = None
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return f"the server responded with the status code {e.status} ({e.reason})"


# ------------------------------------------------------------------ the driver


@dataclass(frozen=True)
class SessionInfo:
    """objectstore.SessionInfo: the store's provider and how to reach its credentials."""

    provider: str
    params: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunContext:
    """What the root driver settles for the whole run (recorded in MLMD for the launchers)."""

    namespace: str
    pipeline_name: str
    run_id: str
    run_name: str
    pipeline_root: str
    session: SessionInfo


def from_config_map(api: KubeApi, namespace: str) -> dict[str, str] | None:
    """config.FromConfigMap (env.go#L72-83): the launcher config, None when NotFound."""
    try:
        obj = api.get_core("configmaps", LAUNCHER_CONFIGMAP, namespace)
    except ApiRefusal as e:
        if e.code == 404:  # "LauncherConfig is optional, so ignore not found error."
            return None
        raise
    return dict(obj.get("data") or {})


def _bucket(path: str) -> tuple[str, str, str]:
    """objectstore.ParseBucketPathToConfig (config.go#L118, #L130-152): the provider (the
    scheme without `://`), the bucket and the query string."""
    m = _BUCKET.match(path)
    if m is None:
        raise KfpRuntimeError(
            f"parse bucket config failed: unrecognized pipeline root format: {path!r}"
        )
    if m[1].rstrip("/") + "//" not in _SCHEMES:
        raise KfpRuntimeError(f"parse bucket config failed: unsupported Cloud bucket: {path!r}")
    return m[1].split(":", 1)[0], m[2], (m[4] or "")[1:]


def store_session_info(config: dict[str, str] | None, pipeline_root: str) -> SessionInfo:
    """Config.GetStoreSessionInfo (env.go#L118-161) without a `providers` entry."""
    if config and config.get("providers"):
        raise KfpRuntimeError(
            "fakes.kfp_runtime: kfp-launcher `providers` is not modelled (only the default "
            "store); leave it out of the test's ConfigMap"
        )
    provider, _, query = _bucket(pipeline_root)
    if provider == "minio" and not query:  # minio.go#L35-40: the default minio session
        return SessionInfo(
            "minio",
            {
                "region": "minio",
                "endpoint": "seaweedfs.kubeflow:9000",  # objectstore/config.go#L29
                "disableSSL": "true",
                "fromEnv": "false",
                "maxRetries": "5",
                "secretName": ARTIFACT_SECRET,
                "accessKeyKey": ACCESS_KEY_KEY,
                "secretKeyKey": SECRET_KEY_KEY,
            },
        )
    if provider in ("minio", "s3", "gs"):  # s3.go#L90-95 (minio.go#L43-49), gcs.go#L70-75
        return SessionInfo(provider, {"fromEnv": "true"})
    raise KfpRuntimeError(f"Encountered unsupported provider in provider config {provider}")


def root_driver(
    api: KubeApi, pipeline_name: str, *, run_id: str = "", pipeline_root: str = ""
) -> RunContext:
    """driver.RootDAG (root_dag.go#L84-118): the launcher config, the root, the store."""
    run_id = run_id or str(uuid.uuid4())
    try:
        config = from_config_map(api, api.namespace)
        root = pipeline_root or (config or {}).get("defaultPipelineRoot") or DEFAULT_PIPELINE_ROOT
        session = store_session_info(config, root)
    except (ApiRefusal, KfpRuntimeError) as e:
        raise KfpRuntimeError(
            f"driver.RootDAG(pipelineName={pipeline_name}, runID={run_id}, runtimeConfig) "
            f"failed: {e}"
        ) from None
    suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
    return RunContext(
        api.namespace, pipeline_name, run_id, f"{pipeline_name}-{suffix}", root, session
    )


# ------------------------------------------------------------------ the launcher


def open_bucket(api: KubeApi, run: RunContext) -> None:
    """objectstore.OpenBucket (object_store.go#L43-67) up to its credentials."""
    session = run.session
    _, bucket, query = _bucket(run.pipeline_root)
    if session.provider not in ("minio", "s3") or query or session.params["fromEnv"] == "true":
        return  # credentials from the environment (gs, as store_session_info builds it, too)
    name = session.params["secretName"]
    try:
        try:
            secret = api.get_core("secrets", name, run.namespace)
        except ApiRefusal as e:
            raise KfpRuntimeError(
                f'failed to get Bucket credentials from secret name="{name}" '
                f'namespace="{run.namespace}": {e}'
            ) from None
        data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
        access, secret_key = session.params["accessKeyKey"], session.params["secretKeyKey"]
        if not (data.get(access) and data.get(secret_key)):
            raise KfpRuntimeError(
                f'failed to get Bucket credentials from secret name="{name}" '
                f"namespace=\"{run.namespace}\": could not find specified keys '{access}' or "
                f"'{secret_key}'"
            )
    except KfpRuntimeError as e:
        raise KfpRuntimeError(
            f'Failed to open bucket "{bucket}": failed to retrieve credentials for bucket '
            f"{bucket}: {e}"
        ) from None


def launcher(api: KubeApi, run: RunContext, pod_name: str, log: Callable[[str], None]) -> None:
    """LauncherV2.Execute (launcher_v2.go#L178-298) up to running the task's command."""
    try:
        open_bucket(api, run)
    except KfpRuntimeError as e:
        raise KfpRuntimeError(f"failed to execute component: {e}") from None
    # qualifyExecutorLogsForRetry (launcher_v2.go#L572-598): PUBLISH_LOGS "true", no
    # KFP_RETRY_INDEX: the retry index from its own pod's annotation, a failure only warned.
    try:
        api.get_core("pods", pod_name, run.namespace)
    except ApiRefusal as e:
        log(
            "Could not determine retry index from pod annotation, defaulting to 0: failed to "
            f"get pod {run.namespace}/{pod_name}: {e}"
        )


def final_status(local: dict[str, Any], run: RunContext) -> dict[str, Any]:
    """The PipelineTaskFinalStatus the backend's driver resolves (resolve.go#L471-477), from
    the one kfp.local made: the MLMD state, no error."""
    state = str(local.get("state", ""))
    return {
        "state": BACKEND_STATE.get(state, state),
        "pipelineJobResourceName": run.run_name,
        "pipelineTaskName": str(local.get("pipeline_task_name", "")),
        "error": {},
    }


# ------------------------------------------------------------------ KFP's profile controller


def namespace_labels(manifest: Path | None = None) -> dict[str, str]:
    """The labels of the Namespace in a manifest (default: the repo's base namespace.yaml)."""
    path = manifest or Path(__file__).resolve().parents[2] / "manifests/base/namespace.yaml"
    for doc in yaml.safe_load_all(Path(path).read_text()):
        if isinstance(doc, dict) and doc.get("kind") == "Namespace":
            return dict((doc.get("metadata") or {}).get("labels") or {})
    raise ValueError(f"{path}: no Namespace in it")


def profile_controller_sync(
    namespace: str, labels: dict[str, str]
) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
    """What sync.py creates in `namespace` (ConfigMaps, Secrets: name -> string data); the
    Secret's keys are made up here (the controller creates them in SeaweedFS's IAM)."""
    if labels.get(PIPELINES_ENABLED) != "true":  # sync.py#L259-263
        return {}, {}
    config_maps = {
        LAUNCHER_CONFIGMAP: {
            "defaultPipelineRoot": (
                f"minio://{PROFILE_BUCKET}/private-artifacts/{namespace}/v2/artifacts"
            ),
            "clusterDomain": "cluster.local",
        }
    }
    secrets = {ARTIFACT_SECRET: {ACCESS_KEY_KEY: f"{namespace}-key", SECRET_KEY_KEY: "s3cr3t"}}
    return config_maps, secrets


def install_profile_objects(fake: Any, namespace: str, labels: dict[str, str]) -> None:
    """Put what the profile controller creates into the fake API server's stores."""
    config_maps, secrets = profile_controller_sync(namespace, labels)
    for name, data in config_maps.items():
        fake.config_maps[(namespace, name)] = data
    for name, data in secrets.items():
        fake.secrets[(namespace, name)] = data


# ------------------------------------------------------------------ kfp.local, patched


class Runtime:
    """The KFP runtime around kfp.local's tasks (see the module docstring)."""

    def __init__(self, api: KubeApi, run: RunContext, out: Callable[[str], None] = print) -> None:
        self.api, self.run, self.out = api, run, out
        self.launched: list[str] = []

    def log(self, text: str) -> None:
        self.out(f"kfp-runtime: {text}")

    def before_task(self, task_name: str) -> None:
        """The container driver (no API call here) and the launcher, for one task."""
        pod = f"{self.run.run_name}-system-container-impl-{len(self.launched) + 1}"
        self.launched.append(task_name)
        self.log(f"launcher {task_name} (pod {pod}, namespace {self.run.namespace})")
        launcher(self.api, self.run, pod, self.log)

    @contextmanager
    def patched(self, run_subprocess: RunSubprocess | None = None) -> Iterator[None]:
        """kfp.local with the launcher before each container task, the backend's final
        status for exit handlers, and `run_subprocess` for each task's process."""
        from kfp.local import status, subprocess_task_handler
        from kfp.local.orchestrator import orchestrator_utils, task_executor

        utils = orchestrator_utils.OrchestratorUtils
        saved = (
            task_executor.execute_single_task,
            utils.__dict__["make_task_arguments"],
            subprocess_task_handler.run_local_subprocess,
        )
        execute_single_task, make_task_arguments = saved[0], saved[1].__func__

        def execute(**kwargs: Any) -> tuple[dict[str, Any], Any]:
            spec = kwargs["components"][kwargs["task_spec"].component_ref.name]
            executor = kwargs["executors"][spec.executor_label]
            if executor.WhichOneof("spec") == "container":
                try:
                    self.before_task(kwargs["task_name"])
                except KfpRuntimeError as e:
                    self.log(f"{kwargs['task_name']}: {e}")
                    return {}, status.Status.FAILURE
            return execute_single_task(**kwargs)

        def task_arguments(cls: Any, task_inputs_spec: Any, io_store: Any) -> dict[str, Any]:
            arguments = make_task_arguments(cls, task_inputs_spec, io_store)
            for name, spec in task_inputs_spec.parameters.items():
                if spec.HasField("task_final_status"):
                    arguments[name] = final_status(arguments[name], self.run)
            return arguments

        task_executor.execute_single_task = execute
        utils.make_task_arguments = classmethod(task_arguments)
        if run_subprocess is not None:
            subprocess_task_handler.run_local_subprocess = run_subprocess
        try:
            yield
        finally:
            task_executor.execute_single_task = saved[0]
            utils.make_task_arguments = saved[1]
            subprocess_task_handler.run_local_subprocess = saved[2]


def run_pipeline(
    pipeline_yaml: str | Path,
    root: str | Path,
    arguments: dict[str, Any],
    *,
    kubeconfig: str | Path | None = None,
    run_subprocess: RunSubprocess | None = None,
    out: Callable[[str], None] = print,
) -> int:
    """Run the compiled YAML with kfp.local under the KFP runtime; 1 when the root driver
    fails (no task starts), else 0 (a failed task shows in the summary, as with kfp.local)."""
    import os

    from kubellm.commands.local_run import _execute

    docs = list(yaml.safe_load_all(Path(pipeline_yaml).read_text()))  # + platform spec
    info = next(
        (d["pipelineInfo"] for d in docs if isinstance(d, dict) and "pipelineInfo" in d), {}
    )
    name = str(info.get("name") or "pipeline")
    api = KubeApi(kubeconfig or os.environ["KUBECONFIG"])
    try:
        run = root_driver(api, name)
    except KfpRuntimeError as e:
        out(f"kfp-runtime: root driver: {e}")
        return 1
    runtime = Runtime(api, run, out)
    runtime.log(f"root driver: run {run.run_name}, pipeline root {run.pipeline_root}")
    with runtime.patched(run_subprocess):
        _execute(str(pipeline_yaml), str(root), arguments)
    return 0


def _function(ref: str) -> RunSubprocess:
    module, _, attr = ref.partition(":")
    if not attr:
        raise SystemExit(f"--run-subprocess wants MODULE:FUNCTION, not {ref!r}")
    fn: RunSubprocess = getattr(importlib.import_module(module), attr)
    return fn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fakes.kfp_runtime", description=__doc__)
    parser.add_argument("pipeline_yaml")
    parser.add_argument("root")
    parser.add_argument("arguments", help="the pipeline arguments, as JSON")
    parser.add_argument("--run-subprocess", default="", help="MODULE:FUNCTION")
    args = parser.parse_args(argv)
    runner = _function(args.run_subprocess) if args.run_subprocess else None
    out = lambda text: print(text, flush=True)  # noqa: E731
    return run_pipeline(
        args.pipeline_yaml, args.root, json.loads(args.arguments), run_subprocess=runner, out=out
    )


if __name__ == "__main__":
    sys.exit(main())
