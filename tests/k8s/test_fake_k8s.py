"""The fake API server itself: it must reject what a real one rejects, or its passes are empty."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from fakes.fake_k8s import RESOURCES, FakeK8s, merge_patch, selector_matches
from kubellm.backends.base import ServeRequest, TrainJob, TuneRequest
from kubellm.backends.kubernetes.inferenceservice import build_inferenceservice
from kubellm.backends.kubernetes.katib import build_experiment
from kubellm.backends.kubernetes.pytorchjob import pytorchjob_manifest
from kubellm.tune.search import SearchParam

JOB = TrainJob(name="j", image="img", train_args=["--config", "c.json"], nnodes=2)


def valid_body(plural: str) -> dict[str, Any]:
    if plural == "pytorchjobs":
        return pytorchjob_manifest(JOB)
    if plural == "experiments":
        space = [SearchParam("lr", 0.001, 0.1)]
        return build_experiment(TuneRequest(name="e", trial_job=JOB, space=space, max_trials=2))
    return build_inferenceservice(ServeRequest(name="m", model_uri="pvc://ws/m", image="img"))


def master_container(body: dict[str, Any]) -> Any:
    """The master's container in `body` itself (cases mutate it in place)."""
    return body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def trial_spec(body: dict[str, Any]) -> Any:
    return body["spec"]["trialTemplate"]["trialSpec"]


@dataclass
class InvalidCase:
    name: str
    plural: str
    mutate: Callable[[dict[str, Any]], None]
    field: str  # the path the error must name


INVALID_CASES = [
    InvalidCase(
        "pytorchjob-unknown-spec-field",
        "pytorchjobs",
        lambda b: b["spec"].update(numNodes=2),
        "spec.numNodes",
    ),
    InvalidCase(
        "pytorchjob-unknown-container-field",
        "pytorchjobs",
        lambda b: master_container(b).update(gpus=1),
        "spec.pytorchReplicaSpecs.Master.template.spec.containers[0].gpus",
    ),
    InvalidCase(
        "pytorchjob-wrong-type",
        "pytorchjobs",
        lambda b: b["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas="one"),
        "spec.pytorchReplicaSpecs.Worker.replicas",
    ),
    InvalidCase(
        "pytorchjob-container-not-named-pytorch",
        "pytorchjobs",
        lambda b: master_container(b).update(name="trainer"),
        "spec.pytorchReplicaSpecs.Master.template.spec.containers",
    ),
    InvalidCase(
        "pytorchjob-unknown-metadata-field",
        "pytorchjobs",
        lambda b: b["metadata"].update(label={"a": "b"}),
        "metadata.label",
    ),
    InvalidCase(
        "isvc-storage-uri-on-predictor",  # not in this KServe's predictor schema
        "inferenceservices",
        lambda b: b["spec"]["predictor"].update(storageUri="s3://bucket/model"),
        "spec.predictor.storageUri",
    ),
    InvalidCase(
        "isvc-missing-predictor",
        "inferenceservices",
        lambda b: b["spec"].pop("predictor"),
        "spec",
    ),
    InvalidCase(
        "experiment-unknown-field",
        "experiments",
        lambda b: b["spec"].update(maxTrials=3),
        "spec.maxTrials",
    ),
    InvalidCase(
        "experiment-wrong-type",
        "experiments",
        lambda b: b["spec"].update(maxTrialCount="3"),
        "spec.maxTrialCount",
    ),
    InvalidCase(
        "experiment-parallel-above-max",
        "experiments",
        lambda b: b["spec"].update(parallelTrialCount=5),
        "spec.parallelTrialCount",
    ),
    InvalidCase(
        "experiment-trialspec-named",
        "experiments",
        lambda b: trial_spec(b).update(metadata={"name": "x"}),
        "spec.trialTemplate.trialSpec.metadata",
    ),
    InvalidCase(
        "experiment-trialspec-unknown-field",
        "experiments",
        lambda b: trial_spec(b)["spec"].update(replicas=2),
        "spec.trialTemplate.trialSpec.spec.replicas",
    ),
    InvalidCase(
        "experiment-undeclared-placeholder",
        "experiments",
        lambda b: b["spec"]["trialTemplate"]["trialParameters"].pop(),
        "spec.trialTemplate.trialSpec",
    ),
    InvalidCase(
        "experiment-wrong-primary-container",
        "experiments",
        lambda b: b["spec"]["trialTemplate"].update(primaryContainerName="training-container"),
        "spec.trialTemplate.primaryContainerName",
    ),
]


@pytest.mark.parametrize("case", INVALID_CASES, ids=lambda c: c.name)
def test_invalid_body_is_rejected_naming_the_field(case: InvalidCase, fake_k8s: FakeK8s) -> None:
    body = valid_body(case.plural)
    assert fake_k8s.validate(case.plural, body) == []
    case.mutate(body)
    kind = RESOURCES[case.plural]
    api = k8s.CustomObjectsApi(fake_k8s.api_client())

    with pytest.raises(ApiException) as info:
        api.create_namespaced_custom_object(kind.group, kind.version, "default", case.plural, body)

    assert info.value.status == 422
    status = json.loads(info.value.body)
    assert status["kind"] == "Status" and status["reason"] == "Invalid"
    assert case.field in status["message"]
    assert any(case.field in e for e in fake_k8s.errors), fake_k8s.errors
    assert fake_k8s.get_object(case.plural, body["metadata"]["name"]) is None


def test_scripted_status_is_checked_too(fake_k8s: FakeK8s) -> None:
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    api.create_namespaced_custom_object(
        "kubeflow.org", "v1", "default", "pytorchjobs", valid_body("pytorchjobs")
    )
    fake_k8s.set_status("pytorchjobs", "j", {"conditions": [{"type": "Running"}]})
    assert any("status" in e and "required" in e for e in fake_k8s.errors), fake_k8s.errors


def test_unknown_resource_and_object_are_404(fake_k8s: FakeK8s) -> None:
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    for group, version, plural in [
        ("kubeflow.org", "v1", "tfjobs"),
        ("kubeflow.org", "v1beta1", "pytorchjobs"),
    ]:
        with pytest.raises(ApiException) as info:
            api.get_namespaced_custom_object(group, version, "default", plural, "x")
        assert info.value.status == 404
    with pytest.raises(ApiException) as info:
        api.get_namespaced_custom_object("kubeflow.org", "v1", "default", "pytorchjobs", "x")
    assert info.value.status == 404


def test_replace_and_patch_keep_status_and_bump_generation(fake_k8s: FakeK8s) -> None:
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    args = ("serving.kserve.io", "v1beta1", "default", "inferenceservices")
    created = api.create_namespaced_custom_object(*args, valid_body("inferenceservices"))
    fake_k8s.set_status("inferenceservices", "m", {"url": "http://m", "observedGeneration": 1})

    changed = copy.deepcopy(created)
    changed["spec"]["predictor"]["minReplicas"] = 2
    replaced = api.replace_namespaced_custom_object(*args, "m", changed)
    assert replaced["metadata"]["generation"] == 2
    assert replaced["status"] == {"url": "http://m", "observedGeneration": 1}

    stale = copy.deepcopy(changed)  # carries the old resourceVersion
    with pytest.raises(ApiException) as info:
        api.replace_namespaced_custom_object(*args, "m", stale)
    assert info.value.status == 409

    patched = api.patch_namespaced_custom_object(
        *args, "m", {"metadata": {"labels": {"team": "a"}}}
    )
    assert patched["metadata"]["labels"]["team"] == "a"
    assert patched["metadata"]["generation"] == 2
    assert fake_k8s.errors == []


@dataclass
class SelectorCase:
    selector: str
    labels: dict[str, str]
    matches: bool


@pytest.mark.parametrize(
    "case",
    [
        SelectorCase("", {}, True),
        SelectorCase("a=1", {"a": "1"}, True),
        SelectorCase("a==1,b=2", {"a": "1", "b": "2"}, True),
        SelectorCase("a=1,b=2", {"a": "1"}, False),
        SelectorCase("a!=1", {"a": "2"}, True),
        SelectorCase("a!=1", {"a": "1"}, False),
        SelectorCase("a", {"a": ""}, True),
        SelectorCase("!a", {"a": ""}, False),
    ],
    ids=lambda c: f"{c.selector or 'empty'}->{c.matches}",
)
def test_label_selectors(case: SelectorCase) -> None:
    assert selector_matches(case.selector, case.labels) is case.matches


def test_merge_patch_follows_rfc7386() -> None:
    target = {"a": {"b": 1, "c": 2}, "d": [1]}
    assert merge_patch(target, {"a": {"b": None, "e": 3}, "d": [2]}) == {
        "a": {"c": 2, "e": 3},
        "d": [2],
    }
