"""The training recipe of a pipeline run: everything besides the data that decides what
model a run makes and how it is judged, as one fingerprint.

A recurring run skips training only when both the data (kubellm.data.artifact's data
fingerprint) and this recipe match what the champion was trained with; a change of
train_steps, learning_rate, base_model, LoRA, the trainer image, the evaluation data or
the kubellm release retrains. Every PipelineConfig field is classified below, once:

- DATA_FIELDS: what prepare_data makes of the sources; the data fingerprint covers them.
- GATE_FIELDS: how the gate judges a candidate. They do not change the model, so they are
  not part of the recipe; record_data compares them (with the champion) only when a
  data+recipe was rejected before: a looser gate is a reason to try again.
- OPERATIONAL_FIELDS: where and how a run goes (names, URIs, namespaces, resources,
  placement, the network, serving and deployment), not what it trains.
- everything else is the recipe (RECIPE_FIELDS lists it, and tests/stages/test_recipe.py
  checks that the list and the exclusions cover PipelineConfig exactly). A field nobody
  classified counts as recipe: a new parameter retrains rather than being ignored.

`base_model` and `eval_data` count by what they hold when they are local: a local
base_model directory by its files (small files by content, weight files over 16 MiB by
size and their first and last MiB), a local eval_data file by its content; a hub name or
a URI counts by name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubellm import __version__
from kubellm.config import PipelineConfig

# Parameters prepare_data reads (stages/configs.py prepare_params): in the data fingerprint.
DATA_FIELDS = frozenset(
    {
        "data_source",
        "data_format",
        "text_field",
        "template",
        "chat_loss",
        "tokenizer",
        "packing",
        "near_dedup",
        "on_error",
        "mask_prompt",
        "num_records",
        "val_fraction",
        "vocab_size",
    }
)
# How the gate judges (stages/evaluate.py decide): not the model's.
GATE_FIELDS = frozenset(
    {
        "gate_min_accuracy",
        "gate_metric",
        "gate_margin",
        "gate_max_perplexity",
        "gate_guards",
        "gate_allow_incomparable",
    }
)
# Where and how a run goes, not what it trains.
OPERATIONAL_FIELDS = frozenset(
    {
        "platform",
        "slurm_partition",
        "slurm_account",
        "force",
        "pipeline_version",  # the compiled YAML; the code is kubellm's version, below
        "model_name",
        "experiment_name",
        "allow_http_sources",  # what a source may be, not what it holds (the data's digest)
        "mlflow_tracking_uri",
        "runs_dir",
        "namespace",
        "workspace_pvc",
        # serving and deployment: the model is the same whatever serves it
        "serving_image",
        "serving_runtime",
        "canary_traffic_percent",
        "serving_cpu",
        "serving_memory",
        "serving_gpus",
        "serving_min_replicas",
        "serving_max_replicas",
        "serving_max_model_len",
        "serving_node_selector",
        "serving_tolerations",
        "serving_service_account",
        "serving_cluster_local",
        "smoke_timeout_seconds",
        # resources, placement, scheduling, the network: how fast, not what
        "job_timeout_minutes",
        "job_cpu",
        "job_memory",
        "job_max_restarts",
        "elastic_min_nodes",
        "elastic_max_restarts",
        "step_cpu",
        "step_memory",
        "shm_size",
        "evaluate_cpu",
        "evaluate_memory",
        "evaluate_gpus",
        "register_cpu",
        "register_memory",
        "node_selector",
        "tolerations",
        "priority_class",
        "queue",
        "gang_scheduler",
        "trainer_backend",
        "job_ttl_hours",
        "job_grace_seconds",
        "fabric",
        "rdma_resource",
        "rdma_count",
        "network_annotation",
        "nccl_env",
        "min_busbw_gbps",
    }
)
# What the recipe holds, by name (derived below from PipelineConfig; this list is the
# documentation, and the test that keeps it equal to the derived set).
RECIPE_FIELDS = frozenset(
    {
        # the model: from config or a base model, its shape, LoRA
        "base_model",
        "trust_remote_code",
        "hidden_size",
        "num_layers",
        "num_heads",
        "seq_len",  # also the data's; the model's context follows it
        "lora_r",
        # optimisation
        "seed",  # also the data's; model init and data order
        "train_steps",
        "batch_size",
        "learning_rate",
        "strategy",
        "precision",
        # topology and image: the numerics (precision auto follows the GPUs) and the code
        "nproc_per_node",
        "num_nodes",
        "gpus_per_node",
        "trainer_image",
        "runtime_image",  # the image of the tune, train and evaluate steps
        # tuning: what the search tries decides the learning rate trained with
        "tune_trials",
        "tune_steps",
        "tune_algorithm",
        "tune_parallel",
        "tune_max_failed",
        "tune_early_stopping",
        # evaluation: what the candidate is measured on, and in which dtype
        "eval_data",
        "serving_dtype",
    }
)
NOT_RECIPE = DATA_FIELDS | GATE_FIELDS | OPERATIONAL_FIELDS
# Weight files are hashed by size and their ends (reading GBs each run is not worth it).
_WHOLE_FILE_BYTES = 16 * 2**20
_END_BYTES = 2**20


def recipe_fields(model: type[PipelineConfig] = PipelineConfig) -> list[str]:
    """The config fields of the recipe: all but the excluded ones, in config order."""
    return [name for name in model.model_fields if name not in NOT_RECIPE]


def _file_digest(path: Path, whole: bool = True) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f:
        if whole or size <= _WHOLE_FILE_BYTES:
            for block in iter(lambda: f.read(2**20), b""):
                h.update(block)
        else:
            h.update(f"{size}".encode())
            h.update(f.read(_END_BYTES))
            f.seek(size - _END_BYTES)
            h.update(f.read(_END_BYTES))
    return h.hexdigest()


def content_digest(ref: str, whole: bool = True) -> str:
    """A local file's or directory's content digest; '' for anything else (a hub name, a
    URI: they count by name). `whole=False`: files over 16 MiB by size and ends."""
    if not ref or "://" in ref:
        return ""
    path = Path(ref)
    if path.is_file():
        return _file_digest(path, whole)
    if not path.is_dir():
        return ""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode())
        h.update(_file_digest(f, whole).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Recipe:
    """The recipe's settings (field -> value, as MLflow params show them), the digests of
    a local base_model and eval_data, the kubellm release, and their fingerprint."""

    settings: dict[str, str]
    base_model_digest: str
    eval_data_digest: str
    kubellm_version: str
    fingerprint: str

    def params(self) -> dict[str, str]:
        """What the prepare_data MLflow run records as its `recipe.*` params."""
        out = {f"recipe.{k}": v for k, v in self.settings.items()}
        out["recipe.kubellm_version"] = self.kubellm_version
        if self.base_model_digest:
            out["recipe.base_model_digest"] = self.base_model_digest
        if self.eval_data_digest:
            out["recipe.eval_data_digest"] = self.eval_data_digest
        return out

    def describe(self) -> str:
        """'24 training settings, base_model none, eval_data none, kubellm 0.1.0'."""

        def named(field: str, digest: str) -> str:
            value = self.settings.get(field, "")
            if not value:
                return f"{field} none"
            return f"{field} {value}" + (f" (content {digest[:8]})" if digest else "")

        count = len([k for k in self.settings if k not in ("base_model", "eval_data")])
        return (
            f"{count} training settings, {named('base_model', self.base_model_digest)}, "
            f"{named('eval_data', self.eval_data_digest)}, kubellm {self.kubellm_version}"
        )


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def recipe_of(cfg: PipelineConfig, kubellm_version: str = __version__) -> Recipe:
    settings = {name: _shown(getattr(cfg, name)) for name in recipe_fields(type(cfg))}
    base = content_digest(cfg.base_model, whole=False)
    evals = content_digest(cfg.eval_data)
    h = hashlib.sha256()
    body = {
        "settings": settings,
        "base_model": base,
        "eval_data": evals,
        "kubellm": kubellm_version,
    }
    h.update(json.dumps(body, sort_keys=True).encode())
    return Recipe(settings, base, evals, kubellm_version, h.hexdigest())


def changed(old: dict[str, str], new: dict[str, str], most: int = 4) -> str:
    """What differs between two recipes' `recipe.*` params: 'train_steps 30 -> 31, ...'."""
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    parts = [
        f"{k.removeprefix('recipe.')} {_short(old.get(k, '-'))} -> {_short(new.get(k, '-'))}"
        for k in keys[:most]
    ]
    more = len(keys) - most
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def _short(value: str) -> str:
    return value if len(value) <= 40 else value[:16] + "…" + value[-16:]


def gate_fingerprint(cfg: PipelineConfig, champion: str) -> str:
    """The gate's settings and the champion it compares with (the model's name and the
    champion's version, '' for none): a data+recipe rejected under these is rejected
    again; under others it may pass."""
    body = {name: _shown(getattr(cfg, name)) for name in sorted(GATE_FIELDS)}
    body["champion"] = f"{cfg.model_name} v{champion}" if champion else cfg.model_name
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
