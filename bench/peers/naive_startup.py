"""The start-up memory benchmark's peer: how FSDP2 start-up commonly goes, and how kubellm's
went before issue 10: every rank calls `from_pretrained` (float32, on CPU), wraps LoRA
adapters (r=8 on q/v, as the engine's LoRA run), `fully_shard`s each decoder layer and the
root, then trains one step on the same data.

    torchrun --nproc_per_node=2 -m bench.peers.naive_startup MODEL_DIR DATASET_DIR fp32|bf16

Prints, on rank 0, the same `start-up:` / `end:` host peak RSS lines as kubellm.train.
"""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist


def _rss_line(when: str) -> None:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    per_rank: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(per_rank, peak)
    if dist.get_rank() == 0:
        values = ", ".join(f"{p / 2**30:.2f}" for p in per_rank)
        total = sum(per_rank) / 2**30
        print(f"{when}: host peak RSS per rank [{values}] GiB, sum {total:.2f} GiB", flush=True)


def main(model_dir: str, dataset_dir: str, precision: str) -> None:
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from kubellm.data.artifact import load_split

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = {"mp_policy": mp} if precision == "bf16" else {}
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    _rss_line("start-up")
    rows = load_split(dataset_dir, "train")[:, rank : rank + 1].long()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
    loss = model(input_ids=rows[0], labels=rows[1]).loss
    loss.backward()
    opt.step()
    _rss_line("end")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
