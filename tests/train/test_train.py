"""The training entrypoint under real torchrun (2 processes, gloo) and the local trainer."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kubellm.backends.base import JobFailed, JobTimeout, TrainJob
from kubellm.backends.local.torchrun import TorchrunTrainer
from kubellm.config import TrainConfig
from kubellm.train.loader import batch_indices
from kubellm.train.loop import lr_factor, main


@pytest.fixture
def dataset(tiny_dataset: Path) -> Path:
    return tiny_dataset


def _job(tmp: Path, name: str, nproc: int = 2, timeout_s: float = 300, **values) -> TrainJob:
    cfg = TrainConfig(
        **{
            "steps": 6,
            "batch_size": 8,
            "log_every": 2,
            "eval_batches": 2,
            "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
            **values,
        }
    )
    path = tmp / f"{name}.json"
    path.write_text(cfg.model_dump_json())
    return TrainJob(
        name=name, train_args=["--config", str(path)], nproc_per_node=nproc, timeout_s=timeout_s
    )


def test_ddp_run_prints_metrics_and_exports_a_loadable_model(dataset: Path, tmp_path: Path):
    out = tmp_path / "model"
    result = TorchrunTrainer(echo=False).run(
        _job(tmp_path, "ddp", dataset_dir=str(dataset), output_dir=str(out))
    )
    assert "world_size=2" in result.logs
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "eval_loss", "perplexity"):
        assert key in result.metrics
    assert 0 < result.metrics["mfu"] < 1
    assert result.metrics["step"] == 6
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not list(out.glob("*.bin")), "weights must be safetensors"
    model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True)
    assert model.config.num_hidden_layers == 1
    assert not out.with_name("model.tmp").exists()


def test_same_seed_same_result(dataset: Path, tmp_path: Path) -> None:
    runs = [
        TorchrunTrainer(echo=False).run(
            _job(tmp_path, f"r{i}", dataset_dir=str(dataset), output_dir=str(tmp_path / f"m{i}"))
        )
        for i in range(2)
    ]
    assert runs[0].metrics["eval_loss"] == runs[1].metrics["eval_loss"]


BAD_CONFIGS = [
    ({"batch_size": 7}, "batch_size=7: must be divisible by WORLD_SIZE x grad_accum_steps"),
    ({"strategy": "zero3"}, "invalid strategy='zero3'"),
    ({"dataset_dir": "/nonexistent"}, "dataset_dir='/nonexistent'"),
    ({"model": {"max_position_embeddings": 8}}, "max_position_embeddings=8"),
    ({"--set": "stratgy=ddp"}, "unknown parameter 'stratgy'"),
]


RANK_0_OF_2 = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


def _bad_args(dataset: Path, tmp_path: Path, values: dict) -> list[str]:
    """The worker's arguments for one of BAD_CONFIGS."""
    base = {"dataset_dir": str(dataset), "output_dir": str(tmp_path / "m")}
    if "--set" in values:
        return [*_job(tmp_path, "bad", **base).train_args, "--set", values["--set"]]
    if "strategy" in values:  # an invalid value cannot go through TrainConfig: raw JSON
        path = tmp_path / "bad.json"
        raw = json.loads(Path(_job(tmp_path, "bad", **base).train_args[1]).read_text())
        path.write_text(json.dumps({**raw, "strategy": values["strategy"]}))
        return ["--config", str(path)]
    if "model" in values:
        model = {"hidden_size": 32, "num_heads": 2, "num_layers": 1, "intermediate_size": 64}
        values = {"model": {**model, **values["model"]}}
    return _job(tmp_path, "bad", **{**base, **values}).train_args


@pytest.mark.parametrize(("values", "fragment"), BAD_CONFIGS)
def test_bad_config_fails_before_the_process_group(
    dataset: Path,
    tmp_path: Path,
    values: dict,
    fragment: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The worker's main as rank 0 of 2 (torchrun's environment, in this process): exit 2
    and the reason, before the process group (which, with no MASTER_ADDR, would fail with
    another error). Under torchrun: the next test."""
    for name, value in RANK_0_OF_2.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert main(_bad_args(dataset, tmp_path, values)) == 2
    assert fragment in capsys.readouterr().err


def test_a_bad_config_fails_the_torchrun_job_with_exit_2_and_the_reason(
    dataset: Path, tmp_path: Path
) -> None:
    values, fragment = BAD_CONFIGS[0]  # WORLD_SIZE comes from torchrun's 2 processes
    job = TrainJob(name="bad", train_args=_bad_args(dataset, tmp_path, values), nproc_per_node=2)
    with pytest.raises(JobFailed, match="exit code 2") as info:
        TorchrunTrainer(echo=False).run(job)
    assert fragment in str(info.value)


def test_timeout_kills_the_job(tmp_path: Path) -> None:
    script = tmp_path / "sleepy.py"
    script.write_text("import time\ntime.sleep(60)\n")
    # the worker finds `sleepy` through its environment; this process's sys.path is untouched
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    job = TrainJob(
        name="sleepy", module="sleepy", train_args=[], timeout_s=2, env={"PYTHONPATH": path}
    )
    started = time.monotonic()
    with pytest.raises(JobTimeout, match="still running after 2s"):
        TorchrunTrainer(echo=False).run(job)
    assert time.monotonic() - started < 30, "the job was not killed at its timeout"


def test_multi_node_is_refused_locally() -> None:
    with pytest.raises(JobFailed, match="multi-node training needs platform=kubernetes"):
        TorchrunTrainer().run(TrainJob(name="x", train_args=[], nnodes=2))


def test_batches_are_exact_and_cover_an_epoch() -> None:
    seen = torch.cat([batch_indices(100, s, 10, seed=3) for s in range(10)])
    assert sorted(seen.tolist()) == list(range(100))
    assert torch.equal(batch_indices(100, 4, 10, 3), batch_indices(100, 4, 10, 3))
    assert not torch.equal(batch_indices(100, 10, 10, 3), batch_indices(100, 0, 10, 3))


def test_lr_schedule_warms_up_then_decays() -> None:
    assert lr_factor(0, 10, 100) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100) == pytest.approx(1.0)
    assert lr_factor(99, 10, 100) == pytest.approx(0.1, abs=0.01)
    mid = lr_factor(50, 10, 100)  # cosine: 40 of the 90 decay steps done
    assert type(mid) is float  # a plain float (logged and serialized as is), not a tensor
    assert mid == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 40 / 90)))
    decay = [lr_factor(s, 10, 100) for s in range(10, 100)]
    assert all(a > b for a, b in itertools.pairwise(decay)), "decay is not monotone"
    assert lr_factor(150, 10, 100) == pytest.approx(0.1)  # past the end: the floor, not below


def test_a_1500_step_run_logs_at_least_100_loss_points(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 25: with the train stage's log_every, 1,500 real steps print (and send to
    MLflow: the same points, kubellm.train.loop `_emit`) 100 losses, the last at the last
    step; `steps // 10` gave 10. In-process, one rank: about 10 s on two cores."""
    from trainkit import step_losses, tiny_config

    from kubellm.stages.train import log_every_for
    from kubellm.train.loop import train

    cfg = tiny_config(
        dataset, tmp_path / "m", steps=1500, log_every=log_every_for(1500), eval_batches=1
    )
    train(cfg)
    captured = capsys.readouterr()
    losses = step_losses(captured.out)
    assert len(losses) >= 100 and max(losses) == 1500
    # ...while the progress line stays at about one per 10 %, as it was
    progress = re.findall(r"train: (\d+)/1500 steps", captured.out + captured.err)
    assert [int(n) for n in progress] == list(range(150, 1501, 150)), progress
