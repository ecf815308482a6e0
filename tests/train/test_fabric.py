"""train.fabric: NCCL's transport from its own log lines, nccl-tests busbw, a check that fails.

The NCCL logs are fixtures (tests/fixtures/nccl/, each citing the NCCL source lines it
follows); the real runs use gloo on CPU under torchrun.
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kubellm.train import fabric
from kubellm.train.fabric import (
    EXIT_LOW_BUSBW,
    EXIT_NO_RDMA,
    FabricResult,
    Memlock,
    NcclTransport,
    allreduce_bandwidth,
    check,
    lowest_memlock,
    memlock_failure,
    memlock_size,
    nccl_debug_env,
    nccl_debug_path,
    parse_nccl_log,
    read_memlock,
)
from kubellm.train.metric_lines import parse_metrics

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nccl"
MIB = 2**20


def log(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


def result(
    transport: NcclTransport,
    *,
    nodes: int,
    world_size: int = 16,
    mib: float = 256.0,
    seconds: float = 0.003,
    backend: str = "nccl",
) -> FabricResult:
    return FabricResult(backend, world_size, nodes, mib, seconds, transport)


# -- the parser on the three fixtures ---------------------------------------------------------


def test_fixtures_cite_their_sources() -> None:
    for path in sorted(FIXTURES.glob("*.log")):
        head = path.read_text().splitlines()[:8]
        assert all(line.startswith("#") for line in head), path.name
        text = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
        assert "github.com/NVIDIA/nccl/blob/ab2b89c4c339bd7f816fbc114a4b05d386b66290" in text
        assert "/issues/" in text, f"{path.name} cites no posted log"
        assert "NCCL INFO NCCL version 2.21.5+cuda12.4" in path.read_text()


def test_two_node_infiniband_run_passes_require_rdma() -> None:
    t = parse_nccl_log(log("ib-2node.log"))
    assert t.network == "IB"
    assert t.inter_node == {"NET/IB/GDRDMA"}
    assert t.gdr is True
    assert t.intra_node == {"P2P/CUMEM"}
    assert t.kind == "IB"
    assert not t.sockets
    assert t.hosts == {"kubellm-fabric-7d9k2-master-0", "kubellm-fabric-7d9k2-worker-0"}
    assert t.versions == {"2.21.5+cuda12.4"}
    r = result(t, nodes=len(t.hosts))
    assert check(r, require_rdma=True, min_busbw_gbps=0) is None
    assert r.fabric_line() == "fabric: backend=nccl transport=IB gdr=yes world_size=16 nodes=2"


def test_socket_fallback_fails_require_rdma_naming_socket_and_the_fix() -> None:
    t = parse_nccl_log(log("socket-fallback.log"))
    assert t.network == "Socket"
    assert t.inter_node == {"NET/Socket"}
    assert t.gdr is False
    assert t.ib_no_device
    assert t.kind == "Socket"
    r = result(t, nodes=len(t.hosts), world_size=4)
    failure = check(r, require_rdma=True, min_busbw_gbps=0)
    assert failure is not None and failure.code == EXIT_NO_RDMA == 3
    line = str(failure)
    assert line.startswith("error: fabric: RDMA required but NCCL used TCP sockets")
    assert "\n" not in line
    assert "network=Socket" in line and "NET/Socket" in line
    assert "NET/IB : No device found." in line  # why NCCL fell back
    for fix in ("rdma/rdma_shared_device_a", "NCCL_IB_HCA", "Multus"):
        assert fix in line
    # without --require-rdma the same run passes (and reports what it saw)
    assert check(r, require_rdma=False, min_busbw_gbps=0) is None
    assert "transport=Socket gdr=no world_size=4 nodes=2" in r.fabric_line()


def test_no_ib_device_line_is_not_infiniband() -> None:
    lines = log("socket-fallback.log")
    # the trap the old substring check fell into: the fallback log does mention NET/IB
    assert any("NET/IB" in line and "NCCL INFO" in line for line in lines)
    assert "IB" not in parse_nccl_log(lines).net_names
    alone = parse_nccl_log(["pod-0:58:172 [0] NCCL INFO NET/IB : No device found."])
    assert alone.ib_no_device
    assert alone.networks == alone.inter_node == frozenset()
    assert alone.kind == "unknown"


def test_single_node_run_is_intra_node_and_not_failed_for_rdma() -> None:
    t = parse_nccl_log(log("single-node.log"))
    assert t.inter_node == frozenset()
    assert t.intra_node == {"P2P/IPC", "SHM"}
    assert t.kind == "intra-node"
    assert t.network == "Socket"  # initialised, but it carries nothing
    r = result(t, nodes=len(t.hosts), world_size=4)
    assert r.single_node_without_network
    assert check(r, require_rdma=True, min_busbw_gbps=0) is None
    assert r.fabric_line() == (
        "fabric: backend=nccl transport=intra-node gdr=n/a world_size=4 nodes=1"
    )


def test_comment_lines_are_ignored() -> None:
    t = parse_nccl_log(
        [
            "# h:1:1 [0] NCCL INFO Using network IB",
            "  # h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA",
        ]
    )
    assert t == NcclTransport()


INFO = "h:1:2 [0] NCCL INFO "


@pytest.mark.parametrize(
    ("line", "inter", "gdr"),
    [
        # NCCL 2.21's format, with the proxy rank (PXN), shared buffers, GDR over PCI
        (INFO + "Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA", "IB", True),
        (INFO + "Channel 02/1 : 0[0] -> 9[1] [send] via NET/IB/1(1)/GDRDMA", "IB", True),
        (INFO + "Channel 01/1 : 0[0] -> 8[0] [send] via NET/IB/0/Shared", "IB", False),
        (INFO + "Channel 00/0 : 4[4] -> 12[4] [send] via NET/IB/4/GDRDMA(PCI)", "IB", True),
        # older NCCL: bus ids in the brackets, no connIndex
        (INFO + "Channel 01 : 2[c7000] -> 0[87000] [receive] via NET/IB/5/GDRDMA", "IB", True),
        # network plugins: HPC-X's IB plugin, aws-ofi-nccl (a name with a space)
        (INFO + "Channel 00/0 : 6[6] -> 38[6] [receive] via NET/IBext_v8/1", "IBext_v8", False),
        (
            INFO + "Channel 00/0 : 1[1] -> 9[1] [send] via NET/AWS Libfabric/1/GDRDMA",
            "AWS Libfabric",
            True,
        ),
        # launcher prefixes (mpirun --tag-output; a rank tag)
        ("[1,0]<stdout>:" + INFO + "Channel 00/0 : 1[0] -> 0[0] via NET/Socket/0", "Socket", False),
        ("[1] " + INFO + "Channel 00/0 : 1[0] -> 0[0] [send] via NET/Socket/0", "Socket", False),
    ],
)
def test_channel_line_formats(line: str, inter: str, gdr: bool) -> None:
    t = parse_nccl_log([line])
    assert t.net_names == {inter}
    assert t.gdr is gdr
    assert t.kind == inter


def test_plugin_networks_and_a_libfabric_tcp_provider() -> None:
    efa = parse_nccl_log(
        [
            "pod-0:21:21 [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)",
            "pod-0:21:21 [0] NCCL INFO Using network AWS Libfabric",
            "pod-0:21:80 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] "
            "via NET/AWS Libfabric/0/GDRDMA",
        ]
    )
    assert efa.network == "AWS Libfabric"
    assert check(result(efa, nodes=2), require_rdma=True, min_busbw_gbps=0) is None
    assert "transport=AWS_Libfabric gdr=yes" in result(efa, nodes=2).fabric_line()
    # the same plugin bound to libfabric's tcp provider is a socket fallback in disguise
    tcp = parse_nccl_log(
        [
            "pod-0:21:21 [0] NCCL INFO NET/OFI Selected Provider is tcp (found 1 nics)",
            "pod-0:21:21 [0] NCCL INFO Using network AWS Libfabric",
            "pod-0:21:80 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/AWS Libfabric/0",
        ]
    )
    failure = check(result(tcp, nodes=2), require_rdma=True, min_busbw_gbps=0)
    assert failure is not None and failure.code == EXIT_NO_RDMA
    assert "libfabric provider tcp" in failure.message


def test_require_rdma_fails_when_the_log_cannot_show_the_transport() -> None:
    only_network = parse_nccl_log(["pod-0:1:1 [0] NCCL INFO Using network IB"])
    failure = check(result(only_network, nodes=2), require_rdma=True, min_busbw_gbps=0)
    assert failure is not None and failure.code == EXIT_NO_RDMA
    assert "no inter-node channel" in failure.message and "NCCL_DEBUG=INFO" in failure.message


def test_require_rdma_with_gloo() -> None:
    one_node = result(NcclTransport(), nodes=1, world_size=2, backend="gloo")
    assert check(one_node, require_rdma=True, min_busbw_gbps=0) is None
    assert one_node.fabric_line() == (
        "fabric: backend=gloo transport=TCP gdr=n/a world_size=2 nodes=1"
    )
    two_nodes = result(NcclTransport(), nodes=2, world_size=2, backend="gloo")
    failure = check(two_nodes, require_rdma=True, min_busbw_gbps=0)
    assert failure is not None and "backend gloo talks TCP" in failure.message


# -- bandwidth ---------------------------------------------------------------------------------


def test_busbw_formula_matches_a_hand_computation() -> None:
    # nccl-tests doc/PERFORMANCE.md: algbw = S/t, busbw = algbw * 2(n-1)/n.
    # n = 8 ranks, S = 256 MiB = 268,435,456 bytes, t = 2 ms:
    #   algbw = 268435456 / 0.002 / 1e9 = 134.217728 GB/s
    #   busbw = 134.217728 * 2 * 7 / 8 = 234.881024 GB/s
    algbw, busbw = allreduce_bandwidth(256 * MIB, 0.002, 8)
    assert algbw == pytest.approx(134.217728)
    assert busbw == pytest.approx(234.881024)
    assert allreduce_bandwidth(256 * MIB, 0.002, 2) == pytest.approx((134.217728,) * 2)
    assert allreduce_bandwidth(256 * MIB, 0.002, 1)[1] == 0.0  # one rank moves nothing
    r = result(NcclTransport(), nodes=1, world_size=8, seconds=0.002)
    assert (r.algbw_gbps, r.busbw_gbps) == pytest.approx((134.217728, 234.881024))


def test_low_busbw_fails_stating_figure_threshold_size_and_world() -> None:
    ib = parse_nccl_log(log("ib-2node.log"))
    r = result(ib, nodes=2, world_size=16, seconds=0.05)  # 256 MiB in 50 ms on 16 ranks
    assert r.busbw_gbps == pytest.approx(256 * MIB / 0.05 / 1e9 * 30 / 16)  # 10.066 GB/s
    failure = check(r, require_rdma=True, min_busbw_gbps=40)
    assert failure is not None and failure.code == EXIT_LOW_BUSBW == 4
    assert str(failure) == (
        "error: fabric: all-reduce busbw 10.07 GB/s is below --min-busbw-gbps 40 "
        "(256 MiB message, world_size=16, nodes=2, 50 ms per all-reduce on the slowest rank, "
        "backend=nccl, transport=IB)"
    )
    assert check(r, require_rdma=True, min_busbw_gbps=10) is None
    assert check(r, require_rdma=True, min_busbw_gbps=0) is None  # 0 disables


def test_a_socket_fallback_is_reported_before_its_low_bandwidth() -> None:
    t = parse_nccl_log(log("socket-fallback.log"))
    r = result(t, nodes=2, world_size=4, seconds=0.5)
    assert check(r, require_rdma=True, min_busbw_gbps=40).code == EXIT_NO_RDMA  # type: ignore[union-attr]
    assert check(r, require_rdma=False, min_busbw_gbps=40).code == EXIT_LOW_BUSBW  # type: ignore[union-attr]


def test_metric_line_is_what_the_launcher_parses() -> None:
    r = result(NcclTransport(), nodes=1, world_size=8, seconds=0.002)
    metrics = parse_metrics(r.metric_line())
    assert metrics == pytest.approx(
        {
            "allreduce_busbw_gbps": 234.8810,
            "allreduce_algbw_gbps": 134.2177,
            "allreduce_ms": 2.0,
            "allreduce_mib": 256.0,
            "world_size": 8.0,
        }
    )


# -- NCCL's log settings -----------------------------------------------------------------------


def test_nccl_debug_env_turns_on_what_the_parser_needs() -> None:
    assert nccl_debug_env({}, "/tmp/x") == {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_FILE": "/tmp/x/nccl.%h.%p.log",
    }
    cluster = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": "/l/%h"}
    assert nccl_debug_env(cluster, "/tmp/x") == {}
    assert nccl_debug_env({"NCCL_DEBUG": "WARN", "NCCL_DEBUG_FILE": "f"}, "d") == {
        "NCCL_DEBUG": "INFO"
    }
    for hides_init in ("NET", "^INIT", "^ALL"):
        env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": "f", "NCCL_DEBUG_SUBSYS": hides_init}
        assert nccl_debug_env(env, "d") == {"NCCL_DEBUG_SUBSYS": "INIT,NET"}, hides_init
    for shows_init in ("ALL", "init,coll", "^COLL"):
        env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": "f", "NCCL_DEBUG_SUBSYS": shows_init}
        assert nccl_debug_env(env, "d") == {}, shows_init


def test_nccl_debug_path_expands_like_nccl() -> None:
    assert nccl_debug_path("/l/nccl.%h.%p.log", "pod-0.svc.cluster", 61) == "/l/nccl.pod-0.61.log"
    assert nccl_debug_path("/l/100%%-%x", "h", 1) == "/l/100%-%x"


# -- real runs: gloo on CPU --------------------------------------------------------------------


# Launcher state inherited from an outer torchrun would confuse the runs started here.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even where GPUs are visible
    return env


LOW_MEMLOCK = 64 * 1024  # Docker's old default, and the kernel's before Linux 5.16


def _low_memlock_without_ipc_lock() -> None:
    """In the child before exec: the soft RLIMIT_MEMLOCK lowered to 64 KiB, and CAP_IPC_LOCK
    out of the bounding set (PR_CAPBSET_DROP), so that even as root the exec'd process has
    no effective IPC_LOCK, as a non-root container's process has none
    (kubernetes/kubernetes#56374). Not root: no CAP_SETPCAP, the drop fails, and there was
    no IPC_LOCK to lose."""
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (LOW_MEMLOCK, hard))
    ctypes.CDLL(None, use_errno=True).prctl(24, 14, 0, 0, 0)  # PR_CAPBSET_DROP, CAP_IPC_LOCK


def _start_torchrun(*args: str, low_memlock: bool = False) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return subprocess.Popen(
        [*cmd, "-m", "kubellm.train.fabric", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        preexec_fn=_low_memlock_without_ipc_lock if low_memlock else None,
    )


@pytest.fixture(scope="module")
def torchrun() -> dict[str, subprocess.CompletedProcess[str]]:
    """Both torchrun runs, started together (each is mostly interpreter start-up)."""
    started = {
        "pass": _start_torchrun(),
        "low-busbw": _start_torchrun("--min-busbw-gbps", "1e9", "--iters", "2"),
        "low-memlock": _start_torchrun("--require-rdma", "--iters", "1", low_memlock=True),
    }
    done = {}
    for name, proc in started.items():
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return done


def test_torchrun_two_ranks_measures_gloo_and_passes(
    torchrun: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    proc = torchrun["pass"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "fabric: backend=gloo transport=TCP gdr=n/a world_size=2 nodes=1" in lines
    metrics = parse_metrics(proc.stdout)
    assert metrics["allreduce_busbw_gbps"] > 0
    assert metrics["allreduce_busbw_gbps"] == pytest.approx(metrics["allreduce_algbw_gbps"])
    assert metrics["allreduce_mib"] == 4.0  # the CPU default
    assert metrics["world_size"] == 2.0
    assert "error:" not in proc.stderr


def test_torchrun_below_min_busbw_exits_4_with_one_error_line(
    torchrun: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    proc = torchrun["low-busbw"]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: fabric:")]
    assert len(errors) == 1, proc.stderr[-3000:]  # rank 0 only
    assert "is below --min-busbw-gbps 1e+09 (4 MiB message, world_size=2, nodes=1" in errors[0]
    # the figure is still reported for the launcher
    assert parse_metrics(proc.stdout)["allreduce_busbw_gbps"] > 0
    # torchrun exits 1 for any failed worker; its failure report has the workers' codes: 4,
    # or SIGTERM for a rank still shutting down when torchrun stopped the group
    assert proc.returncode != 0
    root_cause = proc.stderr.split("Root Cause (first observed failure)")[-1]
    assert re.search(r"exitcode\s*: 4\b", root_cause), proc.stderr[-3000:]
    assert set(re.findall(r"exitcode\s*: (-?\d+)", proc.stderr)) <= {"4", "-15"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_main_returns_the_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process, one rank: main() returns the code the process exits with."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(fabric.torch.cuda, "is_available", lambda: False)  # gloo
    assert fabric.main(["--mib", "0.25", "--iters", "2", "--min-busbw-gbps", "1"]) == 4
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert line.startswith("error: fabric: all-reduce busbw 0 GB/s is below --min-busbw-gbps 1")
    assert line.endswith("(a single rank moves no data: busbw is 0)")
    assert parse_metrics(out)["allreduce_busbw_gbps"] == 0.0
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    assert fabric.main(["--mib", "0.25", "--iters", "2"]) == 0


# -- the memlock limit -------------------------------------------------------------------------

GIB = 2**30
UNLIMITED = resource.RLIM_INFINITY


def _memlock(soft: int, hard: int | None = None, **kw: object) -> Memlock:
    kw.setdefault("host", "job-worker-0")
    kw.setdefault("mem_total", 64 * GIB)
    return Memlock(soft, soft if hard is None else hard, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("limit", "shown"),
    [
        (UNLIMITED, "unlimited"),
        (8 * MIB, "8MiB"),
        (64 * 1024, "64KiB"),
        (GIB, "1GiB"),
        (1000, "1000B"),
    ],
)
def test_memlock_size_is_what_ulimit_means(limit: int, shown: str) -> None:
    assert memlock_size(limit) == shown


def test_low_memlock_fails_require_rdma_naming_the_figure_and_the_node_setting() -> None:
    ib = parse_nccl_log(log("ib-2node.log"))
    r = FabricResult("nccl", 16, 2, 256.0, 0.003, ib, _memlock(8 * MIB))
    failure = check(r, require_rdma=True, min_busbw_gbps=0)
    assert failure is not None and failure.code == EXIT_NO_RDMA
    line = str(failure)
    assert "\n" not in line
    assert line.startswith(
        "error: fabric: RDMA required but the locked-memory limit on job-worker-0 is 8MiB "
        "(RLIMIT_MEMLOCK soft; hard 8MiB) and the process has no CAP_IPC_LOCK"
    ), line
    assert "kubernetes/kubernetes#56374" in line
    for setting in ("LimitMEMLOCK=infinity", 'default_ulimits = ["memlock=-1:-1"]'):
        assert setting in line
    # without --require-rdma it is only reported
    assert check(r, require_rdma=False, min_busbw_gbps=0) is None
    assert "memlock_soft_kib=8192 memlock_hard_kib=8192" in r.metric_line()


@pytest.mark.parametrize(
    ("memlock", "why"),
    [
        (_memlock(UNLIMITED), "unlimited"),
        (_memlock(8 * MIB, cap_ipc_lock=True), "CAP_IPC_LOCK: the kernel skips the limit"),
        (_memlock(64 * GIB), "a limit of the node's RAM cannot bind"),
    ],
)
def test_memlock_that_cannot_bind_passes(memlock: Memlock, why: str) -> None:
    ib = parse_nccl_log(log("ib-2node.log"))
    r = FabricResult("nccl", 16, 2, 256.0, 0.003, ib, memlock)
    assert check(r, require_rdma=True, min_busbw_gbps=0) is None, why


def test_memlock_matters_only_across_nodes_and_with_nccl() -> None:
    one_node = parse_nccl_log(log("single-node.log"))
    r = FabricResult("nccl", 4, 1, 256.0, 0.003, one_node, _memlock(64 * 1024))
    assert check(r, require_rdma=True, min_busbw_gbps=0) is None  # no RDMA on one node
    gloo = FabricResult("gloo", 2, 2, 4.0, 0.003, NcclTransport(), _memlock(64 * 1024))
    failure = check(gloo, require_rdma=True, min_busbw_gbps=0)
    assert failure is not None and "backend gloo talks TCP" in failure.message
    assert memlock_failure(_memlock(64 * 1024), nodes=1) is None
    assert memlock_failure(None, nodes=2) is None


def test_the_lowest_binding_limit_is_the_one_reported() -> None:
    ranks = [
        _memlock(UNLIMITED, host="a"),
        _memlock(8 * MIB, host="b", cap_ipc_lock=True),
        _memlock(64 * 1024, host="c"),
        _memlock(8 * MIB, host="d"),
    ]
    assert lowest_memlock(ranks) == ranks[2]
    assert lowest_memlock(ranks[:2]) == ranks[0]  # none binds: any, for the report
    assert lowest_memlock([]) is None
    unlimited = FabricResult("nccl", 2, 1, 4.0, 0.003, memlock=ranks[0])
    assert "memlock_soft_kib=-1 memlock_hard_kib=-1" in unlimited.metric_line()
    assert parse_metrics(unlimited.metric_line())["memlock_soft_kib"] == -1.0


def test_read_memlock_reads_the_effective_capabilities(tmp_path: Path) -> None:
    """CapEff as /proc/<pid>/status prints it (hex); bit 14 is CAP_IPC_LOCK."""
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t0000000000004000\n")
    assert read_memlock(str(status)).cap_ipc_lock is True
    # kubernetes/kubernetes#56374: a non-root process with IPC_LOCK added
    status.write_text("CapInh:\t0000000000004000\nCapEff:\t0000000000000000\n")
    mine = read_memlock(str(status))
    assert mine.cap_ipc_lock is False
    assert (mine.soft, mine.hard) == resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert mine.host == socket.gethostname()


def test_a_process_with_a_low_limit_reads_it_and_fails_with_rdma() -> None:
    """A real process whose soft limit is 64 KiB and which has no effective IPC_LOCK."""
    code = (
        "from kubellm.train import fabric; m = fabric.read_memlock(); print(m.line()); "
        "print(fabric.memlock_failure(m, nodes=2)); print(fabric.memlock_failure(m, nodes=1))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        preexec_fn=_low_memlock_without_ipc_lock,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line, failure, one_node = proc.stdout.splitlines()
    assert line.startswith("fabric: memlock soft=64KiB hard=") and "cap_ipc_lock=no" in line
    assert "locked-memory limit on" in failure and " is 64KiB (RLIMIT_MEMLOCK soft" in failure
    assert one_node == "None"


def test_torchrun_reports_the_memlock_limit_and_without_rdma_between_nodes_passes(
    torchrun: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    """--require-rdma on one node: nothing goes over RDMA, so a low limit is only reported."""
    proc = torchrun["low-memlock"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("fabric: memlock ")]
    assert line.startswith("fabric: memlock soft=64KiB hard=") and "cap_ipc_lock=no" in line
    assert parse_metrics(proc.stdout)["memlock_soft_kib"] == 64.0
    assert "error:" not in proc.stderr
    # the default run reports this machine's own limit
    limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    want = -1.0 if limit == UNLIMITED else float(limit // 1024)
    assert parse_metrics(torchrun["pass"].stdout)["memlock_soft_kib"] == want


def test_require_gpu_fails_before_the_process_group_when_cuda_is_unusable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Preflight's check for a run with gpus_per_node > 0 (issue 22): before, a pod whose
    driver was too old passed it over gloo, and only training stopped."""
    assert not fabric.torch.cuda.is_available()  # this machine: a CPU-only torch
    assert fabric.main(["--require-gpu"]) == 2
    line = capsys.readouterr().out.strip()
    assert line.startswith("fabric: FAIL: gpus_per_node > 0 asks for GPUs: no CUDA device")
    assert "CPU-only build" in line and "\n" not in line


def test_require_gpu_fails_when_the_node_has_fewer_gpus_than_processes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(fabric.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fabric.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert fabric.main(["--require-gpu"]) == 2
    assert "LOCAL_RANK 1 has no GPU, 1 visible" in capsys.readouterr().out
