"""Checkpoints: exact resume (the torchtitan test) for DDP and FSDP2, fallback past a broken one;
the asynchronous Checkpointer: what is written is the state at save time, commit only on wait,
old checkpoints deleted off the critical path, LoRA's frozen base neither written nor needed."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ckpt_worker import (
    fsdp_round_trip,
    full_state,
    mismatches,
    optimizer,
    tensor_leaves,
    tiny_model,
    train,
)
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _FileSystemWriter
from trainkit import step_losses, tiny_config, write_config

from kubellm.backends.base import TrainJob
from kubellm.backends.local.torchrun import TorchrunTrainer
from kubellm.train.checkpoint import (
    MARKER,
    TRAINER_STATE,
    Checkpointer,
    complete_checkpoints,
    is_replicated,
    replicated_share,
)

STEPS = 8


def _run(tmp: Path, name: str, dataset: Path, **values) -> str:
    cfg = tiny_config(dataset, tmp / f"{name}-model", steps=STEPS, **values)
    path = write_config(tmp / f"{name}.json", cfg)
    job = TrainJob(name=name, train_args=["--config", str(path)], nproc_per_node=2)
    return TorchrunTrainer(echo=False).run(job).logs


@pytest.mark.slow
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


@pytest.mark.slow
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


# The asynchronous Checkpointer, in this process (a one-rank gloo group, so the writes really
# are asynchronous) and on two FSDP2 ranks.


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group for the test."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Gate:
    """Holds every DCP shard write until opened; records whether a write was held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.writing = threading.Event()
        self.threads: list[str] = []
        original = _FileSystemWriter.write_data

        def held(writer: Any, *args: Any, **kwargs: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            self.writing.set()
            assert self.opened.wait(timeout=30), "the write was never released"
            return original(writer, *args, **kwargs)

        monkeypatch.setattr(_FileSystemWriter, "write_data", held)


def test_async_save_writes_the_state_at_save_time(
    group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _Gate(monkeypatch)
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, rank=0, keep=2)
    model = tiny_model()
    opt = optimizer(model)
    train(model, opt, 3, seed=1)
    at_3 = full_state(model, opt)
    trainer: dict[str, Any] = {"loader": {"position": 3}, "rng": torch.get_rng_state()}

    path = ckpt.save(3, model, opt, trainer)  # returns with its write held by the gate
    assert path == root / "step-00000003"
    assert gate.writing.wait(timeout=30)
    assert gate.threads and gate.threads[0] != threading.current_thread().name
    trainer["loader"]["position"] = 99  # the training goes on with its state...
    train(model, opt, 3, seed=2)  # ...and its parameters and optimizer moments
    assert mismatches(full_state(model, opt), at_3)
    gate.opened.set()
    assert (root / "step-00000003.tmp").is_dir()
    assert complete_checkpoints(root) == [] and not path.exists()  # not committed before wait

    assert ckpt.wait() == path
    assert (path / MARKER).is_file() and (path / TRAINER_STATE).is_file()
    assert not (root / "step-00000003.tmp").exists()
    assert ckpt.wait() is None  # nothing in flight any more
    fresh = tiny_model(seed=7)
    fresh_opt = optimizer(fresh)
    resumed = ckpt.load_latest(fresh, fresh_opt)
    assert resumed is not None and resumed.path == path
    assert mismatches(full_state(fresh, fresh_opt), at_3) == []
    assert resumed.trainer["step"] == 3 and resumed.trainer["loader"] == {"position": 3}
    assert torch.equal(resumed.trainer["rng"], trainer["rng"])
    ckpt.close()


def test_poll_commits_a_finished_write_before_wait(group: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, rank=0, keep=2)
    model = tiny_model()
    opt = optimizer(model)
    train(model, opt, 1, seed=1)
    path = ckpt.save(1, model, opt, {})
    assert ckpt.pending == path
    for _ in range(3000):
        if (committed := ckpt.poll()) is not None:
            break
        threading.Event().wait(0.01)
    assert committed == path and (path / MARKER).is_file()
    assert ckpt.poll() is None  # committed once
    assert ckpt.close() == path and ckpt.pending is None
    assert complete_checkpoints(root) == [path]


def test_old_checkpoints_are_deleted_in_the_background(
    group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    deleting: list[tuple[Path, str]] = []
    rmtree = shutil.rmtree

    def slow_rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith(".deleting"):
            deleting.append((Path(path), threading.current_thread().name))
            assert release.wait(timeout=30), "the deletion was never released"
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, rank=0, keep=1)
    model = tiny_model()
    opt = optimizer(model)
    first = ckpt.save(1, model, opt, {})
    train(model, opt, 1, seed=1)
    second = ckpt.save(2, model, opt, {})  # commits step 1: nothing to delete yet
    assert complete_checkpoints(root) == [first]
    assert ckpt.wait() == second  # commits step 2, step 1 goes, while its rmtree is held
    assert complete_checkpoints(root) == [second]
    assert not first.exists()  # renamed out of the way at once: never listed, never loaded
    aside = [p for p in root.iterdir() if p.name.startswith("step-00000001.")]
    assert len(aside) == 1 and aside[0].name.endswith(".deleting")
    for _ in range(3000):  # the thread has started and is stuck in the slow rmtree
        if deleting:
            break
        threading.Event().wait(0.01)
    assert deleting == [(aside[0], "checkpoint-delete")]
    assert aside[0].is_dir()  # save and wait returned before the deletion finished
    release.set()
    ckpt.close()
    assert sorted(p.name for p in root.iterdir()) == [second.name]
    fresh = tiny_model(seed=7)
    fresh_opt = optimizer(fresh)
    resumed = ckpt.load_latest(fresh, fresh_opt)
    assert resumed is not None and resumed.path == second


def test_frozen_parameters_are_neither_saved_nor_needed(group: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, rank=0, keep=2, skip_frozen=True)
    model = tiny_model(frozen=True)
    opt = optimizer(model)
    train(model, opt, 2, seed=1)
    at_2 = full_state(model, opt)
    path = ckpt.save(2, model, opt, {})
    train(model, opt, 2, seed=2)
    assert ckpt.close() == path
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert "model.2.weight" in keys and "model.2.bias" in keys
    assert "optim.state.2.weight.exp_avg" in keys
    frozen = [k for k in keys if k.startswith(("model.0.", "optim.state.0."))]
    assert frozen == [], sorted(keys)

    fresh = tiny_model(seed=7, frozen=True)  # the 'pretrained' base loaded at start-up
    start = {k: v.clone() for k, v in fresh.state_dict().items()}
    fresh_opt = optimizer(fresh)
    assert ckpt.load_latest(fresh, fresh_opt) is not None
    got = full_state(fresh, fresh_opt)
    assert mismatches(got["optim"], at_2["optim"]) == []
    assert torch.equal(got["model"]["0.weight"], start["0.weight"])
    assert torch.equal(got["model"]["0.bias"], start["0.bias"])
    assert torch.equal(got["model"]["2.weight"], at_2["model"]["2.weight"])
    assert torch.equal(got["model"]["2.bias"], at_2["model"]["2.bias"])

    full = Checkpointer(tmp_path / "full", rank=0, keep=2)  # without skip_frozen: all of it
    path = full.save(1, model, opt, {})
    full.close()
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert "model.0.weight" in keys and "optim.state.2.weight.exp_avg" in keys


def test_uncommitted_and_broken_checkpoints_are_never_loaded(group: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, rank=0, keep=5)
    model = tiny_model()
    opt = optimizer(model)
    train(model, opt, 1, seed=1)
    at_1 = full_state(model, opt)
    ckpt.save(1, model, opt, {})
    train(model, opt, 1, seed=2)
    newest = ckpt.save(2, model, opt, {})
    train(model, opt, 1, seed=3)
    ckpt.save(3, model, opt, {})  # a run that died before committing step 3
    ckpt.wait()  # ...except that here it did commit: make it look uncommitted again
    (root / "step-00000003").rename(root / "step-00000003.tmp")
    next(newest.glob("*.distcp")).unlink()  # and step 2 lost a shard
    (root / "step-00000000.1234abcd.deleting").mkdir()  # a deletion that was cut short
    fresh = tiny_model(seed=7)
    fresh_opt = optimizer(fresh)
    again = Checkpointer(root, rank=0, keep=5)  # start-up clears the .tmp and .deleting
    resumed = again.load_latest(fresh, fresh_opt)
    assert resumed is not None and resumed.path == root / "step-00000001"
    assert mismatches(full_state(fresh, fresh_opt), at_1) == []
    again.close()
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]


def test_without_a_process_group_the_save_is_synchronous(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, rank=0, keep=1)
    model = tiny_model()
    opt = optimizer(model)
    at_0 = full_state(model, opt)
    path = ckpt.save(5, model, opt, {"x": 1})
    assert (root / "step-00000005.tmp" / ".metadata").is_file()  # written already
    assert complete_checkpoints(root) == []  # but committed by wait
    assert ckpt.close() == path
    fresh = tiny_model(seed=7)
    fresh_opt = optimizer(fresh)
    resumed = ckpt.load_latest(fresh, fresh_opt)
    assert resumed is not None and resumed.trainer == {"step": 5, "x": 1}
    assert mismatches(full_state(fresh, fresh_opt), at_0) == []


def test_a_replicated_state_is_dealt_out_in_whole_parameters_each_once() -> None:
    """DDP's state: each rank hands DCP only its share (ddp_round_trip checks it on 2 ranks)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = tiny_model()
    opt = optimizer(model)
    train(model, opt, 1, seed=1)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    assert is_replicated(state)
    shares = [replicated_share(state, rank, 3) for rank in range(3)]
    keys = sorted(k for share in shares for k, _ in tensor_leaves(share))
    assert keys == sorted(k for k, _ in tensor_leaves(state))  # all of it, each tensor once
    for share in shares:  # a weight travels with its optimizer state
        assert sorted(share["model"]) == sorted(share["optim"]["state"])
    by_size = [["0.weight"], ["2.weight"], ["0.bias", "2.bias"]]  # largest first, least loaded
    assert [sorted(s["model"]) for s in shares] == by_size
    assert ["param_groups" in s["optim"] for s in shares] == [True, False, False]
    assert shares[0]["model"]["0.weight"] is model_sd["0.weight"]  # no copy: DCP stages it


def test_a_sharded_state_is_not_replicated(group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Shard(0)])
    assert not is_replicated({"model": {"w": sharded}, "optim": {"state": {}}})


def test_fsdp2_and_ddp_two_ranks_async_round_trip(tmp_path: Path) -> None:
    """Two gloo ranks: FSDP2 (fsdp_round_trip), then DDP, where each rank stages and writes
    only its share of the replicated state (ddp_round_trip)."""
    mp.spawn(
        fsdp_round_trip,
        args=(2, str(tmp_path / "ckpt"), str(tmp_path / "store")),
        nprocs=2,
        join=True,
    )
