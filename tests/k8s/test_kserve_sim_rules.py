"""Rules of the simulated KServe that no sim test pins (rows of tests/fakes/UPSTREAM.md): the
pure functions ported from kserve/kserve, checked without starting a cluster."""

from __future__ import annotations

from fakes.kserve_controller import (
    DISALLOWED_ANNOTATIONS,
    ksvc_traffic,
    merge_runtime_container,
    parse_deployment_mode,
    replace_placeholders,
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
