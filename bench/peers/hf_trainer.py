"""The Hugging Face Trainer peer: transformers.Trainer on the same model, data and schedule.

The model is kubellm.train.model.new_llama after torch.manual_seed(seed) (the engine's initial
weights); the rows are the same Parquet shards (labels -100 where loss_mask is 0), in the
Trainer's own order (its distributed sampler, seeded). TrainingArguments match the
engine's settings: per-device batch = global / world size, max_steps, AdamW peak LR and
betas, weight decay, max_grad_norm, linear warmup then cosine to 10 % of the peak
(`cosine_with_min_lr`, min_lr_rate 0.1), bf16 only when the config says precision=bf16,
no eval, no saving, no reporting, no tqdm,
no DataLoader workers, and the engine's AdamW: `optim="adamw_torch_fused"`, which is
torch.optim.AdamW(fused=True) with the same lr, betas, eps (1e-8) and weight decay (the
Trainer's default on torch >= 2.8, set here so that it cannot drift; the Trainer exempts
biases and norm weights from weight decay, which makes no difference at the bench's
weight_decay=0). Everything else is the Trainer's default, except
ddp_find_unused_parameters=False: the
default (True, for a model without gradient checkpointing) walks the autograd graph every
step for nothing here, and a tuned HF setup turns it off; the peer should be HF at its
reasonable best, not a strawman. grad_accum_steps > 1 becomes gradient_accumulation_steps
(per_device_train_batch_size is then the micro-batch). On GPUs it also leaves out the
per-step work the engine does not do: logging_nan_inf_filter=False (the default reads every
step's loss on the host, `torch.isnan(loss) or ...`: a device sync per micro-batch),
average_tokens_across_devices=False (the default all-gathers the label count every step;
without it each rank's mean loss is averaged by DDP, as the engine does) and
ddp_broadcast_buffers=False (the engine's DDP setting). On CPU those stay at the Trainer's
defaults, as this peer always ran there.

Steady-state time comes from a TrainerCallback's on_step_end (after the optimizer and
scheduler steps); the loss reported is the last logged one (the mean of the last
`log_every` steps, the Trainer's own logging).

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m bench.peers.hf_trainer --config cfg.json --skip 40
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

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
from kubellm.train.model import new_llama


class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """One packed row per item, as the Trainer's default collator stacks them."""

    def __init__(self, data: torch.Tensor) -> None:
        self.ids, self.labels = data[0], data[1]

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


# What the engine does not do per step either (see the module docstring); on GPUs only.
GPU_LEAN: dict[str, Any] = {
    "logging_nan_inf_filter": False,
    "average_tokens_across_devices": False,
    "ddp_broadcast_buffers": False,
}


def training_arguments(cfg: dict[str, Any], world: int, device: torch.device, backend: str) -> Any:
    """The Trainer's arguments for this config, world size and device (see the docstring)."""
    from transformers import TrainingArguments

    accum = cfg["grad_accum_steps"]
    return TrainingArguments(
        output_dir=cfg.get("output_dir", "hf-out") + "-hf",
        per_device_train_batch_size=cfg["batch_size"] // world // accum,
        gradient_accumulation_steps=accum,
        max_steps=cfg["steps"],
        learning_rate=cfg["learning_rate"],
        weight_decay=cfg["weight_decay"],
        adam_beta1=0.9,
        adam_beta2=cfg["adam_beta2"],
        adam_epsilon=1e-8,
        optim="adamw_torch_fused",
        max_grad_norm=cfg["grad_clip"],
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=cfg["warmup_steps"],
        logging_steps=cfg["log_every"],
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_drop_last=True,
        remove_unused_columns=False,
        use_cpu=device.type == "cpu",
        bf16=cfg["precision"] == "bf16",
        ddp_backend=backend,
        ddp_find_unused_parameters=False,
        seed=cfg["seed"],
        log_level="warning",
        **(GPU_LEAN if device.type == "cuda" else {}),
    )


def main() -> int:
    from transformers import Trainer, TrainerCallback

    args = parse_args("Hugging Face Trainer (train bench peer)")
    cfg = read_config(args.config)
    device, backend = pick_device(cfg["backend"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps = cfg["steps"]
    accum = cfg["grad_accum_steps"]

    class Clock(TrainerCallback):  # type: ignore[misc]
        """Feeds step ends to the StepClock and keeps the last logged loss."""

        def __init__(self, clock: StepClock) -> None:
            self.clock = clock
            self.loss = math.nan

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.clock.step_end(state.global_step)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.loss = float(logs["loss"])

    training_args = training_arguments(cfg, world, device, backend)
    tokenizer = load_tokenizer(Path(cfg["dataset_dir"]) / "tokenizer")
    data = load_rows(cfg["dataset_dir"])
    torch.manual_seed(cfg["seed"])  # right before the model, as the engine does
    model = new_llama(ModelConfig(**cfg["model"]), tokenizer)
    init_hash = weights_hash(model.parameters())
    clock = StepClock(args.skip, steps, cfg["batch_size"] * data.shape[2], device)
    callback = Clock(clock)
    trainer = Trainer(
        model=model, args=training_args, train_dataset=Rows(data), callbacks=[callback]
    )
    trainer.train()
    clock.report(callback.loss, model, data.shape[2])
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps torch's
    precision = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "fp32"
    per_process = training_args.per_device_train_batch_size * accum
    describe(opt, model, init_hash, per_process, precision)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
