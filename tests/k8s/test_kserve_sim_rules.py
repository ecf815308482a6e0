"""Rules of the simulated KServe that no sim test pins (rows of tests/fakes/UPSTREAM.md): the
pure functions ported from kserve/kserve, checked without starting a cluster."""

from __future__ import annotations

from typing import Any

from fakes.kserve_controller import (
    DISALLOWED_ANNOTATIONS,
    knative_disallowed,
    ksvc_traffic,
    merge_runtime_container,
    parse_deployment_mode,
    replace_placeholders,
    runtime_container_error,
    sort_supported_runtimes,
)


def test_deployment_modes_are_normalized() -> None:
    # constants.go ParseDeploymentMode
    assert parse_deployment_mode("Serverless") == "Knative"
    assert parse_deployment_mode("RawDeployment") == "Standard"
    assert parse_deployment_mode("") == "Standard"
    assert parse_deployment_mode("Knative") == "Knative"


def test_knative_traffic_targets() -> None:
    # ksvc_reconciler.go createKnativeService
    assert ksvc_traffic(10, "m-predictor-00001", True) == [
        {"tag": "latest", "latestRevision": True, "percent": 10},
        {
            "revisionName": "m-predictor-00001",
            "latestRevision": False,
            "percent": 90,
            "tag": "prev",
        },
    ]
    assert ksvc_traffic(100, "m-predictor-00001", False) == [
        {"latestRevision": True, "percent": 100}
    ]
    # no rolled-out revision yet: the canary percent is ignored
    assert ksvc_traffic(10, "", True) == [{"tag": "latest", "latestRevision": True, "percent": 100}]


def test_runtime_container_merge_and_placeholders() -> None:
    runtime = {
        "name": "kserve-container",
        "image": "kserve/huggingfaceserver:latest",
        "args": ["--model_name={{.Name}}"],
        "env": [{"name": "A", "value": "1"}],
    }
    model = {"args": ["--backend=huggingface"], "env": [{"name": "A", "value": "2"}]}
    merged = merge_runtime_container(runtime, {**model, "storageUri": "pvc://c/m"})
    assert merged["args"] == ["--model_name={{.Name}}", "--backend=huggingface"]  # appended
    assert merged["env"] == [{"name": "A", "value": "2"}] and "storageUri" not in merged
    assert replace_placeholders(merged, {"name": "llm"})["args"][0] == "--model_name=llm"


def test_the_disallowed_annotations_are_kserves() -> None:
    # constants.go ServiceAnnotationDisallowedList (ModelFormatAnnotationKey: see below)
    assert {
        "autoscaling.knative.dev/min-scale",
        "autoscaling.knative.dev/max-scale",
        "internal.serving.kserve.io/storage-initializer-sourceuri",
        "kubectl.kubernetes.io/last-applied-configuration",
    } <= set(DISALLOWED_ANNOTATIONS)


def test_the_model_format_annotation_key_is_kserves() -> None:
    assert "modelFormat" in DISALLOWED_ANNOTATIONS


def _runtime(
    name: str, created: str, protocols: list[str] | None = None, priority: int | None = None
) -> dict[str, Any]:
    fmt: dict[str, Any] = {"name": "huggingface", "autoSelect": True}
    if priority is not None:
        fmt["priority"] = priority
    spec: dict[str, Any] = {"supportedModelFormats": [fmt]}
    if protocols is not None:
        spec["protocolVersions"] = protocols
    return {"metadata": {"name": name, "creationTimestamp": created}, "spec": spec}


def test_supporting_runtimes_are_ordered_as_kserve_orders_them() -> None:
    # predictor_model.go sortServingRuntimeList, then sortSupportedRuntimeByPriority
    old, new = "2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z"
    runtimes = [
        _runtime("b", old, ["v1"]),
        _runtime("a", old, ["v1"]),
        _runtime("newer", new, ["v1"]),
        _runtime("v2-only", new, ["v2"]),
        _runtime("no-protocols", new),  # GetProtocolVersionPriority: Unknown, last
        _runtime("unknown-protocol", new, ["custom"]),
    ]
    order = [r["metadata"]["name"] for r in sort_supported_runtimes(runtimes, "huggingface")]
    assert order == ["newer", "a", "b", "v2-only", "no-protocols", "unknown-protocol"]
    # a priority for the model's format goes first, the higher one first; ties keep the order
    runtimes += [_runtime("p1", old, ["v2"], 1), _runtime("p5", old, ["grpc-v2"], 5)]
    runtimes += [_runtime("p1-newer", new, ["v2"], 1)]
    order = [r["metadata"]["name"] for r in sort_supported_runtimes(runtimes, "huggingface")]
    assert order[:3] == ["p5", "p1-newer", "p1"]
    assert order[3:] == ["newer", "a", "b", "v2-only", "no-protocols", "unknown-protocol"]
    # the priority is that of the first format of the model's name (GetPriority)
    twice = _runtime("twice", old, ["v1"])
    twice["spec"]["supportedModelFormats"].append({"name": "huggingface", "priority": 9})
    assert (
        sort_supported_runtimes([_runtime("p1", old, ["v1"], 1), twice], "huggingface")[0][
            "metadata"
        ]["name"]
        == "p1"
    )


def test_a_runtime_without_kserves_container_is_an_invalid_predictor_spec() -> None:
    # predictor.go buildPodSpec, utils.go MergeServingRuntimeAndInferenceServiceSpecs
    assert runtime_container_error({"containers": []}) == (
        "no container configuration found in selected serving runtime"
    )
    assert runtime_container_error({"containers": [{"name": "server", "image": "x"}]}) == (
        "failed to find kserve-container in ServingRuntime containers"
    )
    assert runtime_container_error({"containers": [{"name": "kserve-container"}]}) is None


def test_knatives_field_masks_under_default_flags() -> None:
    # fieldmask.go PodSpecMask / PodSecurityContextMask / SecurityContextMask at knative-v1.21.1
    pod = {
        "containers": [
            {
                "name": "kserve-container",
                "image": "x",
                "securityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": 1000,
                    "allowPrivilegeEscalation": False,
                    "privileged": False,
                    "capabilities": {"drop": ["ALL"]},
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
            }
        ],
        "volumes": [{"name": "scratch", "emptyDir": {}}],
        "automountServiceAccountToken": False,
        "hostIPC": False,
    }
    assert knative_disallowed(pod) == []
    pod["securityContext"] = {"runAsUser": 1000, "fsGroupChangePolicy": "OnRootMismatch"}
    pod["nodeSelector"] = {"gpu": "a100"}
    pod["containers"][0]["securityContext"]["capabilities"]["add"] = ["NET_ADMIN"]
    assert knative_disallowed(pod) == [
        "spec.template.spec.nodeSelector",
        "spec.template.spec.securityContext",
        "spec.template.spec.securityContext.runAsUser",
        "spec.template.spec.securityContext.fsGroupChangePolicy",
        "spec.template.spec.containers[0].securityContext.capabilities.add",
    ]
