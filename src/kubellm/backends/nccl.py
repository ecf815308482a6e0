"""The fabric profiles: the NCCL settings a `fabric` parameter stands for, on every platform
(the Kubernetes pods' env, kubellm.backends.kubernetes.podspec; the Slurm scripts' exports,
kubellm.backends.slurm.script). `nccl_env` overrides them key by key."""

from __future__ import annotations

_RDMA_DEFAULTS = {
    "NCCL_IB_DISABLE": "0",
    "NCCL_IB_HCA": "mlx5",
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_NET_GDR_LEVEL": "PHB",
    "NCCL_DEBUG": "INFO",
    "NCCL_DEBUG_SUBSYS": "INIT,NET",
}
NCCL_PROFILES: dict[str, dict[str, str]] = {
    "tcp": {},
    "rdma-ib": _RDMA_DEFAULTS,
    "roce": {**_RDMA_DEFAULTS, "NCCL_IB_GID_INDEX": "3"},
}


def fabric_env(fabric: str, overrides: dict[str, str]) -> dict[str, str]:
    """The profile's NCCL settings with `overrides` on top; an unknown fabric is an error."""
    if fabric not in NCCL_PROFILES:
        raise ValueError(f"unknown fabric {fabric!r}; one of {', '.join(NCCL_PROFILES)}")
    return {**NCCL_PROFILES[fabric], **overrides}
