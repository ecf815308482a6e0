"""PipelineConfig and TrainConfig: one clear line for a bad value, naming field and allowed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kubellm.backends import resolve
from kubellm.config import (
    ConfigError,
    PipelineConfig,
    TrainConfig,
    parse_overrides,
    pipeline_config,
    validate,
)


@dataclass
class Case:
    overrides: list[str]
    fragments: list[str]


BAD = [
    Case(["train_steps=-1"], ["train_steps=-1", "allowed: int >= 1"]),
    Case(["nope=1"], ["unknown parameter 'nope'", "allowed parameters:", "train_steps"]),
    Case(["platform=pbs"], ["platform='pbs'", "'local', 'kubernetes', 'slurm'"]),
    Case(["learning_rate=1"], ["learning_rate=1", "< 1"]),
    Case(["model_name=Bad_Name"], ["model_name='Bad_Name'", "matching"]),
    Case(["batch_size=63"], ["batch_size (63)", "divisible"]),
    Case(["num_heads=3"], ["num_heads (3) must divide hidden_size (128)"]),
    Case(["train_steps"], ["not key=value"]),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c.overrides[0])
def test_bad_values_give_one_line_naming_the_field(case: Case) -> None:
    with pytest.raises(ConfigError) as info:
        pipeline_config(parse_overrides(case.overrides))
    message = str(info.value)
    assert "\n" not in message
    for fragment in case.fragments:
        assert fragment in message


def test_overrides_parse_as_json_and_keep_strings() -> None:
    values = parse_overrides(["train_steps=7", "learning_rate=1e-3", "model_name=abc-1"])
    assert values == {"train_steps": 7, "learning_rate": 1e-3, "model_name": "abc-1"}
    cfg = pipeline_config(values, platform="local")
    assert (cfg.train_steps, cfg.platform) == (7, "local")


def test_resolved_local_paths_are_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = resolve(PipelineConfig(platform="local"))
    assert cfg.runs_dir == str(tmp_path / "runs")
    assert cfg.mlflow_tracking_uri == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"


def test_resolved_kubernetes_takes_tracking_uri_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert resolve(PipelineConfig()).mlflow_tracking_uri == "http://mlflow.example:5000"


def test_every_field_has_a_description() -> None:
    for model in (PipelineConfig, TrainConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_train_config_nested_error_names_the_path() -> None:
    with pytest.raises(ConfigError, match=r"model\.num_heads|num_heads \(3\)"):
        validate(
            TrainConfig,
            {"dataset_dir": "d", "output_dir": "o", "model": {"hidden_size": 64, "num_heads": 3}},
        )


def test_training_parameters_reach_the_train_config(tmp_path) -> None:
    from kubellm.stages.configs import prepare_params, train_config

    cfg = pipeline_config(
        {"strategy": "fsdp", "precision": "bf16", "base_model": "org/model", "lora_r": 4},
        platform="local",
        runs_dir=str(tmp_path),
    )
    train = train_config(cfg, tmp_path / "d", tmp_path / "o", steps=5)
    assert (train.strategy, train.precision, train.model_name_or_path) == (
        "fsdp",
        "bf16",
        "org/model",
    )
    assert train.lora is not None and train.lora.r == 4
    assert prepare_params(cfg).tokenizer == "org/model"  # the base model's tokenizer
    assert prepare_params(cfg.model_copy(update={"tokenizer": "tok"})).tokenizer == "tok"
    assert train_config(pipeline_config(), tmp_path, tmp_path).lora is None


def test_gate_guards_name_measured_metrics_and_nonnegative_bounds() -> None:
    guards = {"eval_loss": 0.05, "gen_latency_ms": 0.25, "gen_tokens_per_sec": 0.1}
    assert pipeline_config({"gate_guards": guards}).gate_guards == guards
    with pytest.raises(ConfigError, match=r"gate_guards keys must be among .*got bleu"):
        pipeline_config({"gate_guards": {"bleu": 0.1}})
    with pytest.raises(ConfigError, match=r"gate_guards bounds must be >= 0, got eval_loss"):
        pipeline_config({"gate_guards": {"eval_loss": -0.1}})


# -- pod sizes that follow the GPUs (issue 19, item 8) ----------------------------------------


def test_processes_follow_the_gpus_by_default() -> None:
    """8 GPUs a pod and nothing else said: one training process per GPU, not the CPU
    default of 2 (which left six GPUs idle)."""
    assert pipeline_config({"gpus_per_node": 8}).nproc_per_node == 8
    assert pipeline_config({"gpus_per_node": 1, "batch_size": 8}).nproc_per_node == 1
    assert pipeline_config({}).nproc_per_node == 2  # CPU: two processes, as before
    assert PipelineConfig.model_fields["nproc_per_node"].default == 0  # the YAML's: auto


def test_cpu_and_memory_scale_with_the_ranks_and_count_dev_shm() -> None:
    eight = pipeline_config({"gpus_per_node": 8})
    assert (eight.job_cpu, eight.job_memory) == ("16", "72Gi")  # 8 x (2, 8Gi) + 8Gi shm
    two = pipeline_config({})
    assert (two.job_cpu, two.job_memory) == ("4", "24Gi")
    big_shm = pipeline_config({"shm_size": "32Gi"})
    assert big_shm.job_memory == "48Gi"
    explicit = pipeline_config({"job_cpu": "30", "job_memory": "200Gi"})
    assert (explicit.job_cpu, explicit.job_memory) == ("30", "200Gi")


def test_a_local_machines_gpus_size_only_what_was_left_auto() -> None:
    """A local run gets one process per GPU of its machine (kubellm.backends.resolve; issue
    22, item 3); an explicit value stays."""
    four = pipeline_config({}).with_local_gpus(4)
    assert (four.nproc_per_node, four.job_cpu, four.job_memory) == (4, "8", "40Gi")
    assert four.with_local_gpus(2).nproc_per_node == 4  # sized once: now it is explicit
    kept = pipeline_config({"job_cpu": "30"}).with_local_gpus(4)
    assert (kept.nproc_per_node, kept.job_cpu, kept.job_memory) == (4, "30", "40Gi")
    assert pipeline_config({}).with_local_gpus(0).nproc_per_node == 2  # no GPU: the CPU's 2
    assert pipeline_config({"nproc_per_node": 1}).with_local_gpus(4).nproc_per_node == 1
    asked = pipeline_config({"gpus_per_node": 2, "batch_size": 8})
    assert asked.with_local_gpus(4).nproc_per_node == 2


SIZE_ERRORS = [
    Case(
        ["gpus_per_node=8", "nproc_per_node=2"],
        ["nproc_per_node (2) is less than gpus_per_node (8)", "6 GPU(s)", "nproc_per_node=0"],
    ),
    Case(
        ["gpus_per_node=8", "job_memory=16Gi"],
        ["job_memory (16Gi) leaves 8Gi", "shm_size 8Gi", "8 training processes"],
    ),
    Case(["job_memory=9Gi"], ["job_memory (9Gi) leaves 1Gi", "/dev/shm"]),
    Case(["gpus_per_node=8", "job_cpu=4"], ["job_cpu (4) is less than one CPU", "8 training"]),
]


@pytest.mark.parametrize("case", SIZE_ERRORS, ids=lambda c: " ".join(c.overrides))
def test_pod_sizes_too_small_for_their_ranks_are_refused(case: Case) -> None:
    with pytest.raises(ConfigError) as info:
        pipeline_config(parse_overrides(case.overrides))
    for fragment in case.fragments:
        assert fragment in str(info.value)


def test_training_pods_get_the_scaled_resources() -> None:
    from kubellm.backends.kubernetes.podspec import ClusterSettings

    cfg = pipeline_config({"gpus_per_node": 8, "job_max_restarts": 5})
    settings = ClusterSettings.from_config(cfg)
    resources = settings.resources()
    assert resources is not None
    assert resources.limits == {"cpu": "16", "memory": "72Gi", "nvidia.com/gpu": "8"}
    assert settings.max_restarts == 5


# -- serving parameters (issue 20, point 6) ----------------------------------------------------

SERVING_ERRORS = [
    Case(["serving_dtype=auto"], ["serving_dtype='auto'", "'float32', 'bfloat16', 'float16'"]),
    Case(["serving_max_model_len=-1"], ["serving_max_model_len=-1", ">= 0"]),
    Case(
        ["serving_max_model_len=16"],
        ["serving_max_model_len (16) is below seq_len (32)"],
    ),
    Case(
        ["serving_max_model_len=4096"],
        ["serving_max_model_len (4096) is above the model's context (128"],
    ),
    Case(
        ["serving_runtime=custom", "serving_dtype=bfloat16"],
        ["serving_dtype=bfloat16 needs KServe's Hugging Face runtime", "kubellm serve"],
    ),
    Case(
        ["platform=local", "serving_max_model_len=64"],
        ["serving_max_model_len=64 needs KServe's Hugging Face runtime"],
    ),
    Case(["serving_service_account=Model_Reader"], ["serving_service_account='Model_Reader'"]),
    Case(
        ['serving_node_selector={"gpu type": "l4"}'],
        ["invalid serving_node_selector=", "'gpu type'"],
    ),
    Case(
        ['serving_node_selector={"pool": "a b"}'],
        ["invalid serving_node_selector=", "'a b': a label value"],
    ),
    Case(
        ['serving_tolerations=[{"operator": "Equal", "value": "x"}]'],
        ["invalid serving_tolerations=", "operator must be Exists when key is empty"],
    ),
    Case(
        ['serving_tolerations=[{"key": "gpu", "operator": "Exists", "value": "x"}]'],
        ["serving_tolerations", "value must be empty when operator is Exists"],
    ),
    Case(
        ['serving_tolerations=[{"key": "gpu", "operator": "In"}]'],
        ["serving_tolerations", "operator must be Equal or Exists"],
    ),
    Case(
        ['serving_tolerations=[{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 5}]'],
        ["serving_tolerations", "tolerationSeconds needs effect NoExecute"],
    ),
    Case(
        ['serving_tolerations=[{"key": "gpu", "effect": "Never"}]'],
        ["serving_tolerations", "effect must be empty or one of NoSchedule"],
    ),
    Case(
        ['serving_tolerations=[{"key": "gpu", "seconds": 5}]'],
        ["serving_tolerations", "unknown field(s) seconds"],
    ),
    # the same rules for the training pods' own tolerations and node selector
    Case(['tolerations=[{"value": "x"}]'], ["invalid tolerations=", "operator must be Exists"]),
    Case(['node_selector={"pool/": "x"}'], ["invalid node_selector="]),
]


@pytest.mark.parametrize("case", SERVING_ERRORS, ids=lambda c: " ".join(c.overrides))
def test_bad_serving_parameters_name_the_field(case: Case) -> None:
    with pytest.raises(ConfigError) as info:
        pipeline_config(parse_overrides(case.overrides))
    for fragment in case.fragments:
        assert fragment in str(info.value)


def test_serving_defaults_match_evaluate_and_stay_in_the_cluster() -> None:
    cfg = pipeline_config({})
    assert cfg.serving_dtype == "float32"  # the checkpoint's, what evaluate measured in
    assert cfg.serving_max_model_len == 0  # the model's own context
    assert cfg.serving_cluster_local is True
    assert (cfg.serving_node_selector, cfg.serving_tolerations) == ({}, [])
    assert cfg.serving_service_account == ""


def test_valid_serving_placement_is_kept_as_given() -> None:
    tolerations = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "pool", "value": "serving"},  # operator empty: Equal
        {"operator": "Exists"},  # no key: every taint
        {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "tolerationSeconds": 30},
    ]
    cfg = pipeline_config(
        {
            "serving_tolerations": tolerations,
            "serving_node_selector": {"nvidia.com/gpu.product": "NVIDIA-L4", "pool": ""},
            "serving_service_account": "kserve.s3-reader",
            "serving_max_model_len": 128,
            "serving_dtype": "bfloat16",
        }
    )
    assert cfg.serving_tolerations == tolerations
    assert cfg.serving_node_selector == {"nvidia.com/gpu.product": "NVIDIA-L4", "pool": ""}
    # a base model's context is its own config's: no upper bound known before it loads
    assert pipeline_config({"base_model": "org/m", "serving_max_model_len": 32768})


# -- elastic PyTorchJob (issue 24, acceptance 3) -----------------------------------------------

ELASTIC_ERRORS = [
    Case(
        ["num_nodes=2", "elastic_min_nodes=3"],
        ["elastic_min_nodes (3) is above num_nodes (2), the elastic job's maxReplicas"],
    ),
    Case(
        ["num_nodes=2", "elastic_min_nodes=1", "trainer_backend=trainjob"],
        ["elastic_min_nodes=1 needs trainer_backend=pytorchjob", "TrainJob"],
    ),
    Case(
        ["elastic_min_nodes=1", "platform=local"],
        ["elastic_min_nodes=1 needs platform=kubernetes"],
    ),
    Case(["elastic_min_nodes=-1"], ["elastic_min_nodes=-1", ">= 0"]),
    Case(["elastic_max_restarts=101"], ["elastic_max_restarts=101", "<= 100"]),
]


@pytest.mark.parametrize("case", ELASTIC_ERRORS, ids=lambda c: " ".join(c.overrides))
def test_elastic_options_are_refused_where_no_elastic_pytorchjob_runs(case: Case) -> None:
    with pytest.raises(ConfigError) as info:
        pipeline_config(parse_overrides(case.overrides))
    assert "\n" not in str(info.value)
    for fragment in case.fragments:
        assert fragment in str(info.value)


def test_elastic_settings_reach_the_cluster_settings() -> None:
    from kubellm.backends.kubernetes.podspec import ClusterSettings

    cfg = pipeline_config({"num_nodes": 2, "elastic_min_nodes": 1, "elastic_max_restarts": 5})
    settings = ClusterSettings.from_config(cfg)
    assert (settings.elastic_min_nodes, settings.elastic_max_restarts) == (1, 5)
    assert ClusterSettings.from_config(pipeline_config()).elastic_min_nodes == 0
