"""A minimal hand-written DDP training loop: the floor for kubellm.train's overhead.

Nothing but the work every step has to do: the rank's rows of the global batch, forward
with labels, backward (DDP all-reduces the gradients), clip_grad_norm_, AdamW step, LR
schedule step, zero_grad. Same model (kubellm.train.model.new_llama right after
torch.manual_seed(seed), so the same initial weights as the engine), the same rows in the
same order (a seeded permutation per epoch, the engine's documented order), the same
warmup + cosine schedule and clip, bf16 autocast when the config says precision=bf16 (the
bench's choice on GPUs), and the engine's AdamW for DDP: torch.optim.AdamW(lr,
betas=(0.9, adam_beta2), weight_decay, eps at torch's default 1e-8, fused=True), one fused
kernel per step on CPU and GPU alike (torch's default on CPU would be the slower
single-tensor for-loop: a floor the engine would beat for the wrong reason). No logging
inside the timed steps.

With grad_accum_steps > 1 each rank's rows of the step are split into that many consecutive
micro-batches (the engine's split), each loss divided by their number, DDP's all-reduce only
on the last (`no_sync` before). On GPUs DDP runs with broadcast_buffers=False, the engine's
setting (the rotary buffers are constants); on CPU with DDP's default, as this floor always
has.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m bench.peers.ddp_loop --config cfg.json --skip 40
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from bench.peers import (
    StepClock,
    describe,
    load_rows,
    parse_args,
    pick_device,
    read_config,
    weights_hash,
)
from kubellm.config import ModelConfig
from kubellm.data.tokenizer import load_tokenizer
from kubellm.train.loop import lr_factor
from kubellm.train.model import new_llama


def main() -> int:
    args = parse_args("minimal DDP loop (train bench peer)")
    cfg = read_config(args.config)
    device, backend = pick_device(cfg["backend"])
    dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    steps, batch, seed = cfg["steps"], cfg["batch_size"], cfg["seed"]
    bf16 = cfg["precision"] == "bf16"  # the bench sets fp32 or bf16 explicitly

    tokenizer = load_tokenizer(Path(cfg["dataset_dir"]) / "tokenizer")
    data = load_rows(cfg["dataset_dir"])
    torch.manual_seed(seed)  # right before the model, as the engine does
    model = new_llama(ModelConfig(**cfg["model"]), tokenizer)
    init_hash = weights_hash(model.parameters())
    model.to(device)
    # On GPUs the engine's setting (the rotary buffers are constants); on CPU DDP's default.
    gpu_only: dict[str, Any] = {"broadcast_buffers": False} if device.type == "cuda" else {}
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.index is not None else None, **gpu_only
    )
    opt = torch.optim.AdamW(  # the engine's, for DDP: fused (one kernel per step)
        model.parameters(),
        lr=cfg["learning_rate"],
        weight_decay=cfg["weight_decay"],
        betas=(0.9, cfg["adam_beta2"]),
        fused=True,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg["warmup_steps"], steps)
    )
    n, per_rank = data.shape[1], batch // world
    accum = cfg["grad_accum_steps"]
    micro = per_rank // accum
    per_epoch = n // batch
    clock = StepClock(args.skip, steps, batch * data.shape[2], device)
    perm = torch.arange(n)
    ddp.train()
    for step in range(steps):
        epoch, pos = divmod(step, per_epoch)
        if pos == 0:  # one permutation per epoch
            perm = torch.randperm(
                n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            )
        start = pos * batch + rank * per_rank
        x, y = data[:, perm[start : start + per_rank]].to(device)
        loss: torch.Tensor | None = None  # this step's loss on this rank (micro-batches summed)
        for i in range(accum):
            xs, ys = x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]
            sync = contextlib.nullcontext() if i == accum - 1 else ddp.no_sync()
            with sync, torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                part = ddp(input_ids=xs, labels=ys).loss
                if accum > 1:
                    part = part / accum
            part.backward()
            loss = part.detach() if loss is None else loss + part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        clock.step_end(step + 1)

    assert loss is not None
    final = loss.detach()
    # The last step's loss, mean of the ranks. The Work is kept until the group is gone: when
    # gloo's worker thread drops the last reference to a finished Work it needs the GIL,
    # while tearing the group down (DDP's reducer going away) holds the GIL and waits for
    # that thread: a deadlock at exit in about 1 run of 3 (torch 2.13, gloo).
    work = dist.all_reduce(final, op=dist.ReduceOp.AVG, async_op=True)
    work.wait()
    clock.report(float(final), model, data.shape[2])
    describe(opt, model, init_hash, per_rank, "bf16" if bf16 else "fp32")
    del ddp
    dist.destroy_process_group()
    del work
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
