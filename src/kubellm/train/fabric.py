"""Fabric preflight: an all-reduce benchmark with the training topology that can fail.

Runs under the same launcher as training (torchrun locally with gloo on CPU, a short
PyTorchJob with NCCL on GPUs on the cluster) before training starts:

    torchrun --standalone --nproc_per_node=2 -m kubellm.train.fabric
    torchrun ... -m kubellm.train.fabric --require-rdma --min-busbw-gbps 40

Rank 0 prints three lines on stdout, the last one a metric line (`metric_lines.py`):

    fabric: backend=nccl transport=IB gdr=yes world_size=16 nodes=2
    fabric: memlock soft=unlimited hard=unlimited cap_ipc_lock=no host=job-worker-0
    allreduce_busbw_gbps=181.2 allreduce_algbw_gbps=96.64 allreduce_ms=2.778 \
allreduce_mib=256 world_size=16 memlock_soft_kib=-1 memlock_hard_kib=-1

Bandwidth is measured the nccl-tests way (doc/PERFORMANCE.md in NVIDIA/nccl-tests): the
mean time of `--iters` all-reduces of `--mib` MiB after `--warmup` untimed ones, taken
from the slowest rank; algbw = bytes / time and busbw = algbw * 2(n-1)/n, both in GB/s
(10^9 bytes per second, the unit nccl-tests prints; `_gbps` means that here). A 256 MiB
message measures bandwidth; a few MiB mostly measures latency.

The transport is what NCCL itself logged (`NCCL_DEBUG=INFO`), read from every rank's
`NCCL_DEBUG_FILE`: the `Using network <plugin>` line (src/init.cc) and the per-channel
connection lines `Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA`
(src/transport/net.cc), `via P2P/...` (p2p.cc) and `via SHM/...` (shm.cc). A substring
such as `NET/IB` proves nothing: NCCL's socket fallback logs `NET/IB : No device found.`
A run whose channels are all P2P/SHM never touched the network (transport `intra-node`).

The locked-memory limit is every rank's RLIMIT_MEMLOCK (soft and hard; the metrics give
KiB as `ulimit -l` does, -1 for unlimited, RLIM_INFINITY as `resource` reports it), the
lowest one reported. RDMA memory registration pins pages against the soft limit unless the
process has CAP_IPC_LOCK (ib_umem_get in the kernel's drivers/infiniband/core/umem.c), and a
non-root container does not get the IPC_LOCK its securityContext adds: without ambient
capabilities it lands in the bounding set only (kubernetes/kubernetes#56374; our images run
as uid 10001). So the node's container-runtime limit decides, and with --require-rdma across
nodes anything short of unlimited fails before NCCL starts (see `memlock_failure`).

Exit codes (every rank exits with the same code; rank 0 prints the one-line error):

    0  passed
    3  --require-rdma, and NCCL moved inter-node traffic over TCP sockets (or its log does
       not show which transport it used), or a rank's memlock limit is too low for RDMA
    4  --min-busbw-gbps X, and the measured busbw is below X

Under torchrun the launcher itself exits 1 when a worker fails; its failure report shows
the workers' exit code.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kubellm.train import gpus

EXIT_NO_RDMA = 3
EXIT_LOW_BUSBW = 4

# What a plain CPU run (gloo) measures unless told otherwise: enough to see the number,
# quick enough for a laptop. On CUDA the nccl-tests-like defaults apply.
CUDA_DEFAULTS = {"mib": 256.0, "warmup": 5, "iters": 20}
CPU_DEFAULTS = {"mib": 4.0, "warmup": 1, "iters": 5}

# Where the fix is, named by the pipeline parameters that set it (config.py).
RDMA_FIX = (
    "give the pods the RDMA device resource (fabric=rdma-ib|roce, rdma_resource, e.g. "
    "rdma/rdma_shared_device_a), set NCCL_IB_HCA to the pod's HCAs (nccl_env), and attach the "
    "Multus RDMA network (network_annotation, k8s.v1.cni.cncf.io/networks); "
    "see manifests/overlays/rdma/README.md"
)

# The node settings that raise the memlock limit of every container on the node: the
# runtime's own limit, which its containers inherit (containerd's unit sets none, so the
# node's default for services applies: 8 MiB on current kernels and systemd, 64 KiB on older
# ones), or CRI-O's per-container default (containerd/containerd containerd.service @v2.1.0;
# cri-o's crio.conf `default_ulimits`).
MEMLOCK_FIX = (
    "set the container runtime's memlock limit to unlimited on the GPU nodes and restart it: "
    "containerd: LimitMEMLOCK=infinity in a drop-in for containerd.service, CRI-O: "
    'default_ulimits = ["memlock=-1:-1"] in crio.conf ([crio.runtime]); '
    "see manifests/README.md, 'RDMA nodes: the memlock limit'"
)
CAP_IPC_LOCK = 14  # linux/capability.h

# -- NCCL's INFO log ------------------------------------------------------------------------
# Every INFO line starts "<host>:<pid>:<tid> [<cudaDev>] NCCL INFO " (src/debug.cc); launchers
# may prefix more ("[1,0]<stdout>:"), so lines are searched, not matched from the start.
_INFO = re.compile(r"(?:(?P<host>[^\s:\]>]+):\d+:\d+ \[\d+\] )?NCCL INFO (?P<msg>.*?)\s*$")
_USING_NETWORK = re.compile(r"^Using network (?P<name>.+)$")
# "Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA" (net.cc), "Channel 01/0 : 1[1] ->
# 0[0] via P2P/IPC/read" (p2p.cc), "Channel 00 : 2[1] -> 0[0] via SHM/direct/direct" (shm.cc).
# Older NCCL printed bus ids in the brackets ("2[c7000]") and no "/<connIndex>".
_CHANNEL = re.compile(
    r"^Channel \d+(?:/\d+)? : \d+\[\w+\] -> \d+\[\w+\] (?:\[(?:send|receive)\] )?via (?P<via>.+)$"
)
# "NET/<plugin name>/<netDev>[(<proxyRank>)][/GDRDMA][(PCI)][/Shared]"; plugin names can hold
# spaces ("AWS Libfabric") and underscores ("IBext_v8").
_VIA_NET = re.compile(r"^NET/(?P<name>.+?)/\d+(?:\(\d+\))?(?P<gdr>/GDRDMA)?")
_OFI_PROVIDER = re.compile(r"^NET/OFI Selected [Pp]rovider is (?P<provider>[\w;+-]+)")
_VERSION = re.compile(r"^NCCL version (?P<version>\S+)")
IB_NO_DEVICE = "NET/IB : No device found."
# Libfabric providers (aws-ofi-nccl) that are TCP in disguise: "Using network AWS Libfabric"
# reads the same whichever provider it bound.
_TCP_PROVIDERS = frozenset({"tcp", "sockets", "udp", "tcp;ofi_rxm", "udp;ofi_rxd"})


@dataclass(frozen=True)
class NcclTransport:
    """What NCCL's INFO log says about the transports it chose (all ranks' lines together).

    networks     the `Using network <name>` plugin names: IB, Socket, IBext_v8, AWS Libfabric
    inter_node   transports of the NET channel lines: NET/IB, NET/IB/GDRDMA, NET/Socket
    intra_node   transports of the other channel lines: P2P/IPC, P2P/CUMEM, SHM, ...
    gdr          GPUDirect RDMA on at least one NET channel
    """

    networks: frozenset[str] = frozenset()
    inter_node: frozenset[str] = frozenset()
    intra_node: frozenset[str] = frozenset()
    gdr: bool = False
    ib_no_device: bool = False  # "NET/IB : No device found." (NCCL looked for IB, found none)
    ofi_providers: frozenset[str] = frozenset()
    hosts: frozenset[str] = frozenset()
    versions: frozenset[str] = frozenset()

    @property
    def network(self) -> str | None:
        """The network plugin NCCL chose ("IB", "Socket", ...); None if not logged."""
        return "+".join(sorted(self.networks)) or None

    @property
    def net_names(self) -> frozenset[str]:
        """The plugin names the NET channel lines went through: {"IB"}, {"Socket"}."""
        return frozenset(t.removeprefix("NET/").removesuffix("/GDRDMA") for t in self.inter_node)

    @property
    def kind(self) -> str:
        """Transport between nodes as printed: the NET plugin name(s) of the channel lines,
        `intra-node` when every channel is P2P/SHM, `unknown` without channel lines."""
        if self.inter_node:
            return "+".join(sorted(self.net_names))
        return "intra-node" if self.intra_node else "unknown"

    @property
    def sockets(self) -> bool:
        """NCCL moves data over TCP: it chose the Socket plugin, a channel goes via
        NET/Socket, or a libfabric plugin bound a TCP provider."""
        return (
            "Socket" in self.networks
            or "Socket" in self.net_names
            or bool(self.ofi_providers & _TCP_PROVIDERS)
        )

    def describe(self) -> str:
        """What was seen, for error messages: `network=Socket, channels via NET/Socket`."""
        parts = [f"network={self.network or 'not logged'}"]
        if self.inter_node:
            parts.append("channels via " + ", ".join(sorted(self.inter_node)))
        elif self.intra_node:
            parts.append("channels only via " + ", ".join(sorted(self.intra_node)))
        else:
            parts.append("no channel lines")
        if self.ofi_providers:
            parts.append("libfabric provider " + "+".join(sorted(self.ofi_providers)))
        if self.ib_no_device:
            parts.append(f'NCCL logged "{IB_NO_DEVICE}"')
        return ", ".join(parts)


def _intra_node_transport(via: str) -> str:
    """`P2P/IPC/read` -> `P2P/IPC`, `P2P/direct pointer` stays, `SHM/direct/direct` -> `SHM`."""
    head, _, rest = via.partition("/")
    if head == "P2P" and rest:
        return f"P2P/{rest.split('/')[0]}"
    return head


def parse_nccl_log(lines: Iterable[str]) -> NcclTransport:
    """The transports NCCL chose, from its INFO lines (any number of ranks' logs together).

    Lines starting with `#` (fixture comments) and lines that are not NCCL INFO are ignored.
    """
    networks: set[str] = set()
    inter: set[str] = set()
    intra: set[str] = set()
    providers: set[str] = set()
    hosts: set[str] = set()
    versions: set[str] = set()
    gdr = ib_no_device = False
    for line in lines:
        if line.lstrip().startswith("#"):
            continue
        info = _INFO.search(line)
        if info is None:
            continue
        if info["host"]:
            hosts.add(info["host"])
        msg = info["msg"]
        if m := _USING_NETWORK.match(msg):
            networks.add(m["name"])
        elif m := _CHANNEL.match(msg):
            via = m["via"]
            if net := _VIA_NET.match(via):
                inter.add(f"NET/{net['name']}{net['gdr'] or ''}")
                gdr = gdr or bool(net["gdr"])
            else:
                intra.add(_intra_node_transport(via))
        elif msg.startswith(IB_NO_DEVICE):
            ib_no_device = True
        elif m := _OFI_PROVIDER.match(msg):
            providers.add(m["provider"].lower())
        elif m := _VERSION.match(msg):
            versions.add(m["version"])
    return NcclTransport(
        networks=frozenset(networks),
        inter_node=frozenset(inter),
        intra_node=frozenset(intra),
        gdr=gdr,
        ib_no_device=ib_no_device,
        ofi_providers=frozenset(providers),
        hosts=frozenset(hosts),
        versions=frozenset(versions),
    )


# -- bandwidth and verdict ------------------------------------------------------------------


def allreduce_bandwidth(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for an all-reduce of `nbytes` per rank taking `seconds`.

    nccl-tests doc/PERFORMANCE.md: algbw = S/t, busbw = algbw * 2(n-1)/n (one rank: 0).
    """
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


@dataclass(frozen=True)
class Memlock:
    """One rank's locked-memory limit: RLIMIT_MEMLOCK soft and hard, in bytes, with
    `resource.RLIM_INFINITY` for unlimited; whether CAP_IPC_LOCK is in its effective set
    (then the kernel does not apply the limit to RDMA registration); and the RAM of its
    node (a limit that large cannot bind either)."""

    soft: int
    hard: int
    cap_ipc_lock: bool = False
    host: str = ""
    mem_total: int = 0  # bytes of RAM (/proc/meminfo MemTotal); 0 when unknown

    @property
    def binds(self) -> bool:
        """Whether the soft limit can stop RDMA from pinning memory."""
        if self.cap_ipc_lock or self.soft == resource.RLIM_INFINITY:
            return False
        return not (self.mem_total and self.soft >= self.mem_total)

    def line(self) -> str:
        return (
            f"fabric: memlock soft={memlock_size(self.soft)} hard={memlock_size(self.hard)} "
            f"cap_ipc_lock={'yes' if self.cap_ipc_lock else 'no'} host={self.host or '?'}"
        )

    def metrics(self) -> str:
        return f"memlock_soft_kib={_kib(self.soft)} memlock_hard_kib={_kib(self.hard)}"


def memlock_size(limit: int) -> str:
    """A limit as `ulimit -l` would mean it: `unlimited`, `8MiB`, `64KiB`, `1000B`."""
    if limit == resource.RLIM_INFINITY:
        return "unlimited"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if limit >= size and limit % size == 0:
            return f"{limit // size}{unit}"
    return f"{limit}B"


def _kib(limit: int) -> int:
    return -1 if limit == resource.RLIM_INFINITY else limit // 1024


def read_memlock(status_path: str = "/proc/self/status") -> Memlock:
    """This process's RLIMIT_MEMLOCK and whether CAP_IPC_LOCK is effective (`CapEff` of
    /proc/self/status; absent off Linux: not effective)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    cap = False
    for line in _read_lines(status_path):
        if line.startswith("CapEff:"):
            cap = bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    mem_total = 0
    for line in _read_lines("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            mem_total = int(line.split()[1]) * 1024
    return Memlock(soft, hard, cap, socket.gethostname(), mem_total)


def lowest_memlock(limits: Iterable[Memlock]) -> Memlock | None:
    """The rank whose limit binds first: the lowest soft limit that binds, else any."""
    limits = list(limits)
    binding = [m for m in limits if m.binds]
    return min(binding, key=lambda m: m.soft) if binding else (limits[0] if limits else None)


def memlock_failure(memlock: Memlock | None, nodes: int) -> str | None:
    """Why `memlock` is too low for NCCL's RDMA registration across `nodes`, or None.

    The threshold is unlimited (or CAP_IPC_LOCK, or a limit of at least the node's RAM): what
    NCCL's troubleshooting guide asks of containers (`--ulimit memlock=-1`). NCCL pins its
    network buffers (NCCL_BUFFSIZE, 4 MiB, per channel and peer) and any registered user
    buffers, so what it needs grows with the job; 8 MiB, today's default, already fails
    with "ibv_reg_mr ... Cannot allocate memory" (NVIDIA/nccl-tests#206). One node: no RDMA.
    """
    if memlock is None or nodes <= 1 or not memlock.binds:
        return None
    return (
        f"RDMA required but the locked-memory limit on {memlock.host or 'a node'} is "
        f"{memlock_size(memlock.soft)} (RLIMIT_MEMLOCK soft; hard "
        f"{memlock_size(memlock.hard)}) and the process has no CAP_IPC_LOCK (a non-root "
        "container gets none from securityContext capabilities.add: kubernetes/kubernetes"
        "#56374): NCCL's RDMA memory registration needs it unlimited; " + MEMLOCK_FIX
    )


@dataclass(frozen=True)
class FabricResult:
    """One fabric check: what was measured and which transport carried it."""

    backend: str  # "nccl" or "gloo"
    world_size: int
    nodes: int
    mib: float  # message size per rank
    seconds: float  # slowest rank's mean time per all-reduce
    transport: NcclTransport = field(default_factory=NcclTransport)
    memlock: Memlock | None = None  # the lowest rank's limit (see `lowest_memlock`)

    @property
    def nbytes(self) -> int:
        return _numel(self.mib) * 4

    @property
    def algbw_gbps(self) -> float:
        return allreduce_bandwidth(self.nbytes, self.seconds, self.world_size)[0]

    @property
    def busbw_gbps(self) -> float:
        return allreduce_bandwidth(self.nbytes, self.seconds, self.world_size)[1]

    @property
    def transport_name(self) -> str:
        """NCCL's inter-node transport (IB, Socket, intra-node, ...); gloo always uses TCP."""
        return self.transport.kind if self.backend == "nccl" else "TCP"

    @property
    def single_node_without_network(self) -> bool:
        """One node and no NET channel: no network traffic, nothing for --require-rdma."""
        return self.nodes <= 1 and not self.transport.inter_node

    def fabric_line(self) -> str:
        gdr = ("yes" if self.transport.gdr else "no") if self.transport.inter_node else "n/a"
        return (
            f"fabric: backend={self.backend} transport={self.transport_name.replace(' ', '_')} "
            f"gdr={gdr} world_size={self.world_size} nodes={self.nodes}"
        )

    def metric_line(self) -> str:
        line = (
            f"allreduce_busbw_gbps={self.busbw_gbps:.4f} "
            f"allreduce_algbw_gbps={self.algbw_gbps:.4f} "
            f"allreduce_ms={self.seconds * 1e3:.4f} allreduce_mib={self.mib:g} "
            f"world_size={self.world_size}"
        )
        return f"{line} {self.memlock.metrics()}" if self.memlock else line


@dataclass(frozen=True)
class Failure:
    code: int  # EXIT_NO_RDMA or EXIT_LOW_BUSBW
    message: str  # one line, without the "error: fabric: " prefix

    def __str__(self) -> str:
        return f"error: fabric: {self.message}"


def rdma_failure(result: FabricResult) -> str | None:
    """Why `result` does not show RDMA between nodes, or None if it does (or there are no
    nodes to connect)."""
    if result.single_node_without_network:
        return None
    where = f"world_size={result.world_size} on {result.nodes} nodes"
    if result.backend != "nccl":
        return (
            f"RDMA required but backend {result.backend} talks TCP between nodes ({where}; "
            "CUDA is not available, so NCCL was not used)"
        )
    t = result.transport
    if t.sockets:
        return (
            f"RDMA required but NCCL used TCP sockets between nodes ({t.describe()}; {where}, "
            f"busbw {result.busbw_gbps:.3g} GB/s): {RDMA_FIX}"
        )
    if not t.inter_node:
        return (
            f"RDMA required but NCCL's log shows no inter-node channel (transport={t.kind}, "
            f"{t.describe()}; {where}): run with NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS "
            "including INIT so the fabric check can read NCCL's choice"
        )
    return None


def busbw_failure(result: FabricResult, min_busbw_gbps: float) -> str | None:
    """Why busbw misses `min_busbw_gbps` (0 disables), or None."""
    if min_busbw_gbps <= 0 or result.busbw_gbps >= min_busbw_gbps:
        return None
    single = " (a single rank moves no data: busbw is 0)" if result.world_size == 1 else ""
    return (
        f"all-reduce busbw {result.busbw_gbps:.4g} GB/s is below --min-busbw-gbps "
        f"{min_busbw_gbps:g} ({result.mib:g} MiB message, world_size={result.world_size}, "
        f"nodes={result.nodes}, {result.seconds * 1e3:.4g} ms per all-reduce on the slowest "
        f"rank, backend={result.backend}, transport={result.transport_name}){single}"
    )


def check(result: FabricResult, require_rdma: bool, min_busbw_gbps: float) -> Failure | None:
    """The verdict: the RDMA requirement first (a socket fallback also explains low
    bandwidth; the memlock limit before the transport, as it is the cause), then the
    bandwidth threshold."""
    if require_rdma and result.backend == "nccl":
        nodes = 1 if result.single_node_without_network else max(result.nodes, 2)
        if message := memlock_failure(result.memlock, nodes):
            return Failure(EXIT_NO_RDMA, message)
    if require_rdma and (message := rdma_failure(result)):
        return Failure(EXIT_NO_RDMA, message)
    if message := busbw_failure(result, min_busbw_gbps):
        return Failure(EXIT_LOW_BUSBW, message)
    return None


# -- NCCL's log files -------------------------------------------------------------------------


def nccl_debug_env(env: Mapping[str, str], log_dir: str) -> dict[str, str]:
    """The NCCL settings this process needs so NCCL logs its transport choice to a file:
    INFO level, the INIT subsystem, and a `NCCL_DEBUG_FILE` (kept when already set)."""
    out: dict[str, str] = {}
    if env.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        out["NCCL_DEBUG"] = "INFO"
    subsys = env.get("NCCL_DEBUG_SUBSYS", "").strip()
    if subsys:  # unset means NCCL's default mask, which includes INIT
        names = {s.strip().upper() for s in subsys.lstrip("^").split(",")}
        names_init = bool(names & {"INIT", "ALL"})
        excluded = subsys.startswith("^")  # "^X,Y": everything but X and Y
        if names_init == excluded:
            out["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    if not env.get("NCCL_DEBUG_FILE"):
        out["NCCL_DEBUG_FILE"] = os.path.join(log_dir, "nccl.%h.%p.log")
    return out


def nccl_debug_path(pattern: str, hostname: str, pid: int) -> str:
    """NCCL_DEBUG_FILE as NCCL expands it (src/debug.cc): %h is the host name up to its
    first dot, %p the pid, %% a percent sign; anything else stays."""
    host = hostname.split(".")[0]
    return re.sub(r"%(.)", lambda m: {"h": host, "p": str(pid), "%": "%"}.get(m[1], m[0]), pattern)


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, errors="replace") as fh:
            return fh.read().splitlines()
    except OSError:
        return []


def _relevant(line: str) -> bool:
    """The lines parse_nccl_log reads (kept small before they are gathered to rank 0)."""
    return "NCCL INFO" in line and any(
        key in line for key in ("Using network", " via ", "NET/", "NCCL version")
    )


# -- the check --------------------------------------------------------------------------------


def _numel(mib: float) -> int:
    return max(1, int(mib * 2**20) // 4)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kubellm.train.fabric",
        description="All-reduce bus bandwidth and NCCL transport check, run under torchrun.",
        epilog=(
            "Defaults on CUDA: --mib 256 --warmup 5 --iters 20; on CPU (gloo): --mib 4 "
            "--warmup 1 --iters 5. Exit codes: 0 passed, 2 --require-gpu failed, 3 "
            "--require-rdma failed, 4 --min-busbw-gbps failed."
        ),
    )
    parser.add_argument("--mib", type=float, help="all-reduce message size per rank, MiB")
    parser.add_argument("--warmup", type=int, help="untimed all-reduces first")
    parser.add_argument("--iters", type=int, help="timed all-reduces (the mean is reported)")
    parser.add_argument(
        "--require-rdma",
        action="store_true",
        help="fail (exit 3) unless NCCL moves inter-node traffic over RDMA, not TCP sockets",
    )
    parser.add_argument(
        "--require-gpu",
        action="store_true",
        help="fail (exit 2) unless every process of the node has a CUDA device: a pipeline "
        "with gpus_per_node > 0 (not a silent fallback to gloo on the CPU)",
    )
    parser.add_argument(
        "--min-busbw-gbps",
        type=float,
        default=0.0,
        help="fail (exit 4) when all-reduce busbw (GB/s) is below this; 0 disables",
    )
    args = parser.parse_args(argv)
    if args.mib is not None and args.mib <= 0:
        parser.error("--mib must be > 0")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.iters is not None and args.iters < 1:
        parser.error("--iters must be >= 1")
    return args


def _time_allreduce(x: torch.Tensor, warmup: int, iters: int) -> float:
    """Mean seconds per all-reduce of `x` on this rank: CUDA events on GPU, perf_counter
    on CPU (gloo's all_reduce returns when it is done)."""
    for _ in range(warmup):
        dist.all_reduce(x)
    if x.is_cuda:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    return (time.perf_counter() - t0) / iters


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    use_cuda = torch.cuda.is_available()
    if args.require_gpu:  # before the process group: every rank stops on its own
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        problem = (
            gpus.cuda_unusable() if not use_cuda else gpus.too_few_gpus(local_rank, local_world)
        )
        if problem:
            print(f"fabric: FAIL: gpus_per_node > 0 asks for GPUs: {problem}", flush=True)
            return 2
    defaults = CUDA_DEFAULTS if use_cuda else CPU_DEFAULTS
    mib = float(args.mib if args.mib is not None else defaults["mib"])
    warmup = int(args.warmup if args.warmup is not None else defaults["warmup"])
    iters = int(args.iters if args.iters is not None else defaults["iters"])

    log_file = ""
    if use_cuda:
        os.environ.update(nccl_debug_env(os.environ, tempfile.mkdtemp(prefix="nccl-")))
        log_file = nccl_debug_path(os.environ["NCCL_DEBUG_FILE"], socket.gethostname(), os.getpid())
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if use_cuda else "gloo"
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    dist.init_process_group(backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        # Every rank's memlock limit, before NCCL's first collective registers memory (and
        # fails in its own words when the limit is low): gathered over gloo, which pins none.
        meta = dist.new_group(backend="gloo") if backend != "gloo" else None
        limits: list[Memlock | None] = [None] * world
        dist.all_gather_object(limits, read_memlock(), group=meta)
        memlock = lowest_memlock(m for m in limits if m is not None)
        nodes = len({m.host for m in limits if m is not None})
        too_low = memlock_failure(memlock, nodes) if backend == "nccl" else None
        if args.require_rdma and too_low:  # the same list on every rank: the same verdict
            if rank == 0 and memlock is not None:
                print(memlock.line(), flush=True)
                print(Failure(EXIT_NO_RDMA, too_low), file=sys.stderr, flush=True)
            return EXIT_NO_RDMA
        x = torch.ones(_numel(mib), dtype=torch.float32, device=device)
        slowest = torch.tensor([_time_allreduce(x, warmup, iters)], dtype=torch.float64)
        slowest = slowest.to(device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank reports the same time

        # Each rank reads its own NCCL log (nodes do not share a filesystem); rank 0 merges.
        mine = (socket.gethostname(), [ln for ln in _read_lines(log_file) if _relevant(ln)])
        gathered: list[tuple[str, list[str]] | None] = [None] * world
        dist.all_gather_object(gathered, mine)
        ranks = [g for g in gathered if g is not None]
        result = FabricResult(
            backend=backend,
            world_size=world,
            nodes=len({host for host, _ in ranks}),
            mib=mib,
            seconds=float(slowest.item()),
            transport=parse_nccl_log(ln for _, lines in ranks for ln in lines),
            memlock=memlock,
        )
        failure = check(result, args.require_rdma, args.min_busbw_gbps)
        # One verdict for every rank: rank 0's (the inputs are the same everywhere anyway).
        code = torch.tensor([failure.code if failure else 0], dtype=torch.int64, device=device)
        dist.broadcast(code, src=0)
        if rank == 0:
            print(result.fabric_line(), flush=True)
            if memlock is not None:
                print(memlock.line(), flush=True)
            if args.require_rdma and result.single_node_without_network:
                print(
                    "fabric: --require-rdma: one node, no inter-node traffic: no network to check",
                    flush=True,
                )
            print(result.metric_line(), flush=True)
            if failure:
                print(failure, file=sys.stderr, flush=True)
        return int(code.item())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from kubellm.process import exit_now

    exit_now(main())  # without the interpreter's teardown (kubellm/process.py)
