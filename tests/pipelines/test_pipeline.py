"""The compiled pipeline: fresh, parameters = PipelineConfig, the DAG of DESIGN.md."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubellm.cli import compile_pipelines
from kubellm.config import PipelineConfig

REPO = Path(__file__).resolve().parents[2]
YAML = REPO / "pipelines" / "llm_train.yaml"
KFP_TYPES = {int: "NUMBER_INTEGER", float: "NUMBER_DOUBLE", str: "STRING", bool: "BOOLEAN"}
# Cluster values a platform team changes per cluster: each must reach the steps only as a
# pipeline parameter, never as a constant compiled into the YAML.
CLUSTER_PARAMETERS = (
    "workspace_pvc",
    "runtime_image",
    "trainer_image",
    "serving_image",
    "namespace",
)


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    # two documents: the pipeline spec, then the Kubernetes platform spec (kfp-kubernetes)
    pipeline, platform = yaml.safe_load_all(YAML.read_text())
    return {**pipeline, "platforms": platform["platforms"]}


def test_committed_yaml_is_fresh(tmp_path: Path) -> None:
    [fresh] = compile_pipelines(REPO / "pipelines", tmp_path)
    assert fresh.read_text() == YAML.read_text(), (
        "pipelines/llm_train.yaml is stale: run `kubellm compile` and commit it"
    )


def test_parameters_are_the_config_fields(spec: dict[str, Any]) -> None:
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert set(params) == set(PipelineConfig.model_fields)
    for name, field in PipelineConfig.model_fields.items():
        declared = params[name]
        origin = typing.get_origin(field.annotation) or field.annotation
        kinds = {**KFP_TYPES, dict: "STRUCT", list: "LIST"}
        assert declared["parameterType"] == kinds.get(origin, "STRING"), name
        assert declared["defaultValue"] == field.get_default(call_default_factory=True), name
        assert declared.get("description"), f"{name} has no description in the YAML"
    assert params["platform"]["defaultValue"] == "kubernetes"


def test_no_secret_is_a_parameter(spec: dict[str, Any]) -> None:
    for name in spec["root"]["inputDefinitions"]["parameters"]:
        words = set(name.split("_"))
        assert not words & {"password", "token", "secret", "key", "credentials"}, name


def _tasks(spec: dict[str, Any], component: str) -> dict[str, Any]:
    return dict(spec["components"][component]["dag"]["tasks"])


def test_dag_shape(spec: dict[str, Any]) -> None:
    root = spec["root"]["dag"]["tasks"]
    assert root["summarize"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    body = _tasks(spec, "comp-exit-handler-1")
    assert {"preflight", "prepare-data", "record-data"} <= set(body)
    assert set(body["record-data"]["dependentTasks"]) == {"preflight", "prepare-data"}
    # nothing new since the champion: the run stops after record_data
    changed = next(t for t in body.values() if t.get("taskInfo", {}).get("name") == "data-changed")
    assert "== 'changed'" in changed["triggerPolicy"]["condition"]
    assert "record-data" in changed["dependentTasks"]
    trained = _tasks(spec, changed["componentRef"]["name"])
    assert {"tune", "train", "evaluate"} <= set(trained)
    gate = next(t for t in trained.values() if t.get("taskInfo", {}).get("name") == "gate")
    assert "== 'promote'" in gate["triggerPolicy"]["condition"]
    inside = _tasks(spec, gate["componentRef"]["name"])
    assert set(inside) == {"register", "deploy", "smoke-test"}
    assert inside["deploy"]["dependentTasks"] == ["register"]
    assert "deploy" in inside["smoke-test"]["dependentTasks"]


def test_steps_that_change_the_world_never_come_from_the_cache(spec: dict[str, Any]) -> None:
    """KFP reuses a cached task's outputs instead of running it: for register, deploy, the
    smoke test and the summary that would report work that did not happen."""
    tasks = {**spec["root"]["dag"]["tasks"]}
    for comp in spec["components"].values():
        tasks.update(comp.get("dag", {}).get("tasks", {}))
    cached = {name for name, t in tasks.items() if t.get("cachingOptions", {}).get("enableCache")}
    assert not cached & {"register", "deploy", "smoke-test", "summarize", "record-data"}, cached
    assert {"prepare-data", "train"} <= cached  # a retried run reuses what it finished


def test_prepare_data_is_cached_by_its_data_alone(spec: dict[str, Any]) -> None:
    """KFP's cache key is a task's input values, output specs, image and command
    (api/v2alpha1/cache_key.proto in kubeflow/pipelines). prepare_data's one input is
    preflight's data_spec (stages/test_prepare_data.py: it holds the data parameters and
    source file versions, nothing run-specific), so a rerun on the same data reuses the
    dataset; record_data, which writes the lineage, takes the run ids and never caches."""
    task = _tasks(spec, "comp-exit-handler-1")["prepare-data"]
    inputs = spec["components"]["comp-prepare-data"]["inputDefinitions"]
    assert set(inputs["parameters"]) == {"data_spec"}
    assert "artifacts" not in inputs
    fed = task["inputs"]["parameters"]["data_spec"]["taskOutputParameter"]
    assert fed == {"outputParameterKey": "data_spec", "producerTask": "preflight"}
    assert task["cachingOptions"]["enableCache"] is True


@pytest.mark.parametrize(
    ("component", "output", "schema"),
    [
        ("comp-prepare-data", "dataset", "system.Dataset"),
        ("comp-prepare-data", "stats", "system.Metrics"),
        ("comp-prepare-data", "report", "system.Markdown"),
        ("comp-train", "model", "system.Model"),
        ("comp-evaluate", "metrics", "system.Metrics"),
        ("comp-evaluate", "report", "system.Markdown"),
        ("comp-evaluate", "html_report", "system.HTML"),
        ("comp-smoke-test", "report", "system.Markdown"),
        ("comp-summarize", "report", "system.Markdown"),
    ],
)
def test_typed_artifacts(spec: dict[str, Any], component: str, output: str, schema: str) -> None:
    artifacts = spec["components"][component]["outputDefinitions"]["artifacts"]
    assert artifacts[output]["artifactType"]["schemaTitle"] == schema


def test_steps_run_in_the_runtime_image_without_pip(spec: dict[str, Any]) -> None:
    default = spec["root"]["inputDefinitions"]["parameters"]["runtime_image"]["defaultValue"]
    assert default.startswith("ghcr.io/kubellm/runtime:")
    for name, executor in spec["deploymentSpec"]["executors"].items():
        container = executor["container"]
        # the runtime_image parameter, resolved per run (PipelineTask.set_container_image)
        assert container["image"] == "{{$.inputs.parameters['pipelinechannel--runtime_image']}}"
        assert "pip install" not in " ".join(container["command"]), name
        # the steps that load the model have their own size; the rest share step_*
        step = next((s for s in ("evaluate", "register") if name == f"exec-{s}"), "step")
        resources = container["resources"]
        assert resources["resourceCpuLimit"].endswith(f"['pipelinechannel--{step}_cpu']}}}}"), name
        assert resources["resourceMemoryLimit"].endswith(f"['pipelinechannel--{step}_memory']}}}}")
        gpus = resources.get("accelerator", {}).get("resourceCount", "")
        assert gpus == (
            "{{$.inputs.parameters['pipelinechannel--evaluate_gpus']}}"
            if step == "evaluate"
            else ""
        ), name


def test_cluster_wiring_uses_kubernetes_objects_not_parameters(spec: dict[str, Any]) -> None:
    executors = spec["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    train = executors["exec-train"]
    assert train["pvcMount"][0]["mountPath"] == "/workspace"
    assert train["pvcMount"][0]["pvcNameParameter"] == {
        "componentInputParameter": "pipelinechannel--workspace_pvc"
    }
    (config,) = train["configMapAsEnv"]
    assert config["configMapName"] == "kubellm-config" and config["optional"] is True
    assert train["secretAsEnv"][0]["secretName"] == "mlflow-credentials"
    assert train["secretAsEnv"][0].get("optional") is True
    owner = {e["name"]: e["fieldPath"] for e in train["fieldPathAsEnv"]}
    assert owner == {
        "KUBELLM_POD_NAME": "metadata.name",
        "KUBELLM_POD_UID": "metadata.uid",
        "KUBELLM_POD_NAMESPACE": "metadata.namespace",
    }
    for name, executor in executors.items():
        assert executor["securityContext"]["runAsNonRoot"] is True, name


def _strings(node: Any, skip: frozenset[str] = frozenset({"inputDefinitions"})) -> list[str]:
    if isinstance(node, dict):
        return [s for k, v in node.items() if k not in skip for s in _strings(v, skip)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v, skip)]
    return [node] if isinstance(node, str) else []


def test_every_cluster_value_is_a_parameter(spec: dict[str, Any]) -> None:
    params = spec["root"]["inputDefinitions"]["parameters"]
    compiled = _strings(spec)  # everything except the parameters' own declarations
    for name in CLUSTER_PARAMETERS:
        default = params[name]["defaultValue"]
        assert default not in compiled, f"{name}'s value {default!r} is compiled into the YAML"
    assert not any(s.startswith("ghcr.io/") for s in compiled), "an image is compiled in"


def test_the_cluster_value_check_catches_a_constant(spec: dict[str, Any]) -> None:
    broken = {**spec, "extra": {"pvcMount": [{"constant": "kubellm-workspace"}]}}
    assert "kubellm-workspace" in _strings(broken)
