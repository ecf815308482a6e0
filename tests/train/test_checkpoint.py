"""Checkpoints: exact resume (the torchtitan test), atomic commit, fallback past a broken one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kubellm.config import TrainConfig
from kubellm.data.prepare import PrepareParams, prepare
from kubellm.jobs import TrainJob, parse_metrics
from kubellm.train.checkpoint import MARKER, complete_checkpoints
from kubellm.train.torchrun import TorchrunTrainer

pytestmark = pytest.mark.slow
STEPS = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ds")
    prepare(PrepareParams(num_records=2000, vocab_size=300, seq_len=16), out)
    return out


def _run(tmp: Path, name: str, dataset: Path, **values) -> str:
    cfg = TrainConfig(
        dataset_dir=str(dataset),
        output_dir=str(tmp / f"{name}-model"),
        steps=STEPS,
        batch_size=8,
        log_every=1,
        eval_batches=2,
        model={"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
        **values,
    )
    path = tmp / f"{name}.json"
    path.write_text(cfg.model_dump_json())
    job = TrainJob(name=name, train_args=["--config", str(path)], nproc_per_node=2)
    return TorchrunTrainer(echo=False).run(job).logs


def _losses(logs: str) -> dict[int, str]:
    """step -> the loss exactly as printed (6 significant digits, from the all-reduced loss)."""
    out = {}
    for line in logs.splitlines():
        m = parse_metrics(line)
        if "step" in m and "loss" in m:
            out[int(m["step"])] = line.split("loss=")[1].split()[0]
    return out


def test_resume_is_bit_exact_for_ddp(dataset: Path, tmp_path: Path) -> None:
    straight = _run(tmp_path, "straight", dataset)
    ckpt = tmp_path / "ckpt"
    first = _run(tmp_path, "resumed", dataset, checkpoint_dir=str(ckpt), stop_after=STEPS // 2)
    assert f"stopped after step {STEPS // 2}" in first
    assert [p.name for p in complete_checkpoints(ckpt)] == [f"step-{STEPS // 2:08d}"]
    second = _run(tmp_path, "resumed", dataset, checkpoint_dir=str(ckpt))
    assert f"resumed from {ckpt}/step-{STEPS // 2:08d} at step {STEPS // 2}" in second
    losses = _losses(straight)
    assert len(losses) == STEPS
    assert {**_losses(first), **_losses(second)} == losses
    a = load_file(tmp_path / "straight-model" / "model.safetensors")
    b = load_file(tmp_path / "resumed-model" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_broken_checkpoint_is_skipped_for_the_previous_one(dataset: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(
        tmp_path,
        "a",
        dataset,
        checkpoint_dir=str(ckpt),
        checkpoint_every=2,
        stop_after=6,
        keep_checkpoints=5,
    )
    names = [p.name for p in complete_checkpoints(ckpt)]
    assert names == ["step-00000006", "step-00000004", "step-00000002"]
    newest = ckpt / "step-00000006"
    next(newest.glob("*.distcp")).unlink()  # a lost shard
    (ckpt / "step-00000008.tmp").mkdir()  # a writer that died mid-checkpoint: never loaded
    logs = _run(tmp_path, "a", dataset, checkpoint_dir=str(ckpt))
    assert "checkpoint" in logs and "cannot be loaded" in logs
    assert f"resumed from {ckpt}/step-00000004 at step 4" in logs
    assert (ckpt / "step-00000004" / MARKER).is_file()
