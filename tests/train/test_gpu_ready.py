"""The first GPU machine, checked without one: the CUDA queries are monkeypatched.

- DDP is built with the buffer keyword the installed torch has (`forward_sync_buffers` from
  torch 2.13, `broadcast_buffers` before: a TypeError on every DDP run otherwise);
- a node with fewer GPUs than processes stops every rank with one line naming LOCAL_RANK,
  the count and CUDA_VISIBLE_DEVICES (not CUDA's "invalid device ordinal" on rank 1), and
  a local run or `kubellm train` starts one process per GPU unless told otherwise;
- a pipeline that asks for GPUs demands nccl, so a node whose driver cannot run the image's
  CUDA stops with the reason instead of training on its CPUs under gloo.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from trainkit import tiny_config

from kubellm import backends
from kubellm.backends.base import JobResult, TrainJob
from kubellm.backends.local import torchrun
from kubellm.config import CPU_NPROC, ConfigError, PipelineConfig, TrainConfig, pipeline_config
from kubellm.stages.configs import train_config
from kubellm.train import model as train_model
from kubellm.train.loop import check

# -- DDP's buffer keyword ------------------------------------------------------------------


class _Rotary(torch.nn.Module):
    """A layer with a constant buffer, as the Llama's rotary frequencies are."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.inv_freq


class _DdpBefore213:
    """DistributedDataParallel's keywords as torch before 2.13 declares them: there is no
    `forward_sync_buffers`, `broadcast_buffers` defaults to True."""

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: list[int] | None = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        self.module = module
        self.device_ids = device_ids
        self.broadcast_buffers = broadcast_buffers


def _forget_the_probe() -> None:
    cached = getattr(train_model, "_constant_buffers", None)
    if cached is not None:
        cached.cache_clear()


@pytest.fixture
def probe() -> Iterator[None]:
    """The signature probe runs once per process: forget it around each test."""
    _forget_the_probe()
    yield
    _forget_the_probe()


@pytest.fixture
def one_process_group(tmp_path: Path) -> Iterator[None]:
    """A 1-process gloo group in this process (a FileStore: no port)."""
    if dist.is_initialized():  # pragma: no cover - another test left one
        yield
        return
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp_config(tmp_path: Path) -> TrainConfig:
    return TrainConfig(dataset_dir=str(tmp_path), output_dir=str(tmp_path / "out"))


def test_ddp_on_this_torch_skips_the_buffer_broadcast_without_a_warning(
    tmp_path: Path, probe: None, one_process_group: None
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # broadcast_buffers is deprecated in 2.13
        wrapped = train_model.place(
            _Rotary(), _ddp_config(tmp_path), torch.device("cpu"), False, distributed=True
        )
    assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
    assert wrapped.broadcast_buffers is False  # 2.13 reads this as forward_sync_buffers
    wrapped(torch.ones(1, 2)).sum().backward()


def test_ddp_on_torch_before_2_13_gets_broadcast_buffers_instead(
    tmp_path: Path, probe: None, monkeypatch: pytest.MonkeyPatch, one_process_group: None
) -> None:
    monkeypatch.setattr(train_model, "DistributedDataParallel", _DdpBefore213)
    layer = _Rotary()
    wrapped = train_model.place(
        layer, _ddp_config(tmp_path), torch.device("cpu"), False, distributed=True
    )
    assert isinstance(wrapped, _DdpBefore213)  # a TypeError before the probe
    assert wrapped.module is layer and wrapped.device_ids is None
    assert wrapped.broadcast_buffers is False
    # The older knob is the one 2.13 maps onto forward_sync_buffers (it also skips the
    # buffers' broadcast at construction: they are computed alike on every rank).
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        real = torch.nn.parallel.DistributedDataParallel(_Rotary(), broadcast_buffers=False)
    assert getattr(real, "forward_sync_buffers", real.broadcast_buffers) is False


# -- one process per GPU ---------------------------------------------------------------------


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """torch as on a machine with `count` usable CUDA devices (0: none usable)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


@pytest.mark.parametrize("local_rank", [0, 1])
def test_more_processes_on_a_node_than_gpus_stop_every_rank_in_one_line(
    tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_rank: int
) -> None:
    _gpus(monkeypatch, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cfg = tiny_config(tiny_dataset, tmp_path / "m")
    with pytest.raises(ConfigError) as info:
        check(cfg, world_size=2, local_rank=local_rank, local_world=2)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("invalid nproc_per_node=2: LOCAL_RANK 1 has no GPU, 1 visible")
    assert "(CUDA_VISIBLE_DEVICES='0')" in message
    assert "nproc_per_node (kubellm train --nproc) <= 1" in message


def test_each_rank_gets_its_own_gpu_when_there_are_enough(
    tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpus(monkeypatch, 2)
    cfg = tiny_config(tiny_dataset, tmp_path / "m")
    plan = check(cfg, world_size=4, local_rank=1, local_world=2)  # 2 nodes x 2 GPUs
    assert (plan.backend, plan.device, plan.bf16) == ("nccl", torch.device("cuda", 1), True)


def _no_torch_count() -> int:
    raise AssertionError("the GPU count is this machine's: a cluster run never asks it")


def test_a_local_run_has_one_process_per_gpu_of_the_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torchrun, "visible_gpus", lambda: 1, raising=False)
    local = backends.resolve(pipeline_config({"platform": "local"}))
    assert local.nproc_per_node == 1
    assert (local.job_cpu, local.job_memory) == ("2", "16Gi")  # its auto sizes follow
    # what every later stage loads: sized, not sized again
    assert PipelineConfig.model_validate_json(local.model_dump_json()).nproc_per_node == 1
    # an explicit count wins, and so do the GPUs a run asks for
    asked = {"platform": "local", "nproc_per_node": 2}
    assert backends.resolve(pipeline_config(asked)).nproc_per_node == 2
    asked = {"platform": "local", "gpus_per_node": 2, "batch_size": 8}
    assert backends.resolve(pipeline_config(asked)).nproc_per_node == 2
    monkeypatch.setattr(torchrun, "visible_gpus", lambda: 0, raising=False)
    assert backends.resolve(pipeline_config({"platform": "local"})).nproc_per_node == CPU_NPROC
    monkeypatch.setattr(torchrun, "visible_gpus", _no_torch_count, raising=False)
    cluster = backends.resolve(pipeline_config({"platform": "kubernetes"}))
    assert cluster.nproc_per_node == CPU_NPROC


def test_a_gpu_count_the_batch_does_not_divide_is_one_line_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torchrun, "visible_gpus", lambda: 3, raising=False)
    with pytest.raises(ConfigError) as info:
        backends.resolve(pipeline_config({"platform": "local", "batch_size": 64}))
    message = str(info.value)
    assert "batch_size (64) must be divisible by nproc_per_node x num_nodes (3)" in message
    assert "nproc_per_node=0: one process per GPU, 3 on this machine" in message


def test_visible_gpus_asks_torch_only_where_an_nvidia_driver_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpus(monkeypatch, 4)
    monkeypatch.setattr(torchrun, "_DRIVER_NODES", (str(tmp_path / "nvidiactl"),))
    assert torchrun.visible_gpus() == 0
    assert torchrun.local_nproc() == CPU_NPROC
    (tmp_path / "nvidiactl").touch()
    assert torchrun.visible_gpus() == 4 and torchrun.local_nproc() == 4
    _gpus(monkeypatch, 0)  # a CPU-only torch, or a driver too old for its CUDA
    assert torchrun.visible_gpus() == 0


@pytest.mark.parametrize(
    ("args", "nproc"),
    [([], 1), (["--nproc", "3"], 3), (["--set", "backend=gloo"], CPU_NPROC)],
)
def test_kubellm_train_starts_one_process_per_gpu_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], nproc: int
) -> None:
    from kubellm.cli import main

    jobs: list[TrainJob] = []

    def run(self: torchrun.TorchrunTrainer, job: TrainJob) -> JobResult:
        jobs.append(job)
        return JobResult(job.name, "", {})

    monkeypatch.setattr(torchrun.TorchrunTrainer, "run", run)
    monkeypatch.setattr(torchrun, "visible_gpus", lambda: 1, raising=False)
    ds, out = str(tmp_path / "ds"), str(tmp_path / "model")
    assert main(["train", "--dataset", ds, "--output", out, *args]) == 0
    assert [job.nproc_per_node for job in jobs] == [nproc]


# -- GPUs asked for, none usable: nccl, and the reason ----------------------------------------


def test_a_pipeline_that_asks_for_gpus_demands_nccl(tmp_path: Path) -> None:
    gpu = pipeline_config({"gpus_per_node": 8})
    assert train_config(gpu, tmp_path, tmp_path).backend == "nccl"
    assert train_config(pipeline_config(), tmp_path, tmp_path).backend == "auto"
    dumped = json.loads(train_config(gpu, tmp_path, tmp_path, steps=5).model_dump_json())
    assert dumped["backend"] == "nccl"  # what the job reads (--config)


def test_nccl_without_a_usable_gpu_says_why(
    tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path / "m", backend="nccl")
    _gpus(monkeypatch, 0)

    def old_driver() -> None:  # what torch's lazy init says on a node older than its CUDA
        raise RuntimeError(
            "The NVIDIA driver on your system is too old (found version 12020).\nPlease update"
        )

    monkeypatch.setattr(torch.cuda, "init", old_driver)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError) as info:
        check(cfg, world_size=2)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("invalid backend='nccl': no CUDA device is visible: ")
    assert "torch.cuda.is_available() is False (The NVIDIA driver on your system is too old" in (
        message
    )
    assert "(CUDA_VISIBLE_DEVICES='0,1')" in message
    assert "support CUDA 13.0? (CUDA 13 needs R580 or newer)" in message
    assert "gpus_per_node > 0 demands nccl" in message and "gpus_per_node=0" in message


def test_nccl_on_a_cpu_only_torch_says_so(
    tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.version.cuda:  # pragma: no cover - the CUDA build
        pytest.skip("this torch is built for CUDA")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ConfigError) as info:
        check(tiny_config(tiny_dataset, tmp_path / "m", backend="nccl"), world_size=2)
    message = str(info.value)
    assert "Torch not compiled with CUDA enabled" in message
    assert "this torch is a CPU-only build" in message and "CUDA_VISIBLE_DEVICES" not in message


@pytest.mark.parametrize("newer", [True, False])
def test_activation_checkpointing_uses_the_name_this_transformers_has(newer: bool) -> None:
    """transformers renamed gradient_checkpointing_enable to activation_checkpointing_enable;
    the GPU image's (5.17) may have only the older name."""
    from kubellm.train.model import activation_checkpointing

    calls: list[tuple[str, tuple[object, ...]]] = []

    class Old:
        def gradient_checkpointing_enable(self, kwargs: object = None) -> None:
            calls.append(("gradient_enable", (kwargs,)))

        def gradient_checkpointing_disable(self) -> None:
            calls.append(("gradient_disable", ()))

    class New(Old):
        def activation_checkpointing_enable(self, kwargs: object = None) -> None:
            calls.append(("activation_enable", (kwargs,)))

        def activation_checkpointing_disable(self) -> None:
            calls.append(("activation_disable", ()))

    model = New() if newer else Old()
    activation_checkpointing(model, True)
    activation_checkpointing(model, False)
    kind = "activation" if newer else "gradient"
    assert calls == [(f"{kind}_enable", ({"use_reentrant": False},)), (f"{kind}_disable", ())]
