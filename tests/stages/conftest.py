"""The stages, called directly (no KFP), with the real local backends: torchrun, optuna, the
loopback KServe ModelServer and MLflow on sqlite, on a tiny model and data set.

The chain is session-scoped and runs each stage once, in DAG order; each test module
asserts one stage's typed Result and what it left in MLflow.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kubellm.backends.local.model_server import LocalModelServer
from kubellm.config import PipelineConfig
from kubellm.stages import deploy, evaluate, preflight, prepare_data, register, train, tune
from kubellm.stages.context import StageContext

RUN = "stage-test"
TINY = dict(
    platform="local",
    num_records=600,
    vocab_size=300,
    seq_len=16,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    tune_trials=1,
    tune_steps=6,
    train_steps=30,
    batch_size=8,
    nproc_per_node=1,
    gate_min_accuracy=0.0,
    model_name="tiny-stage",
)


@dataclass
class Chain:
    """What the stages returned so far, and where their artifacts are."""

    root: Path
    params: dict[str, Any]
    ctx: StageContext | None = None
    results: dict[str, Any] = field(default_factory=dict)

    def artifact(self, name: str) -> Path:
        return self.root / "artifacts" / name


@pytest.fixture(scope="session")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    root = tmp_path_factory.mktemp("stages")
    params = PipelineConfig.model_validate({**TINY, "runs_dir": str(root / "runs")}).model_dump()
    c = Chain(root, params)
    pre = preflight.run(params, RUN)
    c.results["preflight"] = pre
    c.ctx = StageContext.load(pre.config, pre.parent_run_id, RUN)
    c.results["prepare_data"] = prepare(c.ctx, c.artifact("dataset"))
    c.results["tune"] = tune.run(c.ctx, c.artifact("dataset"))
    hparams = c.results["tune"].hparams_json
    c.results["train"] = train.run(c.ctx, c.artifact("dataset"), hparams, str(c.artifact("model")))
    c.results["evaluate"] = evaluate.run(
        c.ctx,
        c.artifact("model"),
        c.artifact("dataset"),
        str(c.artifact("predictions.json")),
        str(c.artifact("report.html")),
    )
    c.results["register"] = register.run(c.ctx, c.artifact("model"))
    c.results["deploy"] = deploy.run(c.ctx, c.artifact("model"), c.results["register"].version)
    yield c
    LocalModelServer(root / "runs" / "servers").release(RUN)  # even when a test failed midway


@pytest.fixture(scope="session")
def ctx(chain: Chain) -> StageContext:
    assert chain.ctx is not None
    return chain.ctx


def prepare(ctx: StageContext, out_dir: Path) -> Any:
    """prepare_data as the DAG runs it: build from preflight's data_spec, then record."""
    from kubellm.stages import record_data
    from kubellm.stages.configs import data_spec

    prepare_data.run(data_spec(ctx.cfg), out_dir)
    return record_data.run(ctx, out_dir)


def side_context(ctx: StageContext, run: str, **update: Any) -> StageContext:
    """A context for a stage rerun under its own pipeline run `run` (its own parent), so
    that it leaves the chain's stage runs and parent alone; `update` changes the config."""
    from kubellm.tracking import Tracker

    tracker = Tracker(ctx.tracker.client, ctx.tracker.experiment_id, run)
    parent = tracker.start_parent(run, {})
    return StageContext(ctx.cfg.model_copy(update=update), tracker, parent, run)


@pytest.fixture
def champion_v1(chain: Chain, ctx: StageContext) -> Iterator[str]:
    """The chain's registered version as the champion, for one test."""
    from kubellm.tracking import CHAMPION

    client, name = ctx.tracker.client, ctx.cfg.model_name
    version = str(chain.results["register"].version)
    client.set_registered_model_alias(name, CHAMPION, version)
    try:
        yield version
    finally:
        client.delete_registered_model_alias(name, CHAMPION)
