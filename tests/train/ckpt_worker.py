"""The checkpoint tests' tiny model and their multi-process (gloo) worker."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.nn.parallel import DistributedDataParallel

from kubellm.train.checkpoint import Checkpointer, complete_checkpoints


def tiny_model(seed: int = 0, frozen: bool = False) -> torch.nn.Sequential:
    """Linear-ReLU-Linear; with `frozen` the first layer is a frozen 'pretrained base'."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if frozen:
        model[0].requires_grad_(False)
    return model


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state as full (unsharded) tensors, copied (collective with FSDP)."""
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return copy.deepcopy({"model": model_sd, "optim": optim_sd})


def mismatches(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two nested states differ (tensors compared exactly); [] when equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        return [m for k in a for m in mismatches(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        pairs = enumerate(zip(a, b, strict=True))
        return [m for i, (x, y) in pairs for m in mismatches(x, y, f"{where}/{i}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if torch.equal(a, b) else [f"{where}: tensors differ"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _fsdp(seed: int, frozen: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_model(seed, frozen)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, optimizer(model)


def tensor_leaves(state: Any, where: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted path, tensor) of every tensor in a nested state."""
    if isinstance(state, dict):
        for k, v in state.items():
            yield from tensor_leaves(v, f"{where}.{k}" if where else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from tensor_leaves(v, f"{where}.{i}")
    elif isinstance(state, torch.Tensor):
        yield where, state


def ddp_round_trip(rank: int, world: int, root: Path) -> None:
    """2-rank DDP: each rank stages only its share of the replicated state (together all of
    it, each tensor once), and both ranks load the whole state back."""
    model = DistributedDataParallel(tiny_model(seed=0))
    opt = optimizer(model)
    ckpt = Checkpointer(root, rank, keep=1)
    train(model, opt, 2, seed=1)
    at_2 = full_state(model, opt)
    staged: list[Any] = []
    stage = DefaultStager.stage

    def recording(self: DefaultStager, state_dict: Any, **kwargs: Any) -> Any:
        staged.append(state_dict)
        return stage(self, state_dict, **kwargs)

    DefaultStager.stage = recording  # type: ignore[method-assign]
    try:
        ckpt.save(2, model, opt, {})
    finally:
        DefaultStager.stage = stage  # type: ignore[method-assign]
    train(model, opt, 1, seed=2)
    assert ckpt.close() == root / "step-00000002"
    assert len(staged) == 1
    mine = {k: t.numel() * t.element_size() for k, t in tensor_leaves(staged[0])}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    everything = {k: t.numel() * t.element_size() for k, t in tensor_leaves(at_2)}
    keys = [k for share in every for k in share]
    assert sorted(keys) == sorted(everything), (keys, sorted(everything))  # each tensor once
    assert 0 < sum(mine.values()) < 0.7 * sum(everything.values()), (mine, everything)
    assert ("param_groups" in staged[0]["optim"]) == (rank == 0)
    fresh = DistributedDataParallel(tiny_model(seed=9))
    fresh_opt = optimizer(fresh)
    resumed = ckpt.load_latest(fresh, fresh_opt)
    assert resumed is not None and resumed.path == root / "step-00000002"
    assert mismatches(full_state(fresh, fresh_opt), at_2) == []  # on every rank


def fsdp_round_trip(rank: int, world: int, root: str, store: str) -> None:
    """2-rank FSDP2: async save at step 2, train on, commit, load into a fresh sharded model:
    the state at step 2; then keep=1 across ranks; then LoRA-like skip_frozen; then DDP
    (`ddp_round_trip`)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        base = Path(root)
        model, opt = _fsdp(seed=0, frozen=False)
        ckpt = Checkpointer(base / "full", rank, keep=1)
        train(model, opt, 2, seed=1)
        at_2 = full_state(model, opt)
        assert ckpt.save(2, model, opt, {"step_seen": 2}) == base / "full" / "step-00000002"
        train(model, opt, 3, seed=2)
        assert mismatches(full_state(model, opt), at_2), "training did not change the state"
        assert complete_checkpoints(base / "full") == []
        assert ckpt.wait() == base / "full" / "step-00000002"
        fresh, fresh_opt = _fsdp(seed=9, frozen=False)
        resumed = ckpt.load_latest(fresh, fresh_opt)
        assert resumed is not None and resumed.trainer == {"step": 2, "step_seen": 2}
        assert mismatches(full_state(fresh, fresh_opt), at_2) == []
        at_5 = full_state(model, opt)
        ckpt.save(5, model, opt, {})
        ckpt.close()
        assert complete_checkpoints(base / "full") == [base / "full" / "step-00000005"]
        fresh, fresh_opt = _fsdp(seed=9, frozen=False)
        resumed = ckpt.load_latest(fresh, fresh_opt)
        assert resumed is not None and resumed.trainer["step"] == 5
        assert mismatches(full_state(fresh, fresh_opt), at_5) == []

        model, opt = _fsdp(seed=0, frozen=True)
        lora = Checkpointer(base / "lora", rank, keep=2, skip_frozen=True)
        train(model, opt, 2, seed=1)
        at_2 = full_state(model, opt)
        lora.save(2, model, opt, {})
        train(model, opt, 2, seed=2)
        lora.close()
        fresh, fresh_opt = _fsdp(seed=9, frozen=True)
        start = full_state(fresh, fresh_opt)["model"]
        assert lora.load_latest(fresh, fresh_opt) is not None
        got = full_state(fresh, fresh_opt)
        assert mismatches(got["optim"], at_2["optim"]) == []
        for key, value in got["model"].items():
            expected = start[key] if key.startswith("0.") else at_2["model"][key]
            assert torch.equal(value, expected), key

        ddp_round_trip(rank, world, base / "ddp")
    finally:
        dist.destroy_process_group()
