"""Not a contender: what `python -m kubellm.train` itself builds, for the bench's report.

The engine picks its AdamW from the run (fused on plain parameters, foreach on FSDP2's
sharded ones) and prints no optimizer line, so the bench asks it rather than assuming: this
module runs the engine's own CLI entry (`runpy`, as `python -m kubellm.train` does) under
torchrun with the bench's config for one step, with two observers that cost nothing inside
the measured runs because they exist only here: torch.optim.Optimizer's constructor records
the first optimizer built (and hashes the parameters it gets, the initial weights), and a
global forward pre-hook records the model class of the first forward (under a DDP wrapper).
Rank 0 then prints the same `bench_setup {json}` line as the peers. Precision and batch per
process come from the engine's own `train:` line, read by the parent.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m bench.peers.engine_probe --config cfg.json
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from bench.peers import SETUP_PREFIX, optimizer_settings, weights_hash
from kubellm.process import FULL_EXIT_ENV


def main() -> int:
    ap = argparse.ArgumentParser(description="kubellm.train's optimizer and model, for the bench")
    ap.add_argument("--config", required=True, help="TrainConfig JSON (kubellm.train's)")
    args = ap.parse_args()

    seen: dict[str, Any] = {}
    build = torch.optim.Optimizer.__init__

    def record_optimizer(self: torch.optim.Optimizer, *a: Any, **kw: Any) -> None:
        build(self, *a, **kw)
        if "optimizer" not in seen:
            seen["optimizer"] = self
            params = [p for g in self.param_groups for p in g["params"]]
            seen["init_hash"] = weights_hash(params)
            seen["params"] = sum(p.numel() for p in params)
            seen["threads"] = torch.get_num_threads()
            seen["interop_threads"] = torch.get_num_interop_threads()

    def record_model(module: torch.nn.Module, inputs: Any) -> None:
        if "model" not in seen and not isinstance(module, DistributedDataParallel):
            seen["model"] = type(module).__name__

    torch.optim.Optimizer.__init__ = record_optimizer  # type: ignore[method-assign]
    hook = torch.nn.modules.module.register_module_forward_pre_hook(record_model)
    sys.argv = ["kubellm.train", "--config", args.config, "--set", "steps=1"]
    # kubellm.train's __main__ ends the process itself (kubellm.process.exit_now) unless
    # told to exit the usual way: then its end is a SystemExit caught here
    os.environ[FULL_EXIT_ENV] = "1"
    try:
        runpy.run_module("kubellm.train", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    finally:
        hook.remove()
        torch.optim.Optimizer.__init__ = build  # type: ignore[method-assign]
    if "optimizer" not in seen:
        raise SystemExit("engine_probe: kubellm.train built no torch optimizer")
    if int(os.environ.get("RANK", "0")) == 0:
        setup = {
            **optimizer_settings(seen.pop("optimizer")),
            "model": seen.get("model", "?"),
            "params": seen["params"],
            "init_hash": seen["init_hash"],
            "threads": seen["threads"],
            "interop_threads": seen["interop_threads"],
        }
        print(SETUP_PREFIX + json.dumps(setup), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
