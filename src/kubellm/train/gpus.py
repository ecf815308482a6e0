"""Whether this process can have its GPU, asked before any process group exists.

Shared by the training engine (kubellm.train.loop.check) and the fabric check
(kubellm.train.fabric), so a pod that asked for GPUs and cannot use them fails preflight, in
the same words training would, instead of passing it over gloo.
"""

from __future__ import annotations

import os

import torch


def _shown_devices() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""


def cuda_unusable() -> str:
    """Why torch sees no CUDA device: torch's own reason (a CPU-only build, no driver, a
    driver too old for this torch's CUDA), the versions, and what to look at."""
    try:
        torch.cuda.init()
        why = "no device"
    except Exception as err:  # AssertionError on a CPU-only build, else RuntimeError
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
    built = torch.version.cuda
    r580 = " (CUDA 13 needs R580 or newer)" if (built or "").startswith("13.") else ""
    hint = (
        f"does the node's NVIDIA driver support CUDA {built}?{r580}"
        if built
        else "this torch is a CPU-only build"
    )
    return (
        f"no CUDA device is visible: torch.cuda.is_available() is False ({why}; torch "
        f"{torch.__version__}{_shown_devices()}); {hint}"
    )


def too_few_gpus(local_rank: int, local_world: int) -> str | None:
    """None when every process of this node (LOCAL_WORLD_SIZE) has a GPU of its own, else
    what is missing."""
    gpus = torch.cuda.device_count()
    ranks = max(local_world, local_rank + 1)
    if ranks <= gpus:
        return None
    return (
        f"LOCAL_RANK {ranks - 1} has no GPU, {gpus} visible{_shown_devices()} for the {ranks} "
        "processes of this node (LOCAL_WORLD_SIZE)"
    )
