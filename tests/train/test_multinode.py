"""Multi-node the way a PyTorchJob runs it: two torchrun agents, one worker each, c10d rendezvous.

The acceptance check: two separate agents (`--nnodes=2 --nproc_per_node=1`) rendezvous, train
and export exactly the parameters (torch.equal) that one agent with `--nproc_per_node=2` exports
on the same data and seed. Once over loopback (always), once across two network namespaces
joined by a veth pair (each agent sees only its own interface, like two pods), skipped with the
reason where the machine does not allow namespaces.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kubellm.config import TrainConfig

pytestmark = pytest.mark.slow

TIMEOUT_S = 180.0  # per agent: a rendezvous that never completes fails instead of hanging CI
TAIL_LINES = 40
# Launcher state inherited from an outer torchrun would confuse the agents started here.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


@dataclass
class Agent:
    """One torchrun agent process and where its output goes."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self) -> str:
        lines = self.output().splitlines()[-TAIL_LINES:]
        return f"--- {self.name} (exit {self._rc()}) {' '.join(self.cmd)}\n" + "\n".join(lines)

    def _rc(self) -> int | None:
        return None if self.proc is None else self.proc.returncode


@pytest.fixture(scope="module")
def dataset(tiny_dataset: Path) -> Path:
    return tiny_dataset


def _config(tmp: Path, name: str, dataset: Path, **values: str) -> Path:
    """The tiny config of test_checkpoint; only output_dir (and `values`) differ between runs."""
    cfg = TrainConfig(
        **values,  # type: ignore[arg-type]
        dataset_dir=str(dataset),
        output_dir=str(tmp / f"{name}-model"),
        steps=8,
        batch_size=8,
        log_every=1,
        eval_batches=2,
        model={"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
    )
    path = tmp / f"{name}.json"
    path.write_text(cfg.model_dump_json())
    return path


def _env(**extra: str) -> dict[str, str]:
    """Clean launcher env; LOGLEVEL=INFO makes each agent log its rendezvous result."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARS and not k.startswith(("PET_", "TORCHELASTIC_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LOGLEVEL="INFO", **extra)
    return env


def _torchrun(*args: str, config: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *args,
        "-m",
        "kubellm.train",
        "--config",
        str(config),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """End the agent and its workers (its own session/process group)."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _run_agents(agents: list[Agent], timeout_s: float = TIMEOUT_S) -> None:
    """Start all agents at once and wait; any agent past the deadline fails the test."""
    try:
        for a in agents:
            with a.log.open("wb") as out:
                a.proc = subprocess.Popen(
                    a.cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=a.env,
                    start_new_session=True,
                )
        deadline = time.monotonic() + timeout_s
        while any(a.proc is not None and a.proc.poll() is None for a in agents):
            if time.monotonic() > deadline:
                for a in agents:
                    if a.proc is not None and a.proc.poll() is None:
                        _kill(a.proc)
                tails = "\n".join(a.tail() for a in agents)
                pytest.fail(f"agents still running after {timeout_s:.0f}s; killed\n{tails}")
            time.sleep(0.2)
    finally:
        for a in agents:
            if a.proc is not None and a.proc.poll() is None:
                _kill(a.proc)
    tails = "\n".join(a.tail() for a in agents)
    assert all(a.proc is not None and a.proc.returncode == 0 for a in agents), tails


def _rendezvous(log: str) -> dict[str, str]:
    """The agent's `Rendezvous complete` result (torchrun's INFO log), field -> value."""
    return dict(re.findall(r"\]\s+(\w+)=(\S.*?)\s*$", log, flags=re.MULTILINE))


def _load(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


@pytest.fixture(scope="module")
def reference(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """One agent, two workers: what the two-agent runs must reproduce bit for bit."""
    tmp = tmp_path_factory.mktemp("ref")
    config = _config(tmp, "ref", dataset)
    agent = Agent(
        "ref",
        _torchrun("--standalone", "--nproc_per_node=2", config=config),
        _env(),
        tmp / "ref.log",
    )
    _run_agents([agent])
    log = agent.output()
    assert re.search(r"^train: params=.* world_size=2\b", log, flags=re.MULTILINE), agent.tail()
    return _load(tmp / "ref-model")


def _check_two_agents(
    agents: list[Agent], model_dir: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Both agents ran one worker each in a world of 2, and the result equals the reference."""
    tails = "\n".join(a.tail() for a in agents)
    results = [_rendezvous(a.output()) for a in agents]
    for r in results:
        assert r.get("group_world_size") == "2", tails
        assert r.get("local_ranks") == "[0]", tails  # one worker per agent
        assert r.get("global_world_sizes") == "[2]", tails
    assert sorted(r.get("global_ranks") for r in results) == ["[0]", "[1]"], tails
    banners = [
        line
        for a in agents
        for line in a.output().splitlines()
        if re.match(r"train: params=.* world_size=2\b", line)
    ]
    assert len(banners) == 1, tails  # printed by global rank 0 only
    got = _load(model_dir)
    assert got.keys() == reference.keys(), tails
    differ = [k for k in reference if not torch.equal(reference[k], got[k])]
    assert not differ, f"parameters differ from the one-agent run: {differ}\n{tails}"


def _agent_args(endpoint: str, rdzv_id: str, *extra: str) -> tuple[str, ...]:
    return (
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint}",
        f"--rdzv_id={rdzv_id}",
        *extra,
    )


def test_two_agents_match_one_agent(
    dataset: Path, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    config = _config(tmp_path, "multi", dataset)
    endpoint = f"127.0.0.1:{_free_port()}"
    rdzv_id = f"kl-{secrets.token_hex(4)}"
    # lo / 127.0.0.1 so gloo and the store do not depend on what the hostname resolves to.
    args = _agent_args(endpoint, rdzv_id, "--local-addr=127.0.0.1")
    env = _env(GLOO_SOCKET_IFNAME="lo")
    agents = [
        Agent(f"agent-{n}", _torchrun(*args, config=config), env, tmp_path / f"agent-{n}.log")
        for n in ("a", "b")
    ]
    _run_agents(agents)
    _check_two_agents(agents, tmp_path / "multi-model", reference)


def test_hsdp_across_two_agents_trains_what_fsdp_does(dataset: Path, tmp_path: Path) -> None:
    """HSDP: 2 agents ("nodes") x 2 workers, sharded within an agent, replicated across
    them (a 2 x 2 mesh), against FSDP over the same 4 ranks in one agent. The reductions run
    in a different order, so the weights agree to float32 rounding, not bit for bit."""
    fsdp = _config(tmp_path, "fsdp", dataset, strategy="fsdp", precision="fp32")
    one = Agent(
        "fsdp",
        _torchrun("--standalone", "--nproc_per_node=4", config=fsdp),
        _env(),
        tmp_path / "fsdp.log",
    )
    _run_agents([one])
    hsdp = _config(tmp_path, "hsdp", dataset, strategy="hsdp", precision="fp32")
    endpoint = f"127.0.0.1:{_free_port()}"
    args = _agent_args(endpoint, f"kl-{secrets.token_hex(4)}", "--local-addr=127.0.0.1")
    args = tuple(a.replace("--nproc_per_node=1", "--nproc_per_node=2") for a in args)
    env = _env(GLOO_SOCKET_IFNAME="lo")
    agents = [
        Agent(f"agent-{n}", _torchrun(*args, config=hsdp), env, tmp_path / f"agent-{n}.log")
        for n in ("a", "b")
    ]
    _run_agents(agents)
    logs = "".join(a.output() for a in agents)
    assert "train: hsdp mesh replicate=2 x shard=2" in logs, logs[-3000:]
    assert re.search(r"world_size=4 device=cpu strategy=hsdp", logs), logs[-3000:]
    ref, got = _load(tmp_path / "fsdp-model"), _load(tmp_path / "hsdp-model")
    assert ref.keys() == got.keys()
    far = [k for k in ref if not torch.allclose(ref[k], got[k], rtol=1e-4, atol=1e-6)]
    assert not far, far


@dataclass
class Node:
    """One end of the veth pair, inside its own network namespace."""

    netns: str
    ifname: str
    addr: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def netns_pair() -> Iterator[tuple[Node, Node]]:
    """Two namespaces joined by a veth pair; unique names so parallel runs don't collide.

    Skips with the reason where the machine does not allow it (no `ip`, not root, EPERM).
    Module scope so that a test asking for it before `reference` skips before that run.
    """
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: `ip` (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces: need root (CAP_NET_ADMIN) to create them")
    token = secrets.token_hex(3)
    nodes = (
        Node(f"kl-{token}-a", f"kl{token}a", "10.77.0.1"),
        Node(f"kl-{token}-b", f"kl{token}b", "10.77.0.2"),
    )
    a, b = nodes
    created: list[str] = []
    try:
        try:
            for n in nodes:
                _ip("netns", "add", n.netns)
                created.append(n.netns)
            _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
            for n in nodes:
                _ip("link", "set", n.ifname, "netns", n.netns)
                _ip("-n", n.netns, "addr", "add", f"{n.addr}/24", "dev", n.ifname)
                _ip("-n", n.netns, "link", "set", n.ifname, "up")
                _ip("-n", n.netns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as err:
            cmd = " ".join(err.cmd)
            pytest.skip(f"network namespaces not allowed here: `{cmd}`: {err.stderr.strip()}")
        except (OSError, subprocess.TimeoutExpired) as err:
            pytest.skip(f"network namespaces not allowed here: {err}")
        yield nodes
    finally:
        # Deleting a namespace deletes the veth end inside it (and so the pair).
        for name in created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", a.ifname], capture_output=True, timeout=30)


def test_two_agents_in_separate_network_namespaces(
    netns_pair: tuple[Node, Node],
    dataset: Path,
    reference: dict[str, torch.Tensor],
    tmp_path: Path,
) -> None:
    config = _config(tmp_path, "multi", dataset)
    a = netns_pair[0]
    endpoint = f"{a.addr}:29500"  # a fresh namespace: the port is free
    rdzv_id = f"kl-{secrets.token_hex(4)}"
    agents = []
    for node in netns_pair:
        # The endpoint is an address, not this host's name, so tell c10d which agent hosts
        # the store; --local-addr / GLOO_SOCKET_IFNAME keep both on the veth (the hostname
        # resolves to 127.0.0.1 in every namespace).
        is_host = int(node is a)
        args = _agent_args(
            endpoint, rdzv_id, f"--rdzv_conf=is_host={is_host}", f"--local-addr={node.addr}"
        )
        agents.append(
            Agent(
                node.netns,
                ["ip", "netns", "exec", node.netns, *_torchrun(*args, config=config)],
                _env(GLOO_SOCKET_IFNAME=node.ifname),
                tmp_path / f"{node.netns}.log",
            )
        )
    _run_agents(agents)
    for agent in agents:
        assert _rendezvous(agent.output()).get("master_addr") == a.addr, agent.tail()
    _check_two_agents(agents, tmp_path / "multi-model", reference)
