"""checkov_check: it finds what checkov finds, honours skips and allowlists, looks inside
custom resources, and never reports a scan that checked nothing as a pass."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from .checkov_check import (
    allowlist_problems,
    checkov_available,
    checkov_failures,
    pods_from_custom_resources,
)

SECURE_CONTAINER: dict[str, Any] = {
    "name": "main",
    "image": "ghcr.io/kubellm/trainer:0.1.0",
    "securityContext": {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    },
    "resources": {
        "requests": {"cpu": "1", "memory": "1Gi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    },
}
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _template(**container_changes: Any) -> dict[str, Any]:
    container = {**copy.deepcopy(SECURE_CONTAINER), **container_changes}
    return {
        "metadata": {"labels": {"app": "x"}},
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": dict(POD_SECURITY),
            "containers": [container],
        },
    }


def pytorchjob(name: str, **container_changes: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": "kubellm"},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": {"replicas": 1, "template": _template(**container_changes)},
                "Worker": {"replicas": 1, "template": _template(**container_changes)},
            }
        },
    }


def experiment(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "kubeflow.org/v1beta1",
        "kind": "Experiment",
        "metadata": {"name": name, "namespace": "kubellm"},
        "spec": {"trialTemplate": {"trialSpec": pytorchjob("trial")}},
    }


def inferenceservice(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "kubellm"},
        "spec": {"predictor": {"minReplicas": 1, **_template()["spec"]}},
    }


def dump(*docs: dict[str, Any]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


# --------------------------------------------------------------------------- without checkov


def test_pod_templates_of_custom_resources_become_pods() -> None:
    pods = pods_from_custom_resources(
        [pytorchjob("j"), experiment("e"), inferenceservice("s"), {"apiVersion": "v1"}]
    )
    assert [p["metadata"]["name"] for p in pods] == [
        "PyTorchJob/j:spec.pytorchReplicaSpecs.Master.template",
        "PyTorchJob/j:spec.pytorchReplicaSpecs.Worker.template",
        "Experiment/e:spec.trialTemplate.trialSpec.spec.pytorchReplicaSpecs.Master.template",
        "Experiment/e:spec.trialTemplate.trialSpec.spec.pytorchReplicaSpecs.Worker.template",
        "InferenceService/s:spec.predictor",
    ]
    for pod in pods:
        assert pod["kind"] == "Pod" and pod["metadata"]["namespace"] == "kubellm"
        assert pod["spec"]["containers"][0]["name"] == "main"
    assert pods[0]["metadata"]["labels"] == {"app": "x"}, "template metadata is kept"


def test_built_in_kinds_are_left_to_checkov() -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {"template": _template()},
    }
    assert pods_from_custom_resources([deployment]) == []


@pytest.mark.parametrize(
    "allowlist",
    [
        {"CKV_K8S_8": ""},
        {"CKV_K8S_8": "batch"},
        {"K8S_8": "training pods are batch jobs: nothing to probe"},
        {"ckv_k8s_8": "training pods are batch jobs: nothing to probe"},
    ],
)
def test_allowlist_entries_need_an_id_and_a_reason(allowlist: dict[str, str]) -> None:
    assert allowlist_problems(allowlist)
    with pytest.raises(ValueError, match="bad checkov allowlist"):
        checkov_failures("", "x", accepted=allowlist)


def test_a_good_allowlist() -> None:
    assert allowlist_problems({"CKV2_K8S_6": "no NetworkPolicy: the job talks to nothing"}) == []


# --------------------------------------------------------------------------- with checkov


def test_checkov_is_installed() -> None:
    assert checkov_available(), "checkov is missing: run `make checkov` (make test does)"


def test_findings_skips_and_allowlist() -> None:
    bad = pytorchjob("bad", image="ghcr.io/kubellm/trainer:latest")
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
        "securityContext"
    ]["privileged"] = True
    skipped = pytorchjob("skipped")
    skipped["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["annotations"] = {
        "checkov.io/skip1": "CKV_K8S_8=batch pods have nothing to probe"
    }
    failures = checkov_failures(dump(bad, skipped), "findings")
    master = "Pod.kubellm.PyTorchJob/bad:spec.pytorchReplicaSpecs.Master.template"
    assert any(f.startswith(f"CKV_K8S_14 on {master}") for f in failures), failures  # :latest
    assert any(f.startswith(f"CKV_K8S_16 on {master}") for f in failures), failures  # privileged
    skipped_master = "PyTorchJob/skipped:spec.pytorchReplicaSpecs.Master.template"
    skipped_worker = "PyTorchJob/skipped:spec.pytorchReplicaSpecs.Worker.template"
    assert not [f for f in failures if f.startswith("CKV_K8S_8 ") and skipped_master in f]
    assert [f for f in failures if f.startswith("CKV_K8S_8 ") and skipped_worker in f]

    accepted = {"CKV_K8S_14": "a test of the allowlist: latest is what it allows here"}
    allowed = checkov_failures(dump(bad, skipped), "findings", accepted=accepted)
    assert not [f for f in allowed if f.startswith("CKV_K8S_14 ")]
    assert set(allowed) == {f for f in failures if not f.startswith("CKV_K8S_14 ")}


def test_a_scan_that_checks_nothing_fails() -> None:
    crd_without_pods = {
        "apiVersion": "kubeflow.org/v1beta1",
        "kind": "Suggestion",
        "metadata": {"name": "s", "namespace": "kubellm"},
        "spec": {"algorithm": {"algorithmName": "tpe"}},
    }
    (failure,) = checkov_failures(dump(crd_without_pods), "nothing")
    assert "recognised no resource" in failure
    (failure,) = checkov_failures("", "empty")
    assert "no Kubernetes object" in failure
