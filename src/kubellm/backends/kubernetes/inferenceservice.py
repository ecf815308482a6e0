"""Serve a model as a KServe v1beta1 InferenceService running `kubellm serve`.

The predictor is a custom container (our serving image) named `kserve-container`; its
`STORAGE_URI` variable is how KServe learns where the model is for custom containers: the
storage initializer downloads it to /mnt/models before the server starts (a pvc:// URI is
mounted there instead). The server speaks the same V1 protocol as the local ModelServer.

Example (a cluster with KServe):

    InferenceServiceServer().deploy(ServeRequest(name="llm", namespace="team-a",
        model_uri="pvc://kubellm-workspace/models/llm", image="ghcr.io/org/kubellm-serve:1"))
"""

from __future__ import annotations

from typing import Any

from kserve import (
    V1beta1InferenceService,
    V1beta1InferenceServiceSpec,
    V1beta1PredictorSpec,
)
from kserve.constants import constants as ks
from kubernetes import client as k8s

from kubellm.backends.base import Server, ServeRequest
from kubellm.backends.kubernetes.client import (
    CustomResource,
    KubeClient,
    condition_is_true,
    container_security,
    find_condition,
    pod_security,
    to_dict,
)
from kubellm.serve.client import Endpoint

INFERENCESERVICE = CustomResource(
    ks.KSERVE_GROUP,
    ks.KSERVE_V1BETA1_VERSION,
    ks.KSERVE_PLURAL_INFERENCESERVICE,
    ks.KSERVE_KIND_INFERENCESERVICE,
)
# KServe injects the storage initializer for, and routes traffic to, this container only.
CONTAINER = "kserve-container"
MODEL_DIR = "/mnt/models"
PORT = 8080
SCRATCH = "/tmp"
RUN_TAG_ANNOTATION = "kubellm/run-tag"
# Model states after which KServe will not become ready without a new spec.
_BLOCKED = {"BlockedByFailedLoad", "InvalidSpec"}


def build_inferenceservice(
    request: ServeRequest, cpu: str = "500m", memory: str = "2Gi"
) -> dict[str, Any]:
    """The InferenceService body for `request`."""
    if not request.image:
        raise ValueError(f"ServeRequest {request.name!r}: image is required to serve on KServe")
    if not request.model_uri:
        raise ValueError(f"ServeRequest {request.name!r}: model_uri is required")
    container = k8s.V1Container(
        name=CONTAINER,
        image=request.image,
        command=["kubellm"],
        args=["serve", MODEL_DIR, "--name", request.name, "--host", "0.0.0.0", "--port", str(PORT)],
        env=[
            k8s.V1EnvVar(name="STORAGE_URI", value=request.model_uri),
            k8s.V1EnvVar(name="HOME", value=SCRATCH),
        ],
        ports=[k8s.V1ContainerPort(container_port=PORT, protocol="TCP")],
        resources=k8s.V1ResourceRequirements(
            requests={"cpu": cpu, "memory": memory}, limits={"cpu": cpu, "memory": memory}
        ),
        # A read-only root filesystem; the server's temporary files go to an emptyDir.
        security_context=container_security(read_only_root=True),
        volume_mounts=[k8s.V1VolumeMount(name="scratch", mount_path=SCRATCH)],
    )
    annotations = {RUN_TAG_ANNOTATION: request.run_tag} if request.run_tag else None
    isvc = V1beta1InferenceService(
        api_version=INFERENCESERVICE.api_version,
        kind=INFERENCESERVICE.kind,
        metadata=k8s.V1ObjectMeta(
            name=request.name,
            namespace=request.namespace,
            labels={"app.kubernetes.io/managed-by": "kubellm"},
            annotations=annotations,
        ),
        spec=V1beta1InferenceServiceSpec(
            predictor=V1beta1PredictorSpec(
                containers=[container],
                volumes=[k8s.V1Volume(name="scratch", empty_dir=k8s.V1EmptyDirVolumeSource())],
                min_replicas=1,  # a model that scales to zero fails the smoke test's first call
                security_context=pod_security(),
                # The model server never calls the Kubernetes API: no token in the pod.
                automount_service_account_token=False,
            )
        ),
    )
    return to_dict(isvc)


def ready_state(obj: dict[str, Any]) -> str:
    """`Ready`, or why not (`Ready=False (RevisionFailed: ...)`): what a timeout reports."""
    cond = find_condition(obj, "Ready")
    if cond is None:
        return "Pending"
    if str(cond.get("status")) == "True":
        return "Ready"
    why = ": ".join(str(cond[k]) for k in ("reason", "message") if cond.get(k))
    return f"Ready={cond.get('status')}" + (f" ({why})" if why else "")


def _url(obj: dict[str, Any], cluster_local: bool) -> str:
    status = obj.get("status") or {}
    public = status.get("url") or ""
    internal = (status.get("address") or {}).get("url") or ""
    return (internal or public) if cluster_local else (public or internal)


def _generation_observed(obj: dict[str, Any]) -> bool:
    """After a replace, Ready may still describe the previous spec until reconciled."""
    generation = (obj.get("metadata") or {}).get("generation")
    observed = (obj.get("status") or {}).get("observedGeneration")
    return generation is None or observed is None or observed >= generation


def _blocked(obj: dict[str, Any]) -> str | None:
    """KServe's verdict that the model cannot load (a spec change is needed), else None."""
    model = (obj.get("status") or {}).get("modelStatus") or {}
    if model.get("transitionStatus") not in _BLOCKED:
        return None
    info = model.get("lastFailureInfo") or {}
    parts = [str(info[k]) for k in ("reason", "message") if info.get(k)]
    return ": ".join(parts) or f"{model['transitionStatus']} ({ready_state(obj)})"


class InferenceServiceServer(Server):
    """Server on a cluster: one InferenceService per model name, replaced on redeploy.

    `namespace` is where `delete` looks (a cleanup step in another process has only the
    name); `cluster_local` returns the in-cluster address instead of the external URL, for
    callers that run in pods without ingress DNS.
    """

    def __init__(
        self,
        api_client: k8s.ApiClient | None = None,
        *,
        namespace: str = "default",
        poll_interval_s: float = 5.0,
        request_timeout_s: float = 30.0,
        cluster_local: bool = False,
        cpu: str = "500m",
        memory: str = "2Gi",
    ) -> None:
        self.kube = KubeClient(api_client, poll_interval_s, request_timeout_s)
        self.namespace = namespace
        self.cluster_local = cluster_local
        self.cpu, self.memory = cpu, memory
        self._deployed: dict[str, str] = {}  # name -> namespace, so delete finds our own

    def deploy(self, request: ServeRequest) -> Endpoint:
        body = build_inferenceservice(request, self.cpu, self.memory)
        ns = request.namespace
        self.kube.create_or_replace(INFERENCESERVICE, ns, body)
        self._deployed[request.name] = ns
        obj = self.kube.wait(
            INFERENCESERVICE,
            ns,
            request.name,
            request.timeout_s,
            done=lambda o: (
                condition_is_true(o, "Ready")
                and _generation_observed(o)
                and bool(_url(o, self.cluster_local))
            ),
            failure=_blocked,
            describe=ready_state,
        )
        return Endpoint(name=request.name, url=_url(obj, self.cluster_local))

    def delete(self, name: str, run_tag: str = "") -> None:
        """Delete `name`; with `run_tag`, only if that run deployed it (another run's stays)."""
        ns = self._deployed.pop(name, self.namespace)
        if run_tag:
            obj = self.kube.get(INFERENCESERVICE, ns, name)
            if obj is None:
                return
            owner = ((obj.get("metadata") or {}).get("annotations") or {}).get(RUN_TAG_ANNOTATION)
            if owner != run_tag:
                print(f"inferenceservice/{name}: kept, deployed by run {owner!r} not {run_tag!r}")
                return
        if self.kube.delete(INFERENCESERVICE, ns, name):
            print(f"inferenceservice/{name}: deleted", flush=True)
