"""InferenceServiceServer against the fake API server (schema: KServe's InferenceService CRD).

The statuses here are scripted, each one a status KServe writes (the fake validates them
against the CRD too): kserve/kserve pkg/apis/serving/v1beta1/inference_service_status.go
PropagateStatus copies the Knative Service's revisions and traffic into
status.components.predictor, and ksvc_reconciler.go decides that traffic from
canaryTrafficPercent. tests/k8s/test_canary.py runs the same flows on the simulated
cluster, with real predictor processes.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from fakes.fake_k8s import FakeK8s
from fakes.k8s_schemas import VENDORED_CRDS, servingruntime_errors
from fakes.kserve_controller import HF_RUNTIME_YAML
from kubellm.backends.base import JobFailed, JobTimeout, ServeRequest, ServeResources
from kubellm.backends.kubernetes.inferenceservice import (
    InferenceServiceServer,
    build_inferenceservice,
    tag_url,
)

from .conftest import POLL_S

NS = "default"
URL = "http://llm.default.example.com"
ADDRESS = "http://llm.default.svc.cluster.local"
PREDICTOR_URL = "http://llm-predictor.default.example.com"
PREDICTOR_ADDRESS = "http://llm-predictor.default.svc.cluster.local"
REV1, REV2, REV3 = (f"llm-predictor-0000{i}" for i in (1, 2, 3))


def request(**overrides: Any) -> ServeRequest:
    base: dict[str, Any] = {
        "name": "llm",
        "model_uri": "pvc://kubellm-workspace/serve/v1",
        "image": "ghcr.io/example/kubellm-serve:test",
        "timeout_s": 10.0,
        "run_tag": "run-1",
        "version": "1",
    }
    return ServeRequest(**{**base, **overrides})


def server(fake: FakeK8s, **kwargs: Any) -> InferenceServiceServer:
    return InferenceServiceServer(
        fake.api_client(), poll_interval_s=POLL_S, traffic_timeout_s=5.0, **kwargs
    )


# ---------------------------------------------------------------- KServe's statuses


def target(tag: str, rev: str, percent: int, latest: bool) -> dict[str, Any]:
    """A Knative traffic target as KServe reports it; tagged ones have their own URL."""
    return {
        "tag": tag,
        "revisionName": rev,
        "percent": percent,
        "latestRevision": latest,
        "url": f"http://{tag}-llm-predictor.default.example.com",
    }


def condition(ctype: str, status: str, reason: str = "", message: str = "") -> dict[str, Any]:
    out = {"type": ctype, "status": status}
    return {
        **out,
        **({"reason": reason} if reason else {}),
        **({"message": message} if message else {}),
    }


def status(
    created: str,
    ready: str,
    rolled: str = "",
    traffic: tuple[dict[str, Any], ...] = (),
    *,
    previous: str = "",
    generation: int = 1,
    ready_status: str = "True",
    reason: str = "",
    message: str = "",
    model: str = "UpToDate",
    failure: dict[str, Any] | None = None,
    mode: str = "Serverless",
) -> dict[str, Any]:
    """status of InferenceService llm: its revisions, traffic and conditions."""
    predictor: dict[str, Any] = {"latestCreatedRevision": created, "traffic": list(traffic)}
    for key, value in (
        ("latestReadyRevision", ready),
        ("latestRolledoutRevision", rolled),
        ("previousRolledoutRevision", previous),
    ):
        if value:
            predictor[key] = value
    if ready:
        predictor.update(url=PREDICTOR_URL, address={"url": PREDICTOR_ADDRESS})
    out: dict[str, Any] = {
        "observedGeneration": generation,
        "deploymentMode": mode,
        "components": {"predictor": predictor},
        "conditions": [
            condition("IngressReady", "True" if ready else "Unknown"),
            condition("PredictorReady", ready_status, reason, message),
            condition("Ready", ready_status, reason, message),
        ],
        "modelStatus": {
            "transitionStatus": model,
            "states": {
                "activeModelState": "Loaded" if ready else "",
                "targetModelState": {"UpToDate": "Loaded", "InProgress": "Pending"}.get(
                    model, "FailedToLoad"
                ),
            },
            **({"lastFailureInfo": failure} if failure else {}),
        },
    }
    if ready:
        out.update(url=URL, address={"url": ADDRESS})
    return out


STARTING = status(
    REV1,
    "",
    ready_status="Unknown",
    reason="RevisionMissing",
    message='Configuration "llm-predictor" is waiting for a Revision to become ready.',
    model="InProgress",
)
SERVING = status(REV1, REV1, REV1, (target("latest", REV1, 100, True),))
LOAD_FAILED = {
    "reason": "ModelLoadFailed",
    "message": "no config.json in /mnt/models",
    "exitCode": 1,
}
FAILED_FIRST = status(
    REV1,
    "",
    ready_status="False",
    reason="RevisionFailed",
    message=f'Revision "{REV1}" failed with message: Container failed with: crashloop.',
    model="BlockedByFailedLoad",
    failure=LOAD_FAILED,
)
# ksvc_reconciler.go: canaryTrafficPercent 10 beside REV1; until REV2 is ready, `latest`
# still resolves to the latest ready revision (Knative), so REV1 has all traffic.
CANARY_STARTING = status(
    REV2,
    REV1,
    REV1,
    (target("latest", REV1, 10, True), target("prev", REV1, 90, False)),
    generation=2,
    ready_status="Unknown",
    model="InProgress",
)
CANARY = status(
    REV2,
    REV2,
    REV1,
    (target("latest", REV2, 10, True), target("prev", REV1, 90, False)),
    generation=2,
)
CANARY_FAILED = status(
    REV2,
    REV1,
    REV1,
    (target("latest", REV1, 10, True), target("prev", REV1, 90, False)),
    generation=2,
    ready_status="False",
    reason="RevisionFailed",
    message=f'Revision "{REV2}" failed with message: Container failed with: crashloop.',
    model="BlockedByFailedLoad",
    failure=LOAD_FAILED,
)
# canaryTrafficPercent 0: all traffic back on REV1, REV2 kept behind its tag at 0%.
ROLLED_BACK = status(
    REV2,
    REV2,
    REV1,
    (target("latest", REV2, 0, True), target("prev", REV1, 100, False)),
    generation=3,
)
ROLLED_BACK_FAILED = {
    **CANARY_FAILED,
    "components": {
        "predictor": {
            **CANARY_FAILED["components"]["predictor"],
            "traffic": [target("latest", REV1, 0, True), target("prev", REV1, 100, False)],
        }
    },
}
# canaryTrafficPercent removed: REV2 takes all traffic and is rolled out (PropagateStatus).
PROMOTED = status(
    REV2, REV2, REV2, (target("latest", REV2, 100, True),), previous=REV1, generation=3
)


def stored(fake: FakeK8s, st: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """InferenceService llm as `request(**overrides)` left it, with status `st`; with the
    canary share in its spec where `st` splits traffic (a `prev` target)."""
    traffic = st["components"]["predictor"].get("traffic") or []
    split = any(t.get("tag") == "prev" for t in traffic)
    body = build_inferenceservice(request(**overrides), canary=split)
    fake.create_object("inferenceservices", body, NS)
    fake.set_status("inferenceservices", "llm", st, namespace=NS)
    obj = fake.get_object("inferenceservices", "llm", NS)
    assert obj is not None
    return obj


def puts(fake: FakeK8s) -> list[dict[str, Any]]:
    return [r.body for r in fake.requests if r.method == "PUT" and "/inferenceservices/" in r.path]


def percent_sent(body: dict[str, Any]) -> Any:
    return body["spec"]["predictor"].get("canaryTrafficPercent", "absent")


# ---------------------------------------------------------------- the bodies


def test_huggingface_runtime_body_is_the_model_kserve_expects(fake_k8s: FakeK8s) -> None:
    body = build_inferenceservice(request())

    assert fake_k8s.validate("inferenceservices", body) == []  # strict: no unknown field
    predictor = body["spec"]["predictor"]
    model = predictor["model"]
    assert "containers" not in predictor  # inference_service_validation.go: exactly one
    assert "name" not in model  # validatePredictor: no 'name' in a standard predictor
    # predictor_model.go: the format KServe matches against supportedModelFormats
    assert model["modelFormat"] == {"name": "huggingface"}
    assert model["storageUri"] == "pvc://kubellm-workspace/serve/v1"
    # huggingfaceserver/__main__.py flags; appended to the runtime's --model_name={{.Name}}
    assert model["args"] == ["--model_name=llm", "--backend=huggingface"]
    assert {e["name"]: e["value"] for e in model["env"]} == {"HOME": "/tmp"}
    assert model["securityContext"]["readOnlyRootFilesystem"] is True
    assert model["volumeMounts"] == [{"name": "scratch", "mountPath": "/tmp"}]
    assert predictor["volumes"] == [{"name": "scratch", "emptyDir": {}}]
    # python/huggingface_server.Dockerfile: USER 1000, on the container: Knative's
    # PodSpecMask admits no pod-level securityContext under its default feature flags
    assert "securityContext" not in predictor
    assert model["securityContext"]["runAsUser"] == 1000
    assert model["securityContext"]["runAsNonRoot"] is True
    assert model["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert predictor["automountServiceAccountToken"] is False
    assert "canaryTrafficPercent" not in predictor  # a create takes all traffic
    assert body["metadata"]["annotations"] == {
        "serving.kserve.io/enable-tag-routing": "true",  # constants.go EnableRoutingTag...
        "kubellm/run-tag": "run-1",
        "kubellm/model-version": "1",
    }
    assert "serving.kserve.io/deploymentMode" not in body["metadata"]["annotations"]


def test_the_sims_huggingface_runtime_is_kserves() -> None:
    """config/runtimes/kserve-huggingfaceserver.yaml, as the simulated cluster installs it."""
    import yaml

    runtime = yaml.safe_load(HF_RUNTIME_YAML)
    assert servingruntime_errors(VENDORED_CRDS, runtime) == []
    assert runtime["kind"] == "ClusterServingRuntime"
    assert runtime["metadata"]["name"] == "kserve-huggingfaceserver"
    (fmt,) = runtime["spec"]["supportedModelFormats"]
    assert (fmt["name"], fmt["autoSelect"]) == ("huggingface", True)
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"
    assert container["args"] == ["--model_name={{.Name}}"]


@dataclass
class BodyCase:
    name: str
    runtime: str
    resources: ServeResources
    gpu: str | None  # nvidia.com/gpu requested and limited
    backend_flag: bool


BODY_CASES = [
    BodyCase("hf-cpu", "huggingface", ServeResources("2", "8Gi"), None, True),
    # on a GPU the runtime's `auto` backend may pick vLLM
    BodyCase(
        "hf-gpu", "huggingface", ServeResources("4", "24Gi", gpus=2, max_replicas=3), "2", False
    ),
    BodyCase("custom-cpu", "custom", ServeResources("500m", "2Gi", min_replicas=0), None, False),
    BodyCase("custom-gpu", "custom", ServeResources("1", "4Gi", gpus=1), "1", False),
]


@pytest.mark.parametrize("case", BODY_CASES, ids=lambda c: c.name)
def test_resources_replicas_and_gpus_come_from_the_request(
    case: BodyCase, fake_k8s: FakeK8s
) -> None:
    body = build_inferenceservice(request(runtime=case.runtime, resources=case.resources))

    assert fake_k8s.validate("inferenceservices", body) == []
    predictor = body["spec"]["predictor"]
    res = case.resources
    assert (predictor["minReplicas"], predictor["maxReplicas"]) == (
        res.min_replicas,
        res.max_replicas,
    )
    container = predictor["model"] if case.runtime == "huggingface" else predictor["containers"][0]
    want = {"cpu": res.cpu, "memory": res.memory}
    if case.gpu:
        want["nvidia.com/gpu"] = case.gpu
    assert container["resources"] == {"requests": want, "limits": want}
    if case.runtime == "huggingface":
        assert ("--backend=huggingface" in container["args"]) is case.backend_flag
    else:
        assert "model" not in predictor
        assert container["name"] == "kserve-container"
        assert [*container["command"], *container["args"]] == [
            "kubellm",
            "serve",
            "/mnt/models",
            "--name",
            "llm",
            "--host",
            "0.0.0.0",
            "--port",
            "8080",
        ]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env == {"STORAGE_URI": "pvc://kubellm-workspace/serve/v1", "HOME": "/tmp"}
        assert container["securityContext"]["runAsUser"] == 10001  # our images' user
        assert "securityContext" not in predictor  # Knative's PodSpecMask


@pytest.mark.parametrize("share", [0, 10, 100])
def test_a_canary_body_carries_the_share(share: int, fake_k8s: FakeK8s) -> None:
    body = build_inferenceservice(request(canary_traffic_percent=share), canary=True)
    assert fake_k8s.validate("inferenceservices", body) == []
    assert body["spec"]["predictor"]["canaryTrafficPercent"] == share


@dataclass
class BadRequest:
    name: str
    overrides: dict[str, Any]
    match: str


BAD_REQUESTS = [
    # inference_service_validation.go IsvcNameFmt
    BadRequest("name-starts-with-digit", {"name": "1llm"}, "DNS-1035"),
    BadRequest("name-with-dot", {"name": "llm.v2"}, "DNS-1035"),
    # utils.go SupportedStorageURIPrefixList (the controller refuses others, silently)
    BadRequest("unknown-scheme", {"model_uri": "ftp://host/model"}, "storage initializer"),
    BadRequest("custom-without-image", {"runtime": "custom", "image": ""}, "serving image"),
    # Knative's route validation: a traffic percent within 0..100
    BadRequest("share-above-100", {"canary_traffic_percent": 120}, "0..100"),
    # component.go validateReplicas
    BadRequest("min-above-max", {"resources": ServeResources(min_replicas=3)}, "min_replicas"),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=lambda c: c.name)
def test_requests_kserve_would_refuse_fail_before_anything_is_sent(case: BadRequest) -> None:
    with pytest.raises(ValueError, match=case.match):
        build_inferenceservice(request(**case.overrides))


@dataclass
class WebhookCase:
    name: str
    mutate: Any
    message: str


def _both(b: dict[str, Any]) -> None:
    custom = build_inferenceservice(request(runtime="custom"))
    b["spec"]["predictor"]["containers"] = custom["spec"]["predictor"]["containers"]


WEBHOOK_CASES = [
    WebhookCase("model-and-containers", _both, "exactly one of"),
    WebhookCase(
        "model-name", lambda b: b["spec"]["predictor"]["model"].update(name="x"), "'name' field"
    ),
    WebhookCase(
        "min-above-max",
        lambda b: b["spec"]["predictor"].update(minReplicas=5),
        "cannot be greater than MaxReplicas",
    ),
    WebhookCase(
        "name-format", lambda b: b["metadata"].update(name="x9.y"), "a InferenceService name"
    ),
    WebhookCase(
        "percent-as-string",
        lambda b: b["spec"]["predictor"].update(canaryTrafficPercent="10"),
        "canaryTrafficPercent",
    ),
]


@pytest.mark.parametrize("case", WEBHOOK_CASES, ids=lambda c: c.name)
def test_the_fake_refuses_what_kserves_webhook_refuses(
    case: WebhookCase, fake_k8s: FakeK8s
) -> None:
    """The fake API server's InferenceService checks: the CRD schema plus the validating
    webhook's rules (pkg/apis/serving/v1beta1/inference_service_validation.go)."""
    body = build_inferenceservice(request())
    case.mutate(body)
    errors = fake_k8s.validate("inferenceservices", body)
    assert any(case.message in e for e in errors), errors


# ---------------------------------------------------------------- first deployments


@dataclass
class UrlCase:
    name: str
    cluster_local: bool
    url: str


URL_CASES = [UrlCase("cluster-local", True, ADDRESS), UrlCase("ingress", False, URL)]


@pytest.mark.parametrize("case", URL_CASES, ids=lambda c: c.name)
def test_first_deploy_creates_with_all_traffic_and_waits_for_ready(
    case: UrlCase, fake_k8s: FakeK8s, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_k8s.script_status("inferenceservices", "llm", [{}, STARTING, SERVING], namespace=NS)

    rollout = server(fake_k8s, cluster_local=case.cluster_local).deploy(request())

    assert rollout.canary is False and rollout.previous == ""
    assert rollout.endpoint.name == "llm"
    assert rollout.endpoint.url == case.url
    assert rollout.endpoint.ready_url == f"{case.url}/v1/models/llm"
    (created,) = fake_k8s.created("inferenceservices")
    assert "canaryTrafficPercent" not in created["spec"]["predictor"]
    assert puts(fake_k8s) == []
    out = capsys.readouterr().out
    assert "inferenceservice/llm: Ready=Unknown (RevisionMissing" in out
    assert f"inferenceservice/llm: Ready [traffic {REV1} 100% (latest)]" in out
    assert fake_k8s.errors == []


def test_cluster_local_address_is_the_default(fake_k8s: FakeK8s) -> None:
    fake_k8s.script_status("inferenceservices", "llm", [SERVING], namespace=NS)
    srv = InferenceServiceServer(fake_k8s.api_client(), poll_interval_s=POLL_S)
    assert srv.cluster_local is True
    assert srv.deploy(request()).endpoint.url == ADDRESS


@dataclass
class FirstFailure:
    name: str
    statuses: list[dict[str, Any]]
    timeout_s: float
    error: type[JobFailed]
    match: str


FIRST_FAILURES = [
    FirstFailure(
        "cannot-load", [STARTING, FAILED_FIRST], 10.0, JobFailed, r"ModelLoadFailed: no config"
    ),
    FirstFailure(
        "timeout", [STARTING], 0.3, JobTimeout, r"within 0.3s.*RevisionMissing.*waiting for"
    ),
]


@pytest.mark.parametrize("case", FIRST_FAILURES, ids=lambda c: c.name)
def test_a_first_deploy_that_never_serves_is_deleted_with_the_reason(
    case: FirstFailure, fake_k8s: FakeK8s
) -> None:
    fake_k8s.script_status("inferenceservices", "llm", case.statuses, namespace=NS)
    start = time.monotonic()

    with pytest.raises(case.error, match=case.match) as info:
        server(fake_k8s).deploy(request(timeout_s=case.timeout_s))

    assert "it has been deleted" in str(info.value)
    assert case.error is JobTimeout or not isinstance(info.value, JobTimeout)
    assert ("inferenceservices", NS, "llm") in fake_k8s.deleted
    assert time.monotonic() - start < 5.0
    assert fake_k8s.errors == []


# ---------------------------------------------------------------- canaries


@dataclass
class CanaryCase:
    name: str
    cluster_local: bool
    endpoint: str


CANARY_CASES = [
    # Knative makes a Service `<tag>-<route>` per tag (knative docs, "Creating and using
    # Subroutes"): the cluster-local address of the `latest` tag.
    CanaryCase("cluster-local", True, "http://latest-llm-predictor.default.svc.cluster.local"),
    CanaryCase("ingress", False, "http://latest-llm-predictor.default.example.com"),
]


@pytest.mark.parametrize("case", CANARY_CASES, ids=lambda c: c.name)
def test_second_deploy_is_a_canary_beside_the_serving_revision(
    case: CanaryCase, fake_k8s: FakeK8s
) -> None:
    stored(fake_k8s, SERVING)
    # The stale Ready of REV1 (read twice, before the update) must not end the wait.
    fake_k8s.script_status(
        "inferenceservices", "llm", [SERVING, SERVING, CANARY_STARTING, CANARY], namespace=NS
    )

    srv = server(fake_k8s, cluster_local=case.cluster_local)
    rollout = srv.deploy(request(model_uri="pvc://kubellm-workspace/serve/v2", version="2"))

    assert rollout.canary is True
    assert rollout.previous == REV1
    assert rollout.endpoint.url == case.endpoint
    (update,) = puts(fake_k8s)
    assert percent_sent(update) == 10
    assert update["spec"]["predictor"]["model"]["storageUri"].endswith("/serve/v2")
    assert update["metadata"]["annotations"]["kubellm/model-version"] == "2"
    assert update["metadata"]["resourceVersion"]  # optimistic concurrency
    assert fake_k8s.deleted == []
    assert fake_k8s.errors == []


def test_a_canary_that_fails_gets_no_traffic_and_nothing_is_deleted(fake_k8s: FakeK8s) -> None:
    stored(fake_k8s, SERVING)
    fake_k8s.script_status(
        "inferenceservices",
        "llm",
        [SERVING, SERVING, CANARY_STARTING, CANARY_FAILED, CANARY_FAILED, ROLLED_BACK_FAILED],
        namespace=NS,
    )

    with pytest.raises(JobFailed, match=r"canary revision llm-predictor-00002 failed") as info:
        server(fake_k8s).deploy(request(model_uri="pvc://kubellm-workspace/serve/v2"))

    assert "ModelLoadFailed: no config.json" in str(info.value)
    assert f"traffic back on revision {REV1}" in str(info.value)
    assert [percent_sent(b) for b in puts(fake_k8s)] == [10, 0]  # KServe's rollback: 0
    assert fake_k8s.deleted == []
    assert fake_k8s.errors == []


def test_a_canary_that_times_out_is_rolled_back_not_deleted(fake_k8s: FakeK8s) -> None:
    stored(fake_k8s, SERVING)
    fake_k8s.script_status(
        "inferenceservices", "llm", [SERVING, SERVING, CANARY_STARTING], namespace=NS
    )

    def roll_back_when_told() -> None:  # KServe answers the 0% with REV1 at 100%
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if any(percent_sent(b) == 0 for b in puts(fake_k8s)):
                fake_k8s.script_status("inferenceservices", "llm", [ROLLED_BACK], namespace=NS)
                return
            time.sleep(0.01)

    import threading

    helper = threading.Thread(target=roll_back_when_told)
    helper.start()
    with pytest.raises(JobTimeout, match=r"did not become ready within 0.5s") as info:
        server(fake_k8s).deploy(
            request(model_uri="pvc://kubellm-workspace/serve/v2", timeout_s=0.5)
        )
    helper.join()

    assert f"traffic back on revision {REV1}" in str(info.value)
    assert fake_k8s.deleted == []


def test_a_failure_left_from_an_earlier_canary_is_not_this_ones(fake_k8s: FakeK8s) -> None:
    """REV2 failed and was rolled back (0%); its BlockedByFailedLoad is still in the status
    when REV3 goes out. Only a verdict about a revision created since counts."""
    stored(fake_k8s, ROLLED_BACK_FAILED)
    canary3 = copy.deepcopy(CANARY)
    pred = canary3["components"]["predictor"]
    pred.update(latestCreatedRevision=REV3, latestReadyRevision=REV3)
    pred["traffic"] = [target("latest", REV3, 10, True), target("prev", REV1, 90, False)]
    canary3["observedGeneration"] = 3
    fake_k8s.script_status(
        "inferenceservices",
        "llm",
        [ROLLED_BACK_FAILED, ROLLED_BACK_FAILED, ROLLED_BACK_FAILED, canary3],
        namespace=NS,
    )

    rollout = server(fake_k8s).deploy(request(model_uri="pvc://kubellm-workspace/serve/v3"))

    assert rollout.canary is True and rollout.previous == REV1
    assert fake_k8s.errors == []


def test_redeploying_what_serves_changes_nothing(fake_k8s: FakeK8s) -> None:
    stored(fake_k8s, SERVING)

    rollout = server(fake_k8s).deploy(request())  # the same model, run and version

    assert rollout.canary is False and rollout.endpoint.url == ADDRESS
    assert puts(fake_k8s) == [] and fake_k8s.deleted == []


# ---------------------------------------------------------------- whose service, which mode


def test_a_service_of_another_run_that_serves_nothing_is_left_alone(fake_k8s: FakeK8s) -> None:
    """Another run's first deployment, still starting: never replaced in place."""
    stored(fake_k8s, STARTING, run_tag="run-other")

    with pytest.raises(JobFailed, match=r"deployed by run 'run-other' and serves nothing"):
        server(fake_k8s).deploy(request())

    assert puts(fake_k8s) == [] and fake_k8s.deleted == []


def test_a_first_deploy_taken_over_by_another_run_is_not_deleted(fake_k8s: FakeK8s) -> None:
    """The timeout of a first deployment deletes the service only while it is ours."""
    fake_k8s.script_status("inferenceservices", "llm", [STARTING], namespace=NS)

    def take_over() -> None:  # another run deploys over it while we wait
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            obj = fake_k8s.get_object("inferenceservices", "llm", NS)
            if obj is not None:
                obj["metadata"]["annotations"]["kubellm/run-tag"] = "run-2"
                fake_k8s.put_object("inferenceservices", obj)
                return
            time.sleep(0.01)

    import threading

    helper = threading.Thread(target=take_over)
    helper.start()
    with pytest.raises(JobTimeout, match=r"kept: run 'run-2' has deployed it since"):
        server(fake_k8s).deploy(request(timeout_s=0.5))
    helper.join()

    assert fake_k8s.deleted == []


DENIED = (
    'fails to reconcile predictor: admission webhook "validation.webhook.serving.knative.dev" '
    "denied the request: validation failed: must not set the field(s): "
    "spec.template.spec.securityContext"
)


def test_a_knative_service_denied_by_knative_fails_at_once(fake_k8s: FakeK8s) -> None:
    """components/predictor.go: the ksvc's create error as PredictorReady False
    ReconcileFailed (modelStatus untouched): the same on every retry, so no timeout."""
    refused = status(
        "",
        "",
        ready_status="False",
        reason="ReconcileFailed",
        message=DENIED,
        model="InProgress",
    )
    fake_k8s.script_status("inferenceservices", "llm", [{}, refused], namespace=NS)

    with pytest.raises(JobFailed, match=r"ReconcileFailed: .*must not set the field") as info:
        server(fake_k8s).deploy(request(timeout_s=5.0))

    assert not isinstance(info.value, JobTimeout)
    assert "it has been deleted" in str(info.value)


def standard(ready: bool = True, *, canary: tuple[str, bool] | None = None) -> dict[str, Any]:
    """A Standard (RawDeployment) status: inference_service_status.go PropagateRawStatus,
    no revisions or traffic; canaryStatuses with spec.canary (predictor.go)."""
    cond = "True" if ready else "Unknown"
    out: dict[str, Any] = {
        "observedGeneration": 1,
        "deploymentMode": "Standard",
        "components": {"predictor": {"url": PREDICTOR_ADDRESS} if ready else {}},
        "conditions": [
            condition("IngressReady", cond),
            condition("PredictorReady", cond, "NewReplicaSetAvailable" if ready else ""),
            condition("Ready", cond),
        ],
        "modelStatus": {"transitionStatus": "UpToDate" if ready else "InProgress"},
    }
    if ready:
        out.update(url=URL, address={"url": ADDRESS})
    if canary is not None:
        out["canaryStatuses"] = [{"name": canary[0], "ready": canary[1], "trafficPercent": 10}]
        out["conditions"].append(condition("CanaryPredictorReady", str(canary[1])))
    return out


def predictor_pod(fake: FakeK8s, name: str, run_tag: str = "run-1", version: str = "1") -> None:
    """A ready predictor pod with the InferenceService's annotations (buildObjectMeta)."""
    fake.put_object(
        "pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": {"serving.kserve.io/inferenceservice": "llm", "component": "predictor"},
                "annotations": {"kubellm/run-tag": run_tag, "kubellm/model-version": version},
            },
            "spec": {"containers": [{"name": "kserve-container", "image": "x"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
        },
    )


def test_a_first_deploy_in_standard_mode_waits_for_ready_and_the_url(fake_k8s: FakeK8s) -> None:
    """Standard mode has no revisions: Ready, the address and the pods say it serves."""
    predictor_pod(fake_k8s, "llm-predictor-abc")
    fake_k8s.script_status(
        "inferenceservices", "llm", [{}, standard(ready=False), standard()], namespace=NS
    )

    rollout = server(fake_k8s).deploy(request())

    assert (rollout.canary, rollout.mode, rollout.endpoint.url) == (False, "Standard", ADDRESS)
    assert fake_k8s.deleted == []


def test_a_standard_canary_goes_beside_the_stable_predictor(fake_k8s: FakeK8s) -> None:
    """KServe 0.20 spec.canary: the stable predictor and the InferenceService's metadata stay
    as they are (no restart of what serves); the canary has its own Service."""
    before = stored(fake_k8s, standard())
    urls: list[tuple[str, str]] = []

    def service_url(ns: str, svc: str) -> str:
        urls.append((ns, svc))
        return f"http://{svc}.{ns}.test"

    def ready_when_sent() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if puts(fake_k8s):
                (entry,) = puts(fake_k8s)[0]["spec"]["canary"]
                name = entry["predictor"]["name"]
                fake_k8s.script_status(
                    "inferenceservices", "llm", [standard(canary=(name, True))], namespace=NS
                )
                return
            time.sleep(0.01)

    import threading

    helper = threading.Thread(target=ready_when_sent)
    helper.start()
    srv = server(fake_k8s, service_url=service_url)
    rollout = srv.deploy(request(model_uri="pvc://kubellm-workspace/serve/v2", version="2"))
    helper.join()

    (update,) = puts(fake_k8s)
    assert update["spec"]["predictor"] == before["spec"]["predictor"]  # untouched
    (entry,) = update["spec"]["canary"]
    assert entry["trafficPercent"] == 10
    canary = entry["predictor"]
    assert canary["name"].startswith("v2-")
    assert canary["model"]["storageUri"].endswith("/serve/v2")
    assert "maxReplicas" not in canary and "minReplicas" not in canary  # validateCanarySpecs
    assert canary["annotations"]["kubellm/run-tag"] == "run-1"
    assert update["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    assert update["metadata"]["annotations"]["kubellm/model-version"] == "1"  # the stable's
    assert (rollout.canary, rollout.previous, rollout.mode) == (True, "llm-predictor", "Standard")
    assert urls == [(NS, f"llm-{canary['name']}-predictor")]
    assert rollout.endpoint.url == f"http://llm-{canary['name']}-predictor.default.test"
    assert fake_k8s.deleted == []


def test_the_mode_comes_from_status_annotation_then_kserves_configmap() -> None:
    """utils.go GetDeploymentMode's order; the default from kserve/inferenceservice-config."""
    from fakes.k8s_schemas import crds_dir
    from kubellm.backends.kubernetes.inferenceservice import recorded_mode

    assert recorded_mode({"status": {"deploymentMode": "RawDeployment"}}) == "Standard"
    annotated = {"metadata": {"annotations": {"serving.kserve.io/deploymentMode": "Serverless"}}}
    assert recorded_mode(annotated) == "Knative"
    assert recorded_mode({"metadata": {"annotations": {"x": "y"}}}) == ""
    with FakeK8s(crds_dir(), rbac=None) as fake:
        srv = server(fake)
        assert srv._mode({}) == ""  # no ConfigMap: unknown, said
        deploy = '{"defaultDeploymentMode": "RawDeployment"}'
        fake.config_maps[("kserve", "inferenceservice-config")] = {"deploy": deploy}
        assert srv._mode({}) == "Standard"
        assert srv._mode(annotated) == "Knative"


# ---------------------------------------------------------------- promote


def test_promote_removes_the_canary_share_and_waits_for_the_rollout(fake_k8s: FakeK8s) -> None:
    stored(fake_k8s, CANARY)
    fake_k8s.script_status("inferenceservices", "llm", [CANARY, CANARY, PROMOTED], namespace=NS)

    endpoint = server(fake_k8s).promote("llm", NS)

    assert endpoint.url == ADDRESS and endpoint.name == "llm"
    (update,) = puts(fake_k8s)
    # KServe's promotion: no canaryTrafficPercent, all traffic to the latest ready revision
    assert percent_sent(update) == "absent"
    assert fake_k8s.deleted == []


def test_promote_refuses_a_revision_that_is_not_ready(fake_k8s: FakeK8s) -> None:
    stored(fake_k8s, CANARY_FAILED)

    with pytest.raises(JobFailed, match=r"llm-predictor-00002 is not ready, nothing to promote"):
        server(fake_k8s).promote("llm", NS)

    assert puts(fake_k8s) == []


# ---------------------------------------------------------------- rollback


@dataclass
class RollbackCase:
    name: str
    status: dict[str, Any] | None  # None: no InferenceService
    run_tag: str
    then: list[dict[str, Any]] = field(default_factory=list)  # statuses after the update
    percents: list[Any] = field(default_factory=list)  # canaryTrafficPercent sent
    deleted: bool = False
    says: str = ""


ROLLBACK_CASES = [
    RollbackCase(
        "canary-back-to-previous",
        CANARY,
        "run-1",
        [CANARY, CANARY, ROLLED_BACK],
        [0],
        says=f"traffic back on revision {REV1} (revision {REV2} gets 0%)",
    ),
    RollbackCase(
        "canary-any-run",
        CANARY,
        "",
        [CANARY, CANARY, ROLLED_BACK],
        [0],
        says=f"traffic back on revision {REV1}",
    ),
    # promoted already: PropagateStatus moves latestRolledoutRevision back to the previous
    RollbackCase(
        "promoted-back-to-previous",
        PROMOTED,
        "run-1",
        [PROMOTED, PROMOTED, ROLLED_BACK],
        [0],
        says=f"traffic back on revision {REV1}",
    ),
    RollbackCase("canary-of-another-run-kept", CANARY, "run-2", says="kept as it is: run 'run-1'"),
    RollbackCase("first-deploy-removed", SERVING, "run-1", deleted=True, says="removed: its first"),
    RollbackCase(
        "first-deploy-of-another-run-kept", SERVING, "run-2", says="kept as it is: run 'run-1'"
    ),
    RollbackCase("not-there", None, "run-1", says="not found: nothing to roll back"),
]


@pytest.mark.parametrize("case", ROLLBACK_CASES, ids=lambda c: c.name)
def test_rollback_never_deletes_while_a_previous_revision_serves(
    case: RollbackCase, fake_k8s: FakeK8s
) -> None:
    if case.status is not None:
        stored(fake_k8s, case.status)
    if case.then:
        fake_k8s.script_status("inferenceservices", "llm", case.then, namespace=NS)

    said = server(fake_k8s).rollback("llm", case.run_tag, NS)  # a fresh server: another step

    assert case.says in said
    assert [percent_sent(b) for b in puts(fake_k8s)] == case.percents
    gone = ("inferenceservices", NS, "llm") in fake_k8s.deleted
    assert gone is case.deleted
    assert fake_k8s.errors == []


# ---------------------------------------------------------------- addresses and delete


@dataclass
class TagCase:
    name: str
    address: str
    cluster_local: bool
    url: str


TAG_CASES = [
    TagCase(
        "service-name",
        PREDICTOR_ADDRESS,
        True,
        "http://latest-llm-predictor.default.svc.cluster.local",
    ),
    TagCase(
        "custom-cluster-domain",
        "http://llm-predictor.ns.svc.corp:8012",
        True,
        "http://latest-llm-predictor.ns.svc.corp:8012",
    ),
    TagCase("ingress", PREDICTOR_ADDRESS, False, "http://latest-llm-predictor.default.example.com"),
    # an address that is no Service name (the simulated cluster's 127.0.0.1): the tag's URL
    TagCase(
        "ip-address",
        "http://127.0.0.1:4711",
        True,
        "http://latest-llm-predictor.default.example.com",
    ),
]


@pytest.mark.parametrize("case", TAG_CASES, ids=lambda c: c.name)
def test_the_address_of_a_tagged_revision(case: TagCase) -> None:
    obj = {"status": copy.deepcopy(CANARY)}
    obj["status"]["components"]["predictor"]["address"] = {"url": case.address}
    assert tag_url(obj, "latest", case.cluster_local) == case.url


@dataclass
class DeleteCase:
    name: str
    run_tag: str
    deleted: bool


@pytest.mark.parametrize(
    "case",
    [
        DeleteCase("any-run", "", True),
        DeleteCase("owner-run", "run-1", True),
        DeleteCase("other-run", "run-2", False),
    ],
    ids=lambda c: c.name,
)
def test_delete_only_what_the_run_owns(case: DeleteCase, fake_k8s: FakeK8s) -> None:
    fake_k8s.script_status("inferenceservices", "llm", [SERVING], namespace=NS)
    server(fake_k8s).deploy(request(run_tag="run-1"))

    server(fake_k8s).delete("llm", run_tag=case.run_tag)  # a fresh server: cleanup step

    gone = fake_k8s.get_object("inferenceservices", "llm") is None
    assert gone is case.deleted


def test_delete_of_a_missing_service_is_a_no_op(fake_k8s: FakeK8s) -> None:
    srv = server(fake_k8s, namespace="team-a")
    srv.delete("nothing-here")
    srv.delete("nothing-here", run_tag="run-1")
    assert any(
        "/namespaces/team-a/inferenceservices/nothing-here" in r.path for r in fake_k8s.requests
    )


def standard_with_canary(fake: FakeK8s) -> tuple[dict[str, Any], str]:
    """llm serving version 1 in Standard mode, version 2 of run-2 as a ready spec.canary."""
    from kubellm.backends.kubernetes.inferenceservice import standard_canary

    current = stored(fake, standard())
    new = request(model_uri="pvc://kubellm-workspace/serve/v2", version="2", run_tag="run-2")
    entry = standard_canary(new, build_inferenceservice(new), current)
    current["spec"]["canary"] = [entry]
    current["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] = "Standard"
    fake.put_object("inferenceservices", current)
    name = entry["predictor"]["name"]
    fake.set_status("inferenceservices", "llm", standard(canary=(name, True)), namespace=NS)
    return current, name


def test_a_standard_promotion_moves_the_canary_into_the_predictor(fake_k8s: FakeK8s) -> None:
    """KServe's promotion without restart: predictor.name set to the canary's, the entry
    removed (inference_service.go InferenceServiceSpec.Canary)."""
    _, name = standard_with_canary(fake_k8s)
    with_canary = standard(canary=(name, True))
    fake_k8s.script_status(
        "inferenceservices", "llm", [with_canary, with_canary, standard()], namespace=NS
    )

    endpoint = server(fake_k8s).promote("llm", NS)

    (update,) = puts(fake_k8s)
    assert "canary" not in update["spec"]
    predictor = update["spec"]["predictor"]
    assert predictor["name"] == name and "name" not in predictor["model"]
    assert predictor["model"]["storageUri"].endswith("/serve/v2")
    assert (predictor["minReplicas"], predictor["maxReplicas"]) == (1, 1)  # the stable's
    assert predictor["annotations"]["kubellm/run-tag"] == "run-2"
    assert endpoint.url == ADDRESS and fake_k8s.deleted == []


@pytest.mark.parametrize("run_tag", ["run-2", "run-1"])
def test_a_standard_rollback_removes_only_its_own_canary(run_tag: str, fake_k8s: FakeK8s) -> None:
    _, name = standard_with_canary(fake_k8s)
    with_canary = standard(canary=(name, True))
    fake_k8s.script_status(
        "inferenceservices", "llm", [with_canary, with_canary, standard()], namespace=NS
    )

    said = server(fake_k8s).rollback("llm", run_tag, NS)

    if run_tag == "run-1":  # the stable's run, not the canary's: nothing changes
        assert "kept as it is: run 'run-2'" in said and puts(fake_k8s) == []
        return
    (update,) = puts(fake_k8s)
    assert "canary" not in update["spec"] and "llm-predictor serves all traffic" in said
    assert fake_k8s.deleted == []


def test_standard_mode_without_spec_canary_is_a_full_rollout(
    fake_k8s: FakeK8s, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KServe < 0.20: its CRD has no spec.canary, so the API server prunes the field from the
    update (fieldValidation's default, Warn) and returns the object without it. The new
    version then replaces the old in place, said, and a rollback puts the old one back."""
    from kubellm.backends.kubernetes import inferenceservice as isvc

    def pruned(obj: dict[str, Any], entry: dict[str, Any]) -> None:
        obj["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] = "Standard"

    monkeypatch.setattr(isvc, "_put_canary", pruned)
    fake = fake_k8s
    stored(fake, standard())
    predictor_pod(fake, "llm-predictor-new", version="2")  # the rolled pods, ready
    fake.script_status(
        "inferenceservices",
        "llm",
        [standard(), standard(), standard(ready=False), standard()],
        namespace=NS,
    )
    v2 = request(model_uri="pvc://kubellm-workspace/serve/v2", version="2")

    rollout = server(fake).deploy(v2)

    assert (rollout.full_rollout, rollout.canary, rollout.previous) == (True, False, "1")
    update = puts(fake)[-1]
    assert "canary" not in update["spec"]
    assert update["spec"]["predictor"]["model"]["storageUri"].endswith("/serve/v2")
    previous = json.loads(update["metadata"]["annotations"]["kubellm/previous"])
    assert previous["predictor"]["model"]["storageUri"].endswith("/serve/v1")
    assert previous["annotations"]["kubellm/model-version"] == "1"

    fake.delete_object("pods", "llm-predictor-new", NS)  # the Deployment rolls back
    predictor_pod(fake, "llm-predictor-old", version="1")
    said = server(fake).rollback("llm", "run-1", NS)

    restored = puts(fake)[-1]
    assert restored["spec"]["predictor"]["model"]["storageUri"].endswith("/serve/v1")
    assert "kubellm/previous" not in restored["metadata"]["annotations"]
    assert "version 1 restored by a full rollout" in said
    assert ("inferenceservices", NS, "llm") not in fake.deleted and fake.errors == []
