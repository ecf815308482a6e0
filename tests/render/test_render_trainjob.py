"""`kubellm render --set trainer_backend=trainjob`: the train stage is a Trainer v2 TrainJob
and the ClusterTrainingRuntime it names, each strictly valid against the vendored
kubeflow/trainer v2.3.0 CRDs, for every option set test_render.py renders."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from test_render import OPTION_SETS

from fakes.k8s_schemas import crd_check, crds_dir, validators
from kubellm.cli import main
from kubellm.commands.render import objects
from kubellm.config import pipeline_config

TRAINER_V2 = {"trainer_backend": "trainjob"}
# Trainer v2.3's runtimePatches cannot set priorityClassName; Volcano needs a podGroupPolicy;
# an elastic job is a PyTorchJob's elasticPolicy (refused by the config).
UNSUPPORTED = {
    "kueue-placement": "priority_class",
    "volcano-grid": "volcano",
    "elastic": "elastic_min_nodes=1 needs trainer_backend=pytorchjob",
}
SUPPORTED = {k: v for k, v in OPTION_SETS.items() if k not in UNSUPPORTED}
SUPPORTED["kueue-placement-no-priority"] = {
    k: v for k, v in OPTION_SETS["kueue-placement"].items() if k != "priority_class"
}
SUPPORTED["fsdp-lora"] = {**OPTION_SETS["gpu-tcp"], "strategy": "fsdp", "lora_r": 8}


def _check(body: dict[str, Any]) -> list[str]:
    crd = {
        "TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
        "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    }[body["kind"]]
    return crd_check(crds_dir() / crd, "v1alpha1")(body)


@pytest.mark.parametrize("name", SUPPORTED)
def test_the_train_stage_is_a_trainjob_and_its_runtime(name: str) -> None:
    rendered = objects(pipeline_config({**SUPPORTED[name], **TRAINER_V2}))
    v2 = [(stage, b) for stage, b in rendered if b["apiVersion"].startswith("trainer.")]
    kinds = [(stage, b["kind"]) for stage, b in v2]
    assert kinds == [
        ("preflight", "ClusterTrainingRuntime"),
        ("preflight", "TrainJob"),  # the fabric check runs on the trainer backend
        ("train", "TrainJob"),
    ]
    runtime = v2[0][1]
    for stage, body in v2:
        assert _check(body) == [], (stage, body["kind"])
        if body["kind"] == "TrainJob":
            assert body["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    # Katib's trials stay PyTorchJobs, valid as before; no other PyTorchJob is left
    check = validators(crds_dir())
    rest = [(stage, b) for stage, b in rendered if not b["apiVersion"].startswith("trainer.")]
    assert "PyTorchJob" not in {b["kind"] for _, b in rest}
    plural = {"Experiment": "experiments", "InferenceService": "inferenceservices"}
    for stage, body in rest:
        assert check[plural[body["kind"]]](body) == [], stage


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_options_trainer_v2_cannot_carry_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=UNSUPPORTED[name]):
        objects(pipeline_config({**OPTION_SETS[name], **TRAINER_V2}))


def test_cli_prints_the_trainjob(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "--set", "trainer_backend=trainjob", "--run-id", "3f0c2a1e"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    kinds = [d["kind"] for d in docs]
    assert kinds == [
        "ClusterTrainingRuntime",
        "TrainJob",
        "Experiment",
        "TrainJob",
        "InferenceService",
    ]
    assert docs[3]["metadata"]["labels"]["kubellm.dev/run"] == "3f0c2a1e"
