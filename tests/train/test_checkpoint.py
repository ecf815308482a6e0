"""Checkpoints: exact resume (the torchtitan test) for DDP and FSDP2, fallback past a broken one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainkit import step_losses, tiny_config, write_config

from kubellm.backends.base import TrainJob
from kubellm.backends.local.torchrun import TorchrunTrainer
from kubellm.train.checkpoint import MARKER, complete_checkpoints

pytestmark = pytest.mark.slow
STEPS = 8


def _run(tmp: Path, name: str, dataset: Path, **values) -> str:
    cfg = tiny_config(dataset, tmp / f"{name}-model", steps=STEPS, **values)
    path = write_config(tmp / f"{name}.json", cfg)
    job = TrainJob(name=name, train_args=["--config", str(path)], nproc_per_node=2)
    return TorchrunTrainer(echo=False).run(job).logs


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_is_bit_exact(strategy: str, tiny_dataset: Path, tmp_path: Path) -> None:
    straight = _run(tmp_path, "straight", tiny_dataset, strategy=strategy)
    assert f"strategy={strategy}" in straight
    ckpt = tmp_path / "ckpt"
    first = _run(
        tmp_path,
        "resumed",
        tiny_dataset,
        strategy=strategy,
        checkpoint_dir=str(ckpt),
        stop_after=STEPS // 2,
    )
    assert f"stopped after step {STEPS // 2}" in first
    assert [p.name for p in complete_checkpoints(ckpt)] == [f"step-{STEPS // 2:08d}"]
    second = _run(tmp_path, "resumed", tiny_dataset, strategy=strategy, checkpoint_dir=str(ckpt))
    assert f"resumed from {ckpt}/step-{STEPS // 2:08d} at step {STEPS // 2}" in second
    losses = step_losses(straight)
    assert len(losses) == STEPS
    assert {**step_losses(first), **step_losses(second)} == losses
    a = load_file(tmp_path / "straight-model" / "model.safetensors")
    b = load_file(tmp_path / "resumed-model" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_broken_checkpoint_is_skipped_for_the_previous_one(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    _run(
        tmp_path,
        "a",
        tiny_dataset,
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
    logs = _run(tmp_path, "a", tiny_dataset, checkpoint_dir=str(ckpt))
    assert "checkpoint" in logs and "cannot be loaded" in logs
    assert f"resumed from {ckpt}/step-00000004 at step 4" in logs
    assert (ckpt / "step-00000004" / MARKER).is_file()
