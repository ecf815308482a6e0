"""A real Slurm on this machine for the tests: munged, slurmctld and one slurmd (node
`localhost`), all under a temporary directory with their own munge key, ports and state.

Debian's packages (`make slurm-deps`: slurmctld, slurmd, slurm-client, munge) are what run;
nothing here is a fake. Clients find the cluster through $SLURM_CONF (`SlurmCluster.env`).

Choices that make one unprivileged-looking node work in a container:

- ProctrackType=proctrack/linuxproc and TaskPlugin=task/none: no cgroups (the container's
  cgroup tree is not slurmd's to manage).
- SlurmdParameters=config_overrides: the node has the CPUs and memory slurm.conf says, not
  what slurmd counts, so jobs sized like the pipeline's (2 CPUs and 8Gi a rank by default)
  fit on a 2-core test machine. Nothing is enforced (no cgroups), so nothing is starved.
- AuthInfo cred_expire short: a requeued job waits for it (CRED_EXPIRE_S).
- MinJobAge large: a finished job stays in the controller's memory (there is no slurmdbd for
  sacct), so its state and exit code can be read with `scontrol show job`.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue")
NODE_CPUS = 16
NODE_MEMORY_MB = 65536
# A requeued batch job may start again only once its old job credential has expired (slurmd
# refuses it until then: "Job credential revoked"); the controller holds it that long
# (BeginTime, 121 s at Slurm's default of 120). Short here, so a pre-empted job resumes soon.
CRED_EXPIRE_S = 10


def missing_binaries() -> list[str]:
    """The Slurm and munge programs not on PATH (nor in /usr/sbin, where Debian puts the
    daemons)."""
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def _which(name: str) -> str:
    found = shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    assert found, name
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_GIVEN: set[int] = set()  # the ports free_port_block handed out


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default
    32768-60999 where /proc does not say)."""
    with contextlib.suppress(OSError, ValueError):
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    return 32768, 60999


def free_port_block(n: int) -> int:
    """The first of `n` consecutive ports that are free now and below the ephemeral range,
    so that no connection's local port takes one later (an array job's task i listens on
    base + i; `free_port() + i` is an ephemeral port any connect() may be using, and the
    task's rendezvous store then cannot listen: "The connection to the C10d store has
    failed")."""
    low, _ = ephemeral_ports()
    rng = random.Random()  # not the tests' seeded one: two lanes must not pick alike
    for _ in range(200 if low - n > 1024 else 0):
        base = rng.randrange(max(1024, low - 8000), low - n)  # so base + n < low
        block = set(range(base, base + n))
        if block & _GIVEN:  # two jobs of one test may run side by side
            continue
        if all(_bindable(port) for port in block):
            _GIVEN.update(block)
            return base
    raise RuntimeError(f"no {n} consecutive free ports below the ephemeral range ({low})")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class SlurmCluster:
    """One controller and one node on localhost, started by `start` and killed by `stop`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.munge_dir = root / "munge"
        self.socket = root / "munge-socket" / "munge.sock"
        self.log_dir = root / "log"
        self._pids: list[Path] = []

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, scontrol, the trainer) needs: $SLURM_CONF."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60.0) -> None:
        for d in ("state", "spool", "log", "munge-socket"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        # munged checks that its key and directories belong to it and are not writable by
        # others, and that every directory above its socket is searchable by all.
        self.munge_dir.mkdir(mode=0o700, exist_ok=True)
        self.socket.parent.chmod(0o755)
        key = self.munge_dir / "munge.key"
        subprocess.run(
            [_which("mungekey"), "--create", f"--keyfile={key}"],
            check=True,
            capture_output=True,
        )
        key.chmod(0o400)
        self._daemon(
            [
                _which("munged"),
                "--force",
                f"--key-file={key}",
                f"--socket={self.socket}",
                f"--pid-file={self.munge_dir / 'munged.pid'}",
                f"--log-file={self.log_dir / 'munged.log'}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
            ],
            self.munge_dir / "munged.pid",
        )
        self.conf.write_text(self.slurm_conf())
        self._daemon([_which("slurmctld"), "-f", str(self.conf), "-i"], self.root / "ctld.pid")
        self._daemon(
            [_which("slurmd"), "-f", str(self.conf), "-N", "localhost"], self.root / "slurmd.pid"
        )
        self._wait_idle(timeout_s)

    def slurm_conf(self) -> str:
        r = self.root
        return f"""\
ClusterName=kubellmtest
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.socket},cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}
SlurmctldPidFile={r / "ctld.pid"}
SlurmdPidFile={r / "slurmd.pid"}
SlurmctldLogFile={self.log_dir / "slurmctld.log"}
SlurmdLogFile={self.log_dir / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
JobRequeue=1
MinJobAge=86400
InactiveLimit=0
KillWait=30
SlurmdTimeout=300
NodeName=localhost NodeAddr=127.0.0.1 CPUs={NODE_CPUS} RealMemory={NODE_MEMORY_MB} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""

    def _daemon(self, cmd: list[str], pid_file: Path) -> None:
        """Start a daemon (it forks into the background) and remember its pid file."""
        out = subprocess.run(cmd, capture_output=True, text=True, env=self.env)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
        self._pids.append(pid_file)

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env
            )
            state = (out.stdout or out.stderr).strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"the test Slurm node is not idle after {timeout_s:.0f}s: {state}\n{self.logs()}"
        )

    def logs(self, lines: int = 20) -> str:
        out = []
        for log in sorted(self.log_dir.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def stop(self) -> None:
        """Kill the daemons (slurmd, slurmctld, munged: the reverse of their start), and any
        job step left behind (slurmstepd is slurmd's child)."""
        with contextlib.suppress(FileNotFoundError):
            subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, timeout=10)
        for pid_file in reversed(self._pids):
            with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
                pid = int(pid_file.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                for _ in range(50):
                    os.kill(pid, 0)
                    time.sleep(0.1)
                os.kill(pid, signal.SIGKILL)
        self._pids.clear()


# The training tests' tiny model (tests/train/trainkit.py), for jobs run through Slurm.
TINY_MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def tiny_config(dataset: Path, output_dir: Path, **values: Any) -> Any:
    from kubellm.config import TrainConfig

    base: dict[str, Any] = {
        "dataset_dir": str(dataset),
        "output_dir": str(output_dir),
        "steps": 8,
        "batch_size": 8,
        "log_every": 1,
        "eval_batches": 2,
        "model": TINY_MODEL,
    }
    return TrainConfig.model_validate({**base, **values})


def write_config(path: Path, cfg: Any) -> Path:
    path.write_text(cfg.model_dump_json())
    return path
