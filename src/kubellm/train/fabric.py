"""Fabric check: an all-reduce benchmark with the training topology, run by the trainer.

Runs under the same launcher as training (torchrun locally, a short PyTorchJob on the
cluster) and prints `allreduce_busbw_gbps=... allreduce_ms=...` lines. With
`--require-rdma` on NCCL it fails when NCCL fell back to TCP sockets instead of InfiniBand
or RoCE, the silent slowdown that costs a multi-node job most of its speed.

    torchrun --standalone --nproc_per_node=2 -m kubellm.train.fabric --mib 4
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

EXIT_NO_RDMA = 3


def nccl_transport(debug_glob: str) -> str:
    """'ib', 'socket' or 'unknown', from NCCL's INFO log lines ("NET/IB", "NET/Socket")."""
    text = ""
    for path in glob.glob(debug_glob):
        with open(path, errors="replace") as fh:
            text += fh.read()
    if "NET/IB" in text:
        return "ib"
    if "NET/Socket" in text:
        return "socket"
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubellm.train.fabric")
    parser.add_argument("--mib", type=float, default=4.0, help="all-reduce message size")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--require-rdma", action="store_true")
    args = parser.parse_args(argv)

    use_nccl = torch.cuda.is_available()
    debug_dir = tempfile.mkdtemp(prefix="nccl-")
    if use_nccl:
        os.environ.setdefault("NCCL_DEBUG", "INFO")
        os.environ.setdefault("NCCL_DEBUG_FILE", os.path.join(debug_dir, "nccl.%h.%p.log"))
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_nccl else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda") if use_nccl else torch.device("cpu")
        n = int(args.mib * 2**20 / 4)
        x = torch.ones(n, dtype=torch.float32, device=device)
        dist.all_reduce(x)  # warm-up: connections are set up here
        if use_nccl:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(x)
        if use_nccl:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / args.iters
        busbw = 2 * (world - 1) / world * n * 4 / seconds / 1e9 if world > 1 else 0.0
        transport = nccl_transport(os.path.join(debug_dir, "nccl.*")) if use_nccl else "gloo"
        if rank == 0:
            print(
                f"fabric: backend={'nccl' if use_nccl else 'gloo'} transport={transport} "
                f"world_size={world}",
                flush=True,
            )
            print(
                f"allreduce_busbw_gbps={busbw:.4f} allreduce_ms={seconds * 1e3:.3f} "
                f"world_size={world}",
                flush=True,
            )
        if args.require_rdma and use_nccl and transport != "ib":
            print(
                f"error: RDMA was required but NCCL uses transport={transport}; "
                "check the RDMA device plugin resources and NCCL_IB_HCA",
                file=sys.stderr,
            )
            return EXIT_NO_RDMA
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
