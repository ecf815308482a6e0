"""`kubellm render`: what a cluster run creates, checked the way the cluster would.

Each object is validated strictly against the vendored upstream schemas (PyTorchJob CRD,
Katib's OpenAPI spec, KServe's CRD) and the controllers' webhook rules, and every pod
template against Kubernetes' own PodTemplate schema (kubernetes-validate, strict).
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from fakes.k8s_schemas import crds_dir, validators
from kubellm.cli import main
from kubellm.commands.render import objects
from kubellm.config import pipeline_config

KUBERNETES_VERSION = "1.30"
PLURALS = {
    "PyTorchJob": "pytorchjobs",
    "Experiment": "experiments",
    "InferenceService": "inferenceservices",
}

GPU = {"gpus_per_node": 8, "nproc_per_node": 8, "num_nodes": 2, "batch_size": 64}
OPTION_SETS = {
    "defaults": {},
    "gpu-tcp": GPU,
    "rdma-ib": {**GPU, "fabric": "rdma-ib", "rdma_resource": "rdma/ib", "min_busbw_gbps": 150},
    "roce-multus": {**GPU, "fabric": "roce", "network_annotation": "roce-net", "rdma_count": 2},
    "kueue-placement": {
        **GPU,
        "queue": "team-a",
        "node_selector": {"nvidia.com/gpu.product": "H100"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priority_class": "high",
    },
    "volcano-grid": {**GPU, "queue": "q", "gang_scheduler": "volcano", "tune_algorithm": "grid"},
    "no-tuning-long-name": {"tune_trials": 0, "model_name": "x" * 45},
    # elasticPolicy: Workers only, c10d, min 1 and max num_nodes (the webhook's rules too)
    "elastic": {**GPU, "elastic_min_nodes": 1, "elastic_max_restarts": 2},
}


def pod_templates(body: dict[str, Any]) -> list[dict[str, Any]]:
    spec = body["spec"]
    if body["kind"] == "Experiment":
        spec = spec["trialTemplate"]["trialSpec"]["spec"]
    if "pytorchReplicaSpecs" in spec:
        return [r["template"] for r in spec["pytorchReplicaSpecs"].values()]
    return []


@pytest.mark.parametrize("name", OPTION_SETS)
def test_every_rendered_object_validates(name: str) -> None:
    import kubernetes_validate

    check = validators(crds_dir())
    rendered = objects(pipeline_config(OPTION_SETS[name]))
    stages = [stage for stage, _ in rendered]
    expected = ["preflight", "train", "deploy"]
    if OPTION_SETS[name].get("tune_trials", 1):
        expected.insert(1, "tune")
    assert stages == expected
    for stage, body in rendered:
        assert check[PLURALS[body["kind"]]](body) == [], (stage, body["kind"])
        for template in pod_templates(body):
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
            kubernetes_validate.validate(
                {**pod_template, "template": template}, KUBERNETES_VERSION, strict=True
            )


def test_rdma_profile_reaches_every_training_pod() -> None:
    rendered = objects(pipeline_config(OPTION_SETS["rdma-ib"]))
    templates = [t for _, body in rendered for t in pod_templates(body)]
    assert len(templates) == 6  # fabric, tune trial, train: Master and Worker each
    for template in templates:
        (container,) = template["spec"]["containers"]
        assert container["resources"]["limits"]["rdma/ib"] == "1"
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    fabric = rendered[0][1]
    (container,) = pod_templates(fabric)[0]["spec"]["containers"]
    assert container["args"][-3:] == ["--require-rdma", "--min-busbw-gbps", "150"]


def test_cli_prints_a_yaml_stream(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "--set", "tune_trials=2", "--run-id", "3f0c2a1e-77b1"]) == 0
    out = capsys.readouterr().out
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == [
        "PyTorchJob",
        "Experiment",
        "PyTorchJob",
        "InferenceService",
    ]
    assert out.startswith("# preflight: PyTorchJob kubellm-tiny-fabric-3f0c2a1e-77b")
    assert docs[2]["metadata"]["labels"]["kubellm.dev/run"] == "3f0c2a1e-77b1"


def test_cli_rejects_a_bad_parameter(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "--set", "model_name=7b"]) == 2
    assert "model_name" in capsys.readouterr().err
