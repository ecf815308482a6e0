"""The predictor settings a cluster needs besides resources (issue 20, point 6): the dtype and
context the Hugging Face runtime loads with, where the pods go, the account KServe's storage
initializer reads credentials from, and whether the service gets a public URL. Every body is
checked against KServe's InferenceService CRD (the fake API server's strict validation).

Upstream, at the commit tests/fixtures/crds pins (kserve/kserve aaac4e29):

- python/huggingfaceserver/huggingfaceserver/__main__.py: `--dtype` (choices auto, float16,
  float32, bfloat16, float, half; `auto` on a GPU is float16 unless config.json says) and
  `--max_model_len`; with vLLM, vLLM's own `--dtype` (auto: half precision for float32).
- pkg/constants/constants.go: VisibilityLabel `networking.knative.dev/visibility` (Knative
  mode, copied to the Knative Service by ksvc_reconciler.go) and NetworkVisibility
  `networking.kserve.io/visibility` (Standard mode ingress), value ClusterLocalVisibility
  `cluster-local`.
- pkg/credentials/service_account_credentials.go CreateSecretVolumeAndEnv: the storage
  initializer's credentials come from the predictor's serviceAccountName (else `default`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from fakes.fake_k8s import FakeK8s
from kubellm.backends.base import ServeRequest, ServeResources
from kubellm.backends.kubernetes.inferenceservice import (
    CLUSTER_LOCAL,
    KNATIVE_VISIBILITY_LABEL,
    KSERVE_VISIBILITY_LABEL,
    build_inferenceservice,
)

GPU_NODES = {"nvidia.com/gpu.product": "NVIDIA-L4"}
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
EVICTION = {
    "key": "node.kubernetes.io/unreachable",
    "operator": "Exists",
    "effect": "NoExecute",
    "tolerationSeconds": 30,
}


def request(**overrides: Any) -> ServeRequest:
    base: dict[str, Any] = {
        "name": "llm",
        "model_uri": "s3://models/llm/3/model",
        "image": "ghcr.io/example/kubellm-serve:test",
        "run_tag": "run-1",
        "version": "3",
    }
    return ServeRequest(**{**base, **overrides})


def container_of(body: dict[str, Any]) -> dict[str, Any]:
    predictor = body["spec"]["predictor"]
    return dict(predictor.get("model") or predictor["containers"][0])


@dataclass
class ArgsCase:
    name: str
    gpus: int
    dtype: str
    max_model_len: int
    want: list[str]  # the args after --model_name


ARGS_CASES = [
    # on a GPU without --dtype, vLLM would serve the float32 checkpoint in half precision
    ArgsCase("gpu-float32", 1, "float32", 0, ["--dtype=float32"]),
    ArgsCase("gpu-bf16-context", 2, "bfloat16", 4096, ["--dtype=bfloat16", "--max_model_len=4096"]),
    ArgsCase(
        "cpu-float32",
        0,
        "float32",
        256,
        ["--backend=huggingface", "--dtype=float32", "--max_model_len=256"],
    ),
    ArgsCase("runtime-default", 1, "", 0, []),  # a bare ServeRequest leaves both to the runtime
]


@pytest.mark.parametrize("case", ARGS_CASES, ids=lambda c: c.name)
def test_the_huggingface_runtime_gets_dtype_and_context(case: ArgsCase, fake_k8s: FakeK8s) -> None:
    body = build_inferenceservice(
        request(
            dtype=case.dtype,
            max_model_len=case.max_model_len,
            resources=ServeResources(gpus=case.gpus),
        )
    )
    assert fake_k8s.validate("inferenceservices", body) == []
    assert container_of(body)["args"] == ["--model_name=llm", *case.want]


@dataclass
class CustomCase:
    name: str
    overrides: dict[str, Any]
    ok: bool


CUSTOM_CASES = [
    CustomCase("checkpoint-dtype", {"dtype": "float32"}, True),
    CustomCase("runtime-default", {}, True),
    CustomCase("half", {"dtype": "bfloat16"}, False),
    CustomCase("context", {"max_model_len": 2048}, False),
]


@pytest.mark.parametrize("case", CUSTOM_CASES, ids=lambda c: c.name)
def test_kubellm_serve_takes_no_dtype_or_context_flag(case: CustomCase, fake_k8s: FakeK8s) -> None:
    """`kubellm serve` loads the checkpoint as it is (float32): it has neither flag, so a
    request for another dtype or a context cap is refused, not silently dropped."""
    req = request(runtime="custom", **case.overrides)
    if not case.ok:
        with pytest.raises(ValueError, match=r"runtime 'custom'.*need runtime 'huggingface'"):
            build_inferenceservice(req)
        return
    body = build_inferenceservice(req)
    assert fake_k8s.validate("inferenceservices", body) == []
    args = container_of(body)["args"]
    assert not any(a.startswith(("--dtype", "--max_model_len", "--max-model-len")) for a in args)


@dataclass
class PlacementCase:
    name: str
    runtime: str
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    service_account: str = ""


PLACEMENT_CASES = [
    PlacementCase("hf-gpu-nodes", "huggingface", GPU_NODES, [GPU_TAINT, EVICTION], "model-reader"),
    PlacementCase("custom-gpu-nodes", "custom", GPU_NODES, [GPU_TAINT], "model-reader"),
    PlacementCase("hf-selector-only", "huggingface", {"pool": "serving"}),
    PlacementCase("nothing-set", "custom"),
]


@pytest.mark.parametrize("case", PLACEMENT_CASES, ids=lambda c: c.name)
def test_placement_and_account_are_the_predictors(case: PlacementCase, fake_k8s: FakeK8s) -> None:
    """nodeSelector, tolerations and serviceAccountName are pod fields of the predictor
    (V1beta1PredictorSpec), the same for either runtime; unset ones are left out."""
    body = build_inferenceservice(
        request(
            runtime=case.runtime,
            service_account=case.service_account,
            resources=ServeResources(
                gpus=1, node_selector=case.node_selector, tolerations=case.tolerations
            ),
        )
    )
    assert fake_k8s.validate("inferenceservices", body) == []
    predictor = body["spec"]["predictor"]
    assert predictor.get("nodeSelector") == (case.node_selector or None)
    assert predictor.get("tolerations") == (case.tolerations or None)  # the API form, as given
    assert predictor.get("serviceAccountName") == (case.service_account or None)
    # the account's secrets reach the storage initializer through KServe, not a token
    assert predictor["automountServiceAccountToken"] is False


def test_a_dtype_the_runtime_does_not_know_is_refused_before_it_is_sent() -> None:
    """huggingfaceserver's argparse would exit at start: a pod that never gets ready."""
    with pytest.raises(ValueError, match=r"dtype 'fp32' is not one of .*bfloat16"):
        build_inferenceservice(request(dtype="fp32"))


def test_a_toleration_with_an_unknown_field_is_refused() -> None:
    bad = ServeResources(tolerations=[{"key": "gpu", "operator": "Exists", "colour": "red"}])
    with pytest.raises(ValueError, match=r"unknown field.*colour"):
        build_inferenceservice(request(resources=bad))


@pytest.mark.parametrize("runtime", ["huggingface", "custom"])
@pytest.mark.parametrize("canary", [False, True])
def test_cluster_local_hides_the_service_and_its_tag_urls(
    runtime: str, canary: bool, fake_k8s: FakeK8s
) -> None:
    """Both visibility labels: Knative mode reads the Knative one (its route and every tag
    route, the canary's own URL included, go on the cluster-local domain only), Standard mode
    KServe's. The canary update carries them too, so the rollout never publishes the
    untested revision's tag."""
    body = build_inferenceservice(request(runtime=runtime, cluster_local=True), canary=canary)
    assert fake_k8s.validate("inferenceservices", body) == []
    labels = body["metadata"]["labels"]
    assert labels[KNATIVE_VISIBILITY_LABEL] == CLUSTER_LOCAL == "cluster-local"
    assert labels[KSERVE_VISIBILITY_LABEL] == CLUSTER_LOCAL
    assert labels["app.kubernetes.io/managed-by"] == "kubellm"  # the others stay
    # tag routing stays on: the smoke test calls the canary at its in-cluster tag address
    assert body["metadata"]["annotations"]["serving.kserve.io/enable-tag-routing"] == "true"


def test_a_public_service_carries_no_visibility_label(fake_k8s: FakeK8s) -> None:
    body = build_inferenceservice(request(cluster_local=False))
    assert fake_k8s.validate("inferenceservices", body) == []
    labels = body["metadata"]["labels"]
    assert KNATIVE_VISIBILITY_LABEL not in labels and KSERVE_VISIBILITY_LABEL not in labels
