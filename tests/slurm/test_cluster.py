"""The test Slurm itself: an sbatch script whose srun starts torchrun on two tasks, which
rendezvous over c10d and all-reduce with gloo."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from slurmkit import SlurmCluster, ephemeral_ports, free_port_block

ALL_REDUCE = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item():g}", flush=True)
dist.destroy_process_group()
"""


def test_srun_torchrun_two_ranks_rendezvous_and_all_reduce(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    tmp_path.chmod(0o755)
    (tmp_path / "ar.py").write_text(ALL_REDUCE)
    out = tmp_path / "job.out"
    # Two tasks on the one node, each a torchrun "node" of one process (SLURM_PROCID as its
    # node rank): what a two-node job does, one task per node.
    script = f"""#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --output={out}
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
srun bash -c 'exec {sys.executable} -m torch.distributed.run --nnodes=2 \
  --node_rank=$SLURM_PROCID --nproc_per_node=1 --rdzv_backend=c10d \
  --rdzv_endpoint=$MASTER_ADDR:{free_port_block(1)} {tmp_path / "ar.py"}'
"""
    path = tmp_path / "job.sh"
    path.write_text(script)
    job = subprocess.run(
        ["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()
    deadline = time.monotonic() + 90
    state = ""
    while time.monotonic() < deadline:
        show = subprocess.run(
            ["scontrol", "show", "job", job], capture_output=True, text=True
        ).stdout
        state = show.split("JobState=", 1)[1].split()[0]
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            break
        time.sleep(0.5)
    logs = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", f"{state}\n{logs}\n{slurm.logs()}"
    assert "rank=0 world=2 sum=3" in logs and "rank=1 world=2 sum=3" in logs, logs


def test_a_port_block_for_an_array_lies_below_the_ephemeral_range_and_is_free() -> None:
    """An array job's task i listens on rdzv_port + i. CI saw a tuner test's task 1 fail
    ("The connection to the C10d store has failed", exit 201) when rdzv_port was a free
    ephemeral port: rdzv_port + 1 was some connection's local port. Below the range, no
    connect() takes one; blocks handed out in one process do not overlap."""
    low, _ = ephemeral_ports()
    blocks = [free_port_block(8) for _ in range(20)]
    ports = [b + i for b in blocks for i in range(8)]
    assert all(b >= 1024 and b + 8 <= low for b in blocks), (blocks, low)
    assert len(set(ports)) == len(ports)
    for port in ports[:8]:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))  # free: a rendezvous store can listen there
