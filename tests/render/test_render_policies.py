"""The rendered pods against the cluster's policies: checkov, and Pod Security admission of
the namespace each manifests/ overlay creates.

checkov sees each pod template inside a PyTorchJob, Experiment or InferenceService as a Pod
(tests/manifests/checkov_check.py). The findings accepted for generated pods are listed in
ACCEPTED, each with the reason; anything else checkov reports fails the test.
"""

from __future__ import annotations

from typing import Any

import pytest
from manifests.checkov_check import checkov_failures
from manifests.psa import psa_violations

from kubellm.commands.render import objects, render
from kubellm.config import pipeline_config

GPU = {"gpus_per_node": 8, "nproc_per_node": 8, "batch_size": 64}
RDMA = {**GPU, "fabric": "rdma-ib"}

ACCEPTED = {
    "CKV_K8S_8": "training pods are batch jobs without a port to probe; KServe probes servers",
    "CKV_K8S_9": "training pods are batch jobs; KServe's queue-proxy decides server readiness",
    "CKV_K8S_15": "images are versioned releases; Always would re-pull multi-GB images per pod",
    "CKV_K8S_43": "images are parameters: pass image@sha256 digests to pin them per run",
    "CKV_K8S_35": "MLflow's client reads its credentials from environment variables only",
    "CKV2_K8S_6": "manifests/base NetworkPolicy kubellm-training selects training pods by label",
}
# Only where the run asks for RDMA: NCCL pins memory for the verbs transport.
ACCEPTED_RDMA = {**ACCEPTED, "CKV_K8S_25": "IPC_LOCK only with fabric rdma-ib or roce, for NCCL"}


@pytest.mark.parametrize(
    ("params", "accepted"), [({}, ACCEPTED), (RDMA, ACCEPTED_RDMA)], ids=["tcp", "rdma"]
)
def test_checkov_passes_with_justified_exceptions(
    params: dict[str, Any], accepted: dict[str, str]
) -> None:
    assert checkov_failures(render(params), "render", accepted) == []


def test_checkov_reports_ipc_lock_where_it_is_not_accepted() -> None:
    failures = checkov_failures(render(RDMA), "render", ACCEPTED)
    assert failures and all(f.startswith("CKV_K8S_25 ") for f in failures)


def training_pods(params: dict[str, Any]) -> list[dict[str, Any]]:
    pods = []
    for _, body in objects(pipeline_config(params)):
        spec = body["spec"]
        if body["kind"] == "Experiment":
            spec = spec["trialTemplate"]["trialSpec"]["spec"]
        for replica in (spec.get("pytorchReplicaSpecs") or {}).values():
            pods.append(replica["template"]["spec"])
    return pods


@pytest.mark.parametrize(
    ("params", "level"),
    [
        ({}, "restricted"),  # what base and single-node warn on; they enforce baseline
        (GPU, "restricted"),
        (RDMA, "privileged"),  # overlays/rdma enforces privileged for IPC_LOCK
    ],
)
def test_training_pods_meet_their_overlays_pod_security_level(
    params: dict[str, Any], level: str
) -> None:
    pods = training_pods(params)
    assert pods
    for pod in pods:
        assert psa_violations(pod, level) == []


def test_rdma_pods_are_refused_by_baseline() -> None:
    """Why the rdma overlay enforces privileged: baseline refuses IPC_LOCK."""
    for pod in training_pods(RDMA):
        assert any("IPC_LOCK" in v for v in psa_violations(pod, "baseline"))
