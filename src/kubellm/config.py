"""Typed configuration for every stage.

Why one module: the pipeline's parameters, the `kubellm --set` overrides and the trainer's
flags all map onto these models, so a bad value is caught once, before anything expensive
starts, with one message that names the field and what it accepts.

Each constraint is declared once, as an annotated type below, and used by every model that
has such a field (PipelineConfig and TrainConfig share seed, batch size, learning rate,
strategy, precision, model shape; the data options share their Literals with
kubellm.data's readers). The PipelineConfig -> stage config mappings live in
kubellm.stages.configs.
"""

from __future__ import annotations

import json
import re
import typing
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kubellm import RUNTIME_IMAGE

# -- shared field types ----------------------------------------------------------------------

Platform = Literal["local", "kubernetes", "slurm"]
Strategy = Literal["ddp", "fsdp", "hsdp"]
Precision = Literal["auto", "fp32", "bf16"]
DataFormat = Literal["auto", "jsonl", "parquet", "text", "hf"]
Template = Literal["none", "prompt_response", "messages"]
ChatLoss = Literal["all_assistant", "last_assistant"]
Packing = Literal["concat", "best_fit"]
OnError = Literal["skip", "fail"]
TextMode = Literal["file", "line"]
Fabric = Literal["tcp", "rdma-ib", "roce"]
GangScheduler = Literal["kueue", "volcano"]
TrainerBackend = Literal["pytorchjob", "trainjob"]
TuneAlgorithm = Literal["random", "tpe", "bayesianoptimization", "grid"]
ServingRuntime = Literal["huggingface", "custom"]
# The dtypes both of KServe's Hugging Face backends take as `--dtype` (huggingfaceserver
# __main__.py dtype_choices; vLLM's EngineArgs), minus `auto`: on a GPU vLLM's auto serves a
# float32 checkpoint in float16/bfloat16, the HF backend's auto in config.json's dtype.
ServingDtype = Literal["float32", "bfloat16", "float16"]
# What evaluate measures in and `kubellm serve` loads in: the exported checkpoint's own dtype
# (from_pretrained's default, `auto`, reads config.json), float32, since training keeps float32
# weights (bf16 is autocast only) and exports them as they are.
CHECKPOINT_DTYPE: ServingDtype = "float32"
GateMetric = Literal["auto", "exact_match", "eval_loss", "perplexity", "bits_per_byte"]
GATE_METRICS = ("exact_match", "eval_loss", "perplexity", "bits_per_byte")
# gate_guards' default: held-out bits per byte at most 5 % worse than the champion's (why 5 %:
# kubellm.evaluate.gate's docstring)
DEFAULT_GATE_GUARDS = {"bits_per_byte": 0.05}
# what gate_guards may bound: the gate metrics and the generation speed evaluate measures
GUARD_METRICS = (*GATE_METRICS, "gen_latency_ms", "gen_tokens_per_sec")

Seed = Annotated[int, Field(ge=0)]
Steps = Annotated[int, Field(ge=1)]
BatchSize = Annotated[int, Field(ge=1)]
LearningRate = Annotated[float, Field(gt=0, lt=1)]
HiddenSize = Annotated[int, Field(ge=8)]
NumLayers = Annotated[int, Field(ge=1, le=64)]
NumHeads = Annotated[int, Field(ge=1)]
MAX_LORA_RANK = 1024
LoraRank = Annotated[int, Field(ge=1, le=MAX_LORA_RANK)]
LoraRankOrOff = Annotated[int, Field(ge=0, le=MAX_LORA_RANK)]  # 0: no adapters

# A Kubernetes resource quantity (`2`, `500m`, `16Gi`, `1.5e9`), as the API server parses it.
Quantity = Annotated[
    str,
    Field(pattern=r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[KMGTPE]i?|[munkMGTPE])?$"),
]
# The same, or empty for "work it out from the other settings" (job_cpu, job_memory).
QuantityOrAuto = Annotated[
    str,
    Field(
        pattern=r"^([+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[KMGTPE]i?|[munkMGTPE])?)?$"
    ),
]
_SUFFIX = {
    "": 1.0,
    "m": 1e-3,
    "u": 1e-6,
    "n": 1e-9,
    **{s: 1000.0**i for i, s in enumerate("kMGTPE", 1)},
    **{f"{s}i": 1024.0**i for i, s in enumerate("KMGTPE", 1)},
}
GI = 1024.0**3
# Defaults of a training pod's share of its node, per training process (rank): what `job_cpu`
# and `job_memory` come to when left empty. The memory-backed /dev/shm (`shm_size`) counts
# against the container's memory limit, so it is added on top.
CPU_PER_RANK = 2
MEMORY_PER_RANK_GI = 8
# The least an explicit job_memory must leave each rank once /dev/shm is taken.
MIN_MEMORY_PER_RANK_GI = 2
# Processes per node when no GPUs are requested and nproc_per_node is 0 (auto).
CPU_NPROC = 2
# The least max_position_embeddings of a from-config model (kubellm.stages.configs.model_shape).
MIN_CONTEXT = 128


def quantity(text: str) -> float:
    """A Kubernetes quantity as a number (`500m` -> 0.5, `16Gi` -> 17179869184.0)."""
    m = re.fullmatch(r"[+]?([0-9.]+)([eE][-+]?[0-9]+)?([a-zA-Z]*)", text.strip())
    if not m or m[3] not in _SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    return float(m[1] + (m[2] or "")) * _SUFFIX[m[3]]


def _gi(value: float) -> str:
    return f"{value / GI:g}Gi"


# DNS-1035 label: what the PyTorchJob webhook, Katib and KServe accept as a name.
DNS_1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# DNS-1123 subdomain, or empty: a ServiceAccount's name (ValidateServiceAccountName).
DNS_1123_SUBDOMAIN_OR_EMPTY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)?$"
)

# Label keys and values as the API server checks them (apimachinery validation.go
# IsQualifiedName, IsValidLabelValue): what nodeSelector and tolerations may hold.
_LABEL_NAME = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)"
_LABEL_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_TOLERATION_FIELDS = ("key", "operator", "value", "effect", "tolerationSeconds")
_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _label_key_error(key: Any) -> str:
    if not isinstance(key, str):
        return f"{key!r} is not a string"
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not re.fullmatch(_LABEL_PREFIX, prefix)):
        return f"{key!r}: the prefix must be a DNS subdomain"
    if len(name) > 63 or not re.fullmatch(_LABEL_NAME, name):
        return (
            f"{key!r}: the name must be 63 characters or fewer of [A-Za-z0-9-_.], "
            "beginning and ending with a letter or digit"
        )
    return ""


def _label_value_error(value: Any) -> str:
    if not isinstance(value, str):
        return f"{value!r} is not a string"
    if value and (len(value) > 63 or not re.fullmatch(_LABEL_NAME, value)):
        return (
            f"{value!r}: a label value is empty or 63 characters or fewer of [A-Za-z0-9-_.], "
            "beginning and ending with a letter or digit"
        )
    return ""


def _check_node_selector(value: dict[str, str]) -> dict[str, str]:
    for key, val in value.items():
        why = _label_key_error(key) or _label_value_error(val)
        if why:
            raise ValueError(f"node selector {why}")
    return value


def _check_tolerations(value: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The API server's rules (kubernetes pkg/apis/core/validation ValidateTolerations), in
    the tolerations' API form, so a bad one fails here rather than at the pod's create."""
    for i, t in enumerate(value):
        where = f"toleration [{i}]"
        unknown = sorted(set(t) - set(_TOLERATION_FIELDS))
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {', '.join(unknown)}; "
                f"fields: {', '.join(_TOLERATION_FIELDS)}"
            )
        key, op = t.get("key", ""), t.get("operator", "")
        value_, effect = t.get("value", ""), t.get("effect", "")
        if key and (why := _label_key_error(key)):
            raise ValueError(f"{where}: key {why}")
        if op not in ("", "Equal", "Exists"):
            raise ValueError(f"{where}: operator must be Equal or Exists")
        if not key and op != "Exists":
            raise ValueError(f"{where}: operator must be Exists when key is empty")
        if op == "Exists" and value_:
            raise ValueError(f"{where}: value must be empty when operator is Exists")
        if op != "Exists" and (why := _label_value_error(value_)):
            raise ValueError(f"{where}: value {why}")
        if effect not in ("", *_TAINT_EFFECTS):
            raise ValueError(f"{where}: effect must be empty or one of {', '.join(_TAINT_EFFECTS)}")
        seconds = t.get("tolerationSeconds")
        if seconds is not None:
            if effect != "NoExecute":
                raise ValueError(f"{where}: tolerationSeconds needs effect NoExecute")
            if isinstance(seconds, bool) or not isinstance(seconds, int):
                raise ValueError(f"{where}: tolerationSeconds must be an integer")
    return value


# nodeSelector and tolerations of a pod, checked as the API server would.
NodeSelector = Annotated[dict[str, str], AfterValidator(_check_node_selector)]
Tolerations = Annotated[list[dict[str, Any]], AfterValidator(_check_tolerations)]

STRATEGY_HELP = (
    "ddp: replicated model; fsdp: FSDP2 fully_shard (parameters, gradients and optimizer "
    "state sharded over all ranks); hsdp: sharded within a node, replicated across nodes "
    "(a 2-D mesh: less inter-node traffic)."
)
PRECISION_HELP = "auto: bf16 mixed precision on GPUs that support it, fp32 on CPU."
REMOTE_CODE_HELP = "Allow a tokenizer's or model's own Python code (off unless asked)."


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the allowed values."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _heads_divide(hidden_size: int, num_heads: int) -> None:
    if hidden_size % num_heads:
        raise ValueError(f"num_heads ({num_heads}) must divide hidden_size ({hidden_size})")


class ModelConfig(_Strict):
    """Shape of the from-config Llama-style causal LM (the local default)."""

    hidden_size: HiddenSize = Field(128, description="Width of the residual stream.")
    num_layers: NumLayers = Field(2, description="Number of decoder layers.")
    num_heads: NumHeads = Field(4, description="Attention heads; must divide hidden_size.")
    intermediate_size: int = Field(256, ge=8, description="Width of the MLP.")
    max_position_embeddings: int = Field(128, ge=8, description="Longest sequence the model takes.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        _heads_divide(self.hidden_size, self.num_heads)
        return self


class LoraSettings(_Strict):
    """LoRA through PEFT: only the adapters train; they are merged into the exported model."""

    r: LoraRank = Field(8, description="Adapter rank.")
    alpha: int = Field(16, ge=1, description="Scaling numerator (alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the linear layers that get adapters.",
    )


class TrainConfig(_Strict):
    """Everything `python -m kubellm.train` needs; nothing launcher-specific."""

    dataset_dir: str = Field(
        ..., description="Dataset artifact directory (train/, val/, tokenizer/)."
    )
    output_dir: str = Field(..., description="Where the Hugging Face model directory is written.")
    steps: Steps = Field(300, description="Optimizer steps.")
    batch_size: BatchSize = Field(32, description="Global batch (sequences per step, all ranks).")
    learning_rate: LearningRate = Field(3e-3, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps before cosine decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    seed: Seed = Field(0, description="Seed for model init and data order.")
    log_every: int = Field(20, ge=1, description="Print name=value metric lines every N steps.")
    eval_batches: int = Field(8, ge=1, description="Validation batches at the end of training.")
    adam_beta2: float = Field(0.999, gt=0, lt=1, description="AdamW beta2.")
    save_model: bool = Field(True, description="Export the model (tuning trials skip it).")
    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description="Shape of the from-config model (used when model_name_or_path is empty).",
    )
    model_name_or_path: str = Field(
        "",
        description="A Hugging Face causal LM directory or hub name to start from; "
        "empty: a new model shaped by `model`.",
    )
    trust_remote_code: bool = Field(False, description=REMOTE_CODE_HELP)
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend; auto picks nccl on GPUs, gloo on CPU."
    )
    strategy: Strategy = Field("ddp", description=STRATEGY_HELP)
    precision: Precision = Field("auto", description=PRECISION_HELP)
    grad_accum_steps: int = Field(
        1, ge=1, description="Micro-batches per optimizer step (batch_size is per step)."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute activations in backward (less memory, ~1/3 more compute)."
    )
    compile: bool = Field(False, description="torch.compile each decoder layer.")
    lora: LoraSettings | None = Field(
        None, description='LoRA adapters via PEFT, e.g. {"r": 8}; null: full fine-tuning.'
    )
    checkpoint_dir: str = Field(
        "", description="Where DCP checkpoints go; empty: no checkpoints, no resume."
    )
    checkpoint_every: int = Field(
        0, ge=0, description="Checkpoint every N steps (0: only at stop)."
    )
    keep_checkpoints: int = Field(2, ge=1, description="Complete checkpoints kept (newest).")
    stop_after: int = Field(
        0, ge=0, description="Checkpoint and stop after this step (0: run all steps); for drills."
    )
    mlflow_tracking_uri: str = Field("", description="MLflow tracking URI; empty disables logging.")
    mlflow_run_id: str = Field("", description="MLflow run to log metrics to (rank 0 only).")
    export_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="dtype of the exported model's floating-point weights: float32 (the "
        "trained master weights, exactly) or bfloat16 (half the size and the write time).",
    )
    init_timeout_s: int = Field(
        1800,
        ge=1,
        description="Seconds a collective may wait until the first step is done on every "
        "rank: process group creation (ranks waiting for the slowest to start, e.g. one still "
        "downloading the model), weights streamed from rank 0, resume, the first step with "
        "its compilation.",
    )
    collective_timeout_s: int = Field(
        600,
        ge=1,
        description="Seconds a collective of the default process group may wait after the "
        "first step; past it NCCL's watchdog ends the job (and dumps its flight recorder).",
    )
    export_timeout_s: int = Field(
        7200,
        ge=1,
        description="Seconds the other ranks wait for rank 0 to write the exported model "
        "(on a gloo group of its own, so NCCL's watchdog is not involved).",
    )

    def micro_batch(self, world_size: int) -> int:
        """Sequences per rank per forward pass; ConfigError when the batch does not divide."""
        parts = world_size * self.grad_accum_steps
        if self.batch_size % parts:
            raise ConfigError(
                f"invalid batch_size={self.batch_size}: must be divisible by WORLD_SIZE x "
                f"grad_accum_steps = {world_size} x {self.grad_accum_steps} = {parts}"
            )
        return self.batch_size // parts

    def with_values(self, values: dict[str, Any]) -> TrainConfig:
        """This config with `values` applied, validated as a whole (ConfigError naming the
        field): the one way trials' `--set` hyperparameters and the train stage's tuned
        ones reach a TrainConfig."""
        return validate(TrainConfig, {**self.model_dump(), **values})


class PipelineConfig(_Strict):
    """The pipeline's parameters. `pipelines/llm_train.py` declares exactly these, same defaults."""

    platform: Platform = Field(
        "kubernetes",
        description="Where jobs run: 'kubernetes' (cluster), 'local' (one machine) or 'slurm' "
        "(training as sbatch jobs from a login node; the other steps on it).",
    )
    slurm_partition: str = Field(
        "", description="Slurm partition of training jobs (platform=slurm); empty: the default."
    )
    slurm_account: str = Field(
        "", description="Slurm account of training jobs (platform=slurm); empty: the default."
    )
    seed: Seed = Field(0, description="Seed for data generation, splits, init and tuning.")
    data_source: str = Field(
        "synthetic",
        description="'synthetic' (built-in arithmetic Q/A) or a path/glob of JSONL files.",
    )
    allow_http_sources: bool = Field(
        False,
        description="Let data_source and eval_data be http(s):// or hf:// URLs, which the "
        "step's pod fetches (and so could reach the cluster's own services); local paths and "
        "s3/gs/abfs are always accepted, system paths (/proc, /var/run/secrets, ...) never.",
    )
    data_format: DataFormat = Field(
        "auto", description="Source format; auto goes by file extension (.jsonl[.gz|.zst], ...)."
    )
    text_field: str = Field("text", min_length=1, description="Field holding the text.")
    template: Template = Field(
        "none",
        description="Render prompt/response or chat messages fields into training text with "
        "the tokenizer's chat template (kubellm's default one, saved with the tokenizer, when it "
        "has none); none: text (or prompt/completion) fields as they are.",
    )
    chat_loss: ChatLoss = Field(
        "all_assistant",
        description="Chat records (template=messages): the loss on every assistant turn "
        "(all_assistant) or on the last one only (last_assistant).",
    )
    tokenizer: str = Field(
        "", description="Tokenizer directory or hub name; empty trains a byte-level BPE."
    )
    trust_remote_code: bool = Field(False, description=REMOTE_CODE_HELP)
    packing: Packing = Field(
        "concat", description="concat: EOS-joined and chunked; best_fit: whole documents, padded."
    )
    near_dedup: bool = Field(False, description="Drop near-duplicates (MinHash LSH) too.")
    on_error: OnError = Field(
        "skip", description="Bad input records: skip (count by reason) or fail the stage."
    )
    mask_prompt: bool = Field(
        True, description="Train on completions only (records with prompt/completion fields)."
    )
    num_records: int = Field(20000, ge=100, le=10_000_000, description="Synthetic records.")
    val_fraction: float = Field(0.1, gt=0, lt=0.5, description="Share of records held out.")
    vocab_size: int = Field(512, ge=64, le=262_144, description="BPE vocabulary size.")
    seq_len: int = Field(32, ge=8, le=8192, description="Packed sequence length in tokens.")
    hidden_size: HiddenSize = Field(128, description="Model width.")
    num_layers: NumLayers = Field(3, description="Decoder layers.")
    num_heads: NumHeads = Field(4, description="Attention heads (divide hidden_size).")
    tune_trials: int = Field(3, ge=0, le=200, description="Hyperparameter trials; 0 skips tuning.")
    tune_steps: Steps = Field(100, description="Optimizer steps per trial.")
    train_steps: Steps = Field(1500, description="Optimizer steps of the final training run.")
    batch_size: BatchSize = Field(64, description="Global batch size (divisible by processes).")
    learning_rate: LearningRate = Field(3e-3, description="Learning rate when not tuned.")
    strategy: Strategy = Field("ddp", description=STRATEGY_HELP)
    precision: Precision = Field("auto", description=PRECISION_HELP)
    base_model: str = Field(
        "",
        description="Hugging Face causal LM (directory or hub name) to fine-tune; empty: a new "
        "model from hidden_size/num_layers/num_heads. Its tokenizer is used unless tokenizer "
        "is set.",
    )
    lora_r: LoraRankOrOff = Field(
        0, description="LoRA rank (PEFT) for the training jobs; 0: full training."
    )
    nproc_per_node: int = Field(
        0,
        ge=0,
        le=64,
        description="Training processes per node; 0: one per GPU (gpus_per_node) when GPUs are "
        f"requested, else {CPU_NPROC}.",
    )
    num_nodes: int = Field(1, ge=1, le=1024, description="Training nodes (PyTorchJob workers).")
    gate_min_accuracy: float = Field(
        0.2, ge=0, le=1, description="Held-out exact-match accuracy the model must reach to ship."
    )
    force: bool = Field(
        False,
        description="Train even when the data and training recipe are the champion's (same "
        "data and recipe fingerprints) or were already rejected by the gate; false: such a "
        "run stops after record_data.",
    )
    pipeline_version: str = Field(
        "",
        description="Which compiled pipeline this run is: `sha256-` and 16 hex digits of the "
        "YAML, the KFP pipeline version kubellm schedule uploads it as (kubellm submit and "
        "schedule set it); recorded on the registered model. Empty when not known.",
    )
    eval_data: str = Field(
        "",
        description="A JSONL (path or URI) of prompt/answer records: the task exact match is "
        "measured on, for the candidate and the champion; empty: the held-out examples of "
        "the data.",
    )
    gate_metric: GateMetric = Field(
        "auto",
        description="What the gate compares: exact_match (higher is better), eval_loss, "
        "perplexity or bits_per_byte (lower is better; bits_per_byte is the held-out text's "
        "loss per UTF-8 byte, comparable across tokenizers); auto: exact_match when the data "
        "has prompt/answer examples, else perplexity. When the champion's tokenizer is not "
        "the candidate's, eval_loss and perplexity are compared on bits_per_byte instead.",
    )
    gate_margin: float = Field(
        0.0,
        ge=0,
        description="How much the candidate must beat the champion by on gate_metric (in its "
        "units), both measured on the candidate's evaluation data; 0: strictly better (a tie "
        "keeps the champion).",
    )
    gate_allow_incomparable: bool = Field(
        False,
        description="When the champion cannot be measured on the gate metric on this run's "
        "data, let the absolute bar decide; false: the candidate is rejected and the "
        "champion stays, with the reason.",
    )
    gate_max_perplexity: float = Field(
        1000.0,
        gt=1,
        description="With no champion and a loss gate: the held-out perplexity the model must "
        "stay under to ship.",
    )
    gate_guards: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_GATE_GUARDS),
        description="Guard metrics and how much worse than the champion each may get, "
        'relative: the default {"bits_per_byte": 0.05} (5 %) keeps an exact_match gate from '
        "promoting a model whose held-out loss got markedly worse for an answer or two more "
        "right; setting it replaces the default, {}: no guards. Keys: exact_match, eval_loss, "
        "perplexity, bits_per_byte, gen_latency_ms, gen_tokens_per_sec.",
    )
    model_name: str = Field(
        "kubellm-tiny",
        pattern=DNS_1035,
        max_length=45,
        description="Registered model and InferenceService name: lowercase letters, digits and "
        "'-', starting with a letter (DNS-1035, as KServe requires).",
    )
    experiment_name: str = Field("kubellm", min_length=1, description="MLflow experiment.")
    mlflow_tracking_uri: str = Field(
        "",
        description="MLflow tracking URI; empty: sqlite under runs_dir (local) or "
        "$MLFLOW_TRACKING_URI (kubernetes).",
    )
    runs_dir: str = Field("runs", min_length=1, description="Local state: MLflow store, servers.")
    namespace: str = Field("kubellm", min_length=1, description="Kubernetes namespace for jobs.")
    trainer_image: str = Field(
        "ghcr.io/kubellm/trainer:0.1.0", min_length=1, description="Image of training pods."
    )
    serving_image: str = Field(
        "ghcr.io/kubellm/serving:0.1.0", min_length=1, description="Image of the model server."
    )
    serving_runtime: ServingRuntime = Field(
        "huggingface",
        description="KServe serving runtime: huggingface (KServe's Hugging Face runtime, "
        "modelFormat huggingface) or custom (serving_image running `kubellm serve`). Both "
        "answer the same routes (KServe V1/V2 and /openai/v1).",
    )
    canary_traffic_percent: int = Field(
        10,
        ge=1,
        le=99,
        description="Share of traffic a new model version gets while it is smoke-tested, "
        "where a previous version serves (KServe canaryTrafficPercent); a passed smoke test "
        "moves all traffic to it, a failed one moves all traffic back.",
    )
    serving_cpu: Quantity = Field("1", description="CPU request and limit of each model server.")
    serving_memory: Quantity = Field(
        "4Gi", description="Memory request and limit of each model server."
    )
    serving_gpus: int = Field(
        0, ge=0, le=16, description="GPUs each model server requests (nvidia.com/gpu); 0: CPU."
    )
    serving_min_replicas: int = Field(
        1, ge=0, le=1000, description="Fewest model server replicas (0: scale to zero)."
    )
    serving_max_replicas: int = Field(
        1, ge=1, le=1000, description="Most model server replicas (the autoscaler's ceiling)."
    )
    serving_dtype: ServingDtype = Field(
        CHECKPOINT_DTYPE,
        description="dtype the Hugging Face runtime loads the weights in (its --dtype, both "
        "backends), and the dtype evaluate measures in, so the smoke test compares the server "
        "with answers computed at the precision it serves: float32 (the checkpoint's), or "
        "bfloat16/float16 to halve a GPU's memory. Left to the runtime, vLLM would serve "
        "float32 weights in half precision. `kubellm serve` (custom runtime, local) loads "
        "float32 only.",
    )
    serving_max_model_len: int = Field(
        0,
        ge=0,
        le=1_048_576,
        description="Longest prompt plus completion, in tokens, the Hugging Face runtime "
        "accepts (its --max_model_len; vLLM sizes its KV cache for it); 0: the model's own "
        "context (max_position_embeddings). At least seq_len and at most the model's "
        "context; the custom runtime has no such flag.",
    )
    serving_node_selector: NodeSelector = Field(
        default_factory=dict,
        description="Node labels the model server pods must match (the predictor's "
        'nodeSelector), e.g. {"nvidia.com/gpu.product": "NVIDIA-L4"}; in Knative mode '
        "Knative's config-features must enable kubernetes.podspec-nodeselector.",
    )
    serving_tolerations: Tolerations = Field(
        default_factory=list,
        description="Tolerations of the model server pods (the predictor's; Kubernetes "
        'objects, e.g. {"key": "nvidia.com/gpu", "operator": "Exists", "effect": '
        '"NoSchedule"}); in Knative mode Knative\'s config-features must enable '
        "kubernetes.podspec-tolerations.",
    )
    serving_service_account: str = Field(
        "",
        pattern=DNS_1123_SUBDOMAIN_OR_EMPTY,
        max_length=253,
        description="ServiceAccount of the model server pods (the predictor's "
        "serviceAccountName): KServe's storage initializer takes the credentials for an "
        "s3:// or gs:// storageUri from its secrets and annotations; empty: the namespace's "
        "`default` account.",
    )
    serving_cluster_local: bool = Field(
        True,
        description="Keep the InferenceService inside the cluster (label "
        "networking.knative.dev/visibility, and networking.kserve.io/visibility in Standard "
        "mode: cluster-local): no public URL for it, nor for the untested canary's own tag "
        "URL while it is smoke-tested (the steps call the in-cluster addresses); false: "
        "both are published on the ingress domain.",
    )
    smoke_timeout_seconds: int = Field(
        60,
        ge=1,
        le=3600,
        description="Longest the smoke test waits for one answer; a slower one fails the test "
        "(and rolls back).",
    )
    workspace_pvc: str = Field(
        "kubellm-workspace", min_length=1, description="PVC shared by steps and jobs (cluster)."
    )
    job_timeout_minutes: int = Field(
        120, ge=1, description="A job still running after this is deleted and the step fails."
    )
    # -- cluster: images, resources, placement (platform=kubernetes; ignored locally) --------
    runtime_image: str = Field(
        RUNTIME_IMAGE, min_length=1, description="Image of the pipeline's own step pods."
    )
    gpus_per_node: int = Field(
        0, ge=0, le=16, description="GPUs each training pod requests (nvidia.com/gpu); 0: CPU."
    )
    job_cpu: QuantityOrAuto = Field(
        "",
        description="CPU request and limit of each training pod; empty: "
        f"{CPU_PER_RANK} per training process (nproc_per_node).",
    )
    job_memory: QuantityOrAuto = Field(
        "",
        description=f"Memory request and limit of each training pod; empty: {MEMORY_PER_RANK_GI}Gi "
        "per training process plus shm_size (the memory-backed /dev/shm counts against it).",
    )
    job_max_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="Retryable failures (pods recreated after a pre-emption or a retryable "
        "exit) a training job may have; one more and the step deletes it and fails.",
    )
    elastic_min_nodes: int = Field(
        0,
        ge=0,
        le=1024,
        description="0: a fixed-size PyTorchJob (one Master, num_nodes-1 Workers). Above 0: an "
        "elastic PyTorchJob (trainer_backend=pytorchjob): num_nodes Workers and no Master, "
        "elasticPolicy minReplicas this and maxReplicas num_nodes, torchrun's c10d rendezvous "
        "on worker-0; a failed pod's group restarts and resumes from the last checkpoint.",
    )
    elastic_max_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="With elastic_min_nodes: how many times torchrun's elastic agent in each "
        "pod restarts the worker group (elasticPolicy.maxRestarts, PET_MAX_RESTARTS) after a "
        "worker or a peer pod fails, before its pod fails.",
    )
    step_cpu: Quantity = Field("1", description="CPU request and limit of each pipeline step.")
    step_memory: Quantity = Field(
        "4Gi", description="Memory request and limit of each pipeline step."
    )
    shm_size: Quantity = Field(
        "8Gi",
        description="Size of /dev/shm (memory-backed) in training pods; it counts against "
        "job_memory.",
    )
    evaluate_cpu: Quantity = Field(
        "2", description="CPU request and limit of the evaluate step (it loads the model)."
    )
    evaluate_memory: Quantity = Field(
        "8Gi",
        description="Memory request and limit of the evaluate step (the model twice: "
        "candidate and champion; about 8 bytes a parameter in fp32).",
    )
    evaluate_gpus: int = Field(
        0, ge=0, le=16, description="GPUs (nvidia.com/gpu) of the evaluate step; 0: CPU."
    )
    register_cpu: Quantity = Field(
        "1", description="CPU request and limit of the register step (it logs the model)."
    )
    register_memory: Quantity = Field(
        "8Gi", description="Memory request and limit of the register step."
    )
    node_selector: NodeSelector = Field(
        default_factory=dict, description="Node labels training pods must match."
    )
    tolerations: Tolerations = Field(
        default_factory=list, description="Tolerations of training pods (Kubernetes objects)."
    )
    priority_class: str = Field("", description="PriorityClass of training pods; empty: none.")
    queue: str = Field(
        "",
        description="Queue for gang scheduling (Kueue LocalQueue or Volcano queue); empty: none.",
    )
    gang_scheduler: GangScheduler = Field(
        "kueue",
        description="kueue: the kueue.x-k8s.io/queue-name label; volcano: the PyTorchJob's "
        "schedulingPolicy (the Training Operator must run with --gang-scheduler-name=volcano).",
    )
    trainer_backend: TrainerBackend = Field(
        "pytorchjob",
        description="How a cluster runs training: pytorchjob (Training Operator v1, "
        "kubeflow.org/v1 PyTorchJob) or trainjob (Kubeflow Trainer v2, trainer.kubeflow.org/"
        "v1alpha1 TrainJob on ClusterTrainingRuntime kubellm-torch, manifests/cluster/"
        "trainer-v2), for training and preflight's fabric check; Katib trials stay PyTorchJobs.",
    )
    job_ttl_hours: int = Field(
        24, ge=0, description="Finished jobs are deleted after this many hours; 0: at once."
    )
    job_grace_seconds: int = Field(
        300,
        ge=30,
        le=86400,
        description="Training pods' terminationGracePeriodSeconds: time between SIGTERM "
        "(pre-emption, eviction) and SIGKILL for the checkpoint save; size it for a "
        "checkpoint write (about 16 bytes a parameter with AdamW / volume bandwidth).",
    )
    fabric: Fabric = Field(
        "tcp",
        description="Network between training nodes: tcp (NCCL picks; nothing set), rdma-ib "
        "(InfiniBand) or roce (RDMA over Ethernet): RDMA device, IPC_LOCK and NCCL settings.",
    )
    rdma_resource: str = Field(
        "rdma/rdma_shared_device_a",
        min_length=1,
        description="Extended resource of the RDMA device plugin (e.g. nvidia.com/hostdev).",
    )
    rdma_count: int = Field(1, ge=1, le=64, description="RDMA devices each training pod asks for.")
    network_annotation: str = Field(
        "",
        description="Multus networks for training pods (k8s.v1.cni.cncf.io/networks); empty: none.",
    )
    nccl_env: dict[str, str] = Field(
        default_factory=dict,
        description="NCCL_* settings that override the fabric profile's defaults.",
    )
    min_busbw_gbps: float = Field(
        0.0, ge=0, description="Preflight fails when all-reduce bus bandwidth is lower; 0: off."
    )
    tune_algorithm: TuneAlgorithm = Field("tpe", description="Search algorithm of the tuner.")
    tune_parallel: int = Field(1, ge=1, le=64, description="Trials run at the same time.")
    tune_max_failed: int = Field(
        -1, ge=-1, description="Failed trials that end the search; -1: tune_trials - 1."
    )
    tune_early_stopping: bool = Field(
        False, description="Stop trials worse than the median (Katib medianstop; cluster only)."
    )

    @field_validator("nccl_env")
    @classmethod
    def _nccl_only(cls, value: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in value if not re.fullmatch(r"NCCL_[A-Z0-9_]+", k))
        if bad:
            raise ValueError(f"nccl_env keys must be NCCL_* variables, got {', '.join(bad)}")
        return value

    @field_validator("gate_guards")
    @classmethod
    def _known_guards(cls, value: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k in value if k not in GUARD_METRICS)
        if bad:
            raise ValueError(
                f"gate_guards keys must be among {', '.join(GUARD_METRICS)}, got {', '.join(bad)}"
            )
        negative = sorted(k for k, v in value.items() if v < 0)
        if negative:
            raise ValueError(f"gate_guards bounds must be >= 0, got {', '.join(negative)}")
        return value

    @model_validator(mode="after")
    def _sizes(self) -> PipelineConfig:
        """Resolve what was left to follow the GPUs (nproc_per_node 0, job_cpu/job_memory
        empty), then check explicit pod sizes against the ranks they must hold.

        A size filled in here stays out of `model_fields_set` (what the caller set), so
        `with_local_gpus` can size it again; preflight's resolved config, which every later
        stage loads, has them all set."""
        if self.nproc_per_node == 0:
            self.nproc_per_node = self.gpus_per_node or CPU_NPROC
            self.__pydantic_fields_set__.discard("nproc_per_node")
        ranks = self.nproc_per_node
        shm = quantity(self.shm_size)
        if not self.job_cpu:
            self.job_cpu = str(CPU_PER_RANK * ranks)
            self.__pydantic_fields_set__.discard("job_cpu")
        if not self.job_memory:
            self.job_memory = _gi(MEMORY_PER_RANK_GI * GI * ranks + shm)
            self.__pydantic_fields_set__.discard("job_memory")
        if quantity(self.job_cpu) < ranks:
            raise ValueError(
                f"job_cpu ({self.job_cpu}) is less than one CPU for each of the "
                f"{ranks} training processes per pod (nproc_per_node); leave job_cpu empty "
                f"for {CPU_PER_RANK} per process"
            )
        left = quantity(self.job_memory) - shm
        if left < MIN_MEMORY_PER_RANK_GI * GI * ranks:
            raise ValueError(
                f"job_memory ({self.job_memory}) leaves {_gi(max(left, 0))} once /dev/shm "
                f"(shm_size {self.shm_size}, memory-backed, counted against the limit) is "
                f"taken: less than {MIN_MEMORY_PER_RANK_GI}Gi for each of the {ranks} training "
                f"processes; leave job_memory empty for {MEMORY_PER_RANK_GI}Gi per process plus "
                "shm_size"
            )
        if self.gpus_per_node > self.nproc_per_node:
            raise ValueError(
                f"nproc_per_node ({self.nproc_per_node}) is less than gpus_per_node "
                f"({self.gpus_per_node}): {self.gpus_per_node - self.nproc_per_node} GPU(s) "
                "per pod would sit idle; set nproc_per_node=0 (one process per GPU)"
            )
        return self

    @model_validator(mode="after")
    def _consistent(self) -> PipelineConfig:
        procs = self.nproc_per_node * self.num_nodes
        if self.batch_size % procs:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by nproc_per_node x num_nodes "
                f"({procs})"
            )
        _heads_divide(self.hidden_size, self.num_heads)
        if self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            raise ValueError(
                f"nproc_per_node ({self.nproc_per_node}) is more than gpus_per_node "
                f"({self.gpus_per_node}): each training process needs its own GPU"
            )
        if self.fabric != "tcp" and not self.gpus_per_node:
            raise ValueError(
                f"fabric={self.fabric} needs gpus_per_node > 0 (RDMA carries NCCL's GPU traffic)"
            )
        if self.serving_max_replicas < self.serving_min_replicas:
            raise ValueError(
                f"serving_max_replicas ({self.serving_max_replicas}) is below "
                f"serving_min_replicas ({self.serving_min_replicas})"
            )
        self._serving_consistent()
        self._elastic_consistent()
        if self.tune_trials and self.tune_max_failed >= self.tune_trials:
            raise ValueError(
                f"tune_max_failed ({self.tune_max_failed}) must be below tune_trials "
                f"({self.tune_trials})"
            )
        return self

    @property
    def nproc_follows_gpus(self) -> bool:
        """nproc_per_node was left at 0 (auto) with no GPUs asked for (gpus_per_node 0): a
        local run gives it one process per GPU of the machine (`with_local_gpus`)."""
        return "nproc_per_node" not in self.model_fields_set and not self.gpus_per_node

    def with_local_gpus(self, gpus: int) -> PipelineConfig:
        """This config on a machine with `gpus` visible CUDA devices, for a local run (the
        machine that validates it is the one that trains): an auto nproc_per_node becomes
        one process per GPU, its auto pod sizes follow; an explicit nproc_per_node or
        gpus_per_node wins, and without GPUs nothing changes (CPU_NPROC processes)."""
        if not (gpus and self.nproc_follows_gpus) or gpus == self.nproc_per_node:
            return self
        auto = {name: "" for name in ("job_cpu", "job_memory") if name not in self.model_fields_set}
        try:
            return validate(PipelineConfig, {**self.model_dump(), **auto, "nproc_per_node": gpus})
        except ConfigError as err:
            raise ConfigError(
                f"{err} (nproc_per_node=0: one process per GPU, {gpus} on this machine; set "
                "nproc_per_node or batch_size)"
            ) from None

    def context_length(self) -> int:
        """max_position_embeddings of the model a run trains from config (no base_model;
        kubellm.stages.configs.model_shape): the longest context it can serve."""
        return max(MIN_CONTEXT, self.seq_len)

    def _elastic_consistent(self) -> None:
        """An elastic job is the Training Operator's PyTorchJob elasticPolicy: refused where
        no PyTorchJob runs the training, and a minimum above the job's size."""
        if not self.elastic_min_nodes:
            return
        if self.trainer_backend != "pytorchjob":
            raise ValueError(
                f"elastic_min_nodes={self.elastic_min_nodes} needs trainer_backend=pytorchjob: "
                "an elastic job is the Training Operator v1 PyTorchJob's elasticPolicy, which "
                f"a Trainer v2 TrainJob (trainer_backend={self.trainer_backend}) does not have"
            )
        if self.platform != "kubernetes":
            raise ValueError(
                f"elastic_min_nodes={self.elastic_min_nodes} needs platform=kubernetes (a "
                f"PyTorchJob's elasticPolicy); platform={self.platform} runs one torchrun on "
                "this machine"
            )
        if self.elastic_min_nodes > self.num_nodes:
            raise ValueError(
                f"elastic_min_nodes ({self.elastic_min_nodes}) is above num_nodes "
                f"({self.num_nodes}), the elastic job's maxReplicas"
            )

    def _serving_consistent(self) -> None:
        """Serving settings the runtime would refuse at load, or ignore, refused here."""
        huggingface = self.serving_runtime == "huggingface" and self.platform == "kubernetes"
        asked = {
            "serving_dtype": self.serving_dtype != CHECKPOINT_DTYPE,
            "serving_max_model_len": self.serving_max_model_len > 0,
        }
        for name in (n for n, on in asked.items() if on):
            if not huggingface:
                raise ValueError(
                    f"{name}={getattr(self, name)} needs KServe's Hugging Face runtime "
                    "(serving_runtime=huggingface, platform=kubernetes): `kubellm serve` (the "
                    f"custom runtime and the local server) loads the checkpoint as it is "
                    f"({CHECKPOINT_DTYPE}, the model's own context)"
                )
        length = self.serving_max_model_len
        if length and length < self.seq_len:
            raise ValueError(
                f"serving_max_model_len ({length}) is below seq_len ({self.seq_len}): the "
                "server would refuse prompts as long as those the model was trained and "
                "evaluated on"
            )
        if length and not self.base_model and length > self.context_length():
            # vLLM and huggingfaceserver (utils.py _get_and_verify_max_len) refuse a
            # max_model_len above the model's max_position_embeddings
            raise ValueError(
                f"serving_max_model_len ({length}) is above the model's context "
                f"({self.context_length()}, max_position_embeddings of the model trained from "
                "seq_len); the runtime refuses to load it"
            )


_M = typing.TypeVar("_M", bound=BaseModel)


def _describe_allowed(model: type[BaseModel], name: str) -> str:
    field = model.model_fields[name]
    ann = field.annotation
    if typing.get_origin(ann) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(ann))
    bounds = []
    for meta in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            val = getattr(meta, attr, None)
            if val is not None:
                bounds.append(f"{sym} {val}")
        pattern = getattr(meta, "pattern", None)
        if pattern:
            bounds.append(f"matching {pattern}")
    kind = getattr(ann, "__name__", str(ann))
    return f"{kind} " + " and ".join(bounds) if bounds else kind


def _error_line(model: type[BaseModel], err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    name = str(first["loc"][0]) if first["loc"] else ""
    got = first.get("input")
    if first["type"] == "extra_forbidden":
        allowed = ", ".join(model.model_fields)
        return f"unknown parameter '{loc}'; allowed parameters: {allowed}"
    if name in model.model_fields:
        return f"invalid {loc}={got!r}: {first['msg']}; allowed: {_describe_allowed(model, name)}"
    return f"invalid configuration: {first['msg'].removeprefix('Value error, ')}"


def validate(model: type[_M], values: dict[str, Any]) -> _M:
    """Build a config model, turning pydantic's report into one line that names the field."""
    try:
        return model.model_validate(values)
    except ValidationError as err:
        raise ConfigError(_error_line(model, err)) from None


def parse_overrides(pairs: list[str], model: type[BaseModel] = PipelineConfig) -> dict[str, Any]:
    """Parse `key=value` strings; values are JSON when they parse as JSON, else strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {pair!r} is not key=value")
        if key not in model.model_fields:
            allowed = ", ".join(model.model_fields)
            raise ConfigError(f"unknown parameter '{key}'; allowed parameters: {allowed}")
        if model.model_fields[key].annotation is str:  # text is text: `--set model_name=123`
            out[key] = raw
            continue
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key] = value
    return out


def pipeline_config(overrides: dict[str, Any] | None = None, **fixed: Any) -> PipelineConfig:
    """The pipeline config from defaults, overrides and fixed values (fixed wins)."""
    return validate(PipelineConfig, {**(overrides or {}), **fixed})
