"""What a GPU run depends on, checked without a GPU: the metrics window ends once the device has
run the window's work, the NCCL process group's settings (flight recorder, device binding,
start-up and training timeouts), the end-of-run wait for rank 0's export on a gloo group of its
own, the export dtype, and a hub model downloaded before the process group exists.

One in-process run (a one-rank gloo group, KUBELLM_FORCE_DISTRIBUTED=1) is shared by the
tests that need the loop; a fake device stands in for CUDA's asynchrony: each step queues one
second of work that only a sync (float() of a tensor) lets the clock see.
"""

from __future__ import annotations

import contextlib
import io
import os
import types
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed import distributed_c10d
from trainkit import tiny_config

from kubellm.config import TrainConfig
from kubellm.train import loop, startup
from kubellm.train.loop import FORCE_DISTRIBUTED_ENV, Plan, process_group_setup, settled
from kubellm.train.metric_lines import parse_metrics

CKPT = "/volume/run/ckpt"


def _plan(backend: str, device: torch.device) -> Plan:
    return Plan(None, micro_batch=1, seq_len=16, device=device, backend=backend, bf16=False)


def _cfg(**values: Any) -> TrainConfig:
    return TrainConfig(dataset_dir="d", output_dir="o", **values)


def test_nccl_gets_the_flight_recorder_a_device_and_the_start_up_timeout() -> None:
    plan = _plan("nccl", torch.device("cuda", 3))
    env, kwargs = process_group_setup(plan, _cfg(checkpoint_dir=CKPT, init_timeout_s=900), {})
    assert env == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": f"{CKPT}/flight-recorder/nccl_trace_rank_",
    }
    assert kwargs == {
        "backend": "nccl",
        "timeout": timedelta(seconds=900),
        "device_id": torch.device("cuda", 3),
    }
    # without a checkpoint_dir the dumps go where torch puts them by default
    env, _ = process_group_setup(plan, _cfg(), {})
    assert "TORCH_FR_DUMP_TEMP_FILE" not in env and "TORCH_FR_BUFFER_SIZE" in env


def test_the_users_nccl_environment_wins_under_any_of_its_names() -> None:
    plan = _plan("nccl", torch.device("cuda", 0))
    user = {
        "NCCL_ASYNC_ERROR_HANDLING": "1",  # the old name of TORCH_NCCL_ASYNC_ERROR_HANDLING
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",  # the old name of TORCH_FR_BUFFER_SIZE
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/mine_",  # of TORCH_FR_DUMP_TEMP_FILE
    }
    env, _ = process_group_setup(plan, _cfg(checkpoint_dir=CKPT), user)
    assert env == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def test_gloo_gets_no_nccl_settings() -> None:
    env, kwargs = process_group_setup(
        _plan("gloo", torch.device("cpu")), _cfg(checkpoint_dir=CKPT, init_timeout_s=77), {}
    )
    assert env == {}
    assert kwargs == {"backend": "gloo", "timeout": timedelta(seconds=77)}


def test_train_sets_the_nccl_environment_before_the_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def init(**kwargs: Any) -> None:
        seen.update(kwargs, env={n: os.environ.get(n) for n in names})

    def build(*args: Any, **kwargs: Any) -> None:
        raise Stop

    names = ["TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"]
    for name in [*names, "TORCH_NCCL_DUMP_ON_TIMEOUT", "NCCL_ASYNC_ERROR_HANDLING"]:
        monkeypatch.delenv(name, raising=False)  # restored (unset) after the test
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "100")  # the user's, by its old name
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(loop, "check", lambda *a: _plan("nccl", torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(loop, "build_model", build)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(Stop):
        loop.train(_cfg(checkpoint_dir=str(ckpt)))
    prefix = f"{ckpt}/flight-recorder/nccl_trace_rank_"
    assert seen["env"] == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_FR_BUFFER_SIZE": None,  # TORCH_NCCL_TRACE_BUFFER_SIZE=100 stays in charge
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
    }
    assert seen["device_id"] == torch.device("cuda", 0)
    assert (ckpt / "flight-recorder").is_dir()  # torch writes the dumps there
    out = capsys.readouterr().out
    assert "train: nccl: timeout 1800s until the first step, then 600s;" in out
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE=100" in out and f"TORCH_FR_DUMP_TEMP_FILE={prefix}" in out


def test_the_window_ends_after_the_gpu_has_run_its_work(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(f"{device}"))
    fake_time = types.SimpleNamespace(perf_counter=lambda: calls.append("clock") or 5.0)
    monkeypatch.setattr(loop, "time", fake_time)
    assert settled(torch.device("cuda", 1)) == 5.0
    assert calls == ["cuda:1", "clock"]
    calls.clear()
    assert settled(torch.device("cpu")) == 5.0
    assert calls == ["clock"]  # nothing to wait for on the CPU


def test_a_hub_model_is_downloaded_before_the_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    events: list[str] = []

    def download(name: str, **kwargs: Any) -> str:
        events.append(f"download {name}")
        return str(tmp_path)

    class Stop(Exception):
        pass

    def init(**kwargs: Any) -> None:
        events.append("init_process_group")
        raise Stop

    monkeypatch.setattr(startup, "_DOWNLOADED", {})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(loop, "check", lambda *a: _plan("gloo", torch.device("cpu")))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Stop):
        loop.train(_cfg(model_name_or_path="org/model"))
    assert events == ["download org/model", "init_process_group"]
    assert startup.resolve("org/model") == tmp_path  # what `place` asks: no second download
    assert events == ["download org/model", "init_process_group"]


@dataclass
class _Recorded:
    cfg: TrainConfig
    out: str = ""
    steps: int = 0
    init: list[dict[str, Any]] = field(default_factory=list)
    timeouts: list[tuple[timedelta, Any, int]] = field(default_factory=list)  # steps run
    groups: list[tuple[dict[str, Any], Any]] = field(default_factory=list)  # new_group
    gathers: list[Any] = field(default_factory=list)  # all_gather_object's group


class _FakeDevice:
    """Work queued by each step that the clock sees only after a sync (float of a tensor)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.queued = 0.0

    def sync(self) -> None:
        self.now += self.queued
        self.queued = 0.0


@pytest.fixture(scope="module")
def run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> _Recorded:
    tmp = tmp_path_factory.mktemp("gpu-runtime")
    cfg = tiny_config(
        tiny_dataset,
        tmp / "model",
        steps=4,
        log_every=2,
        export_dtype="bfloat16",
        init_timeout_s=1234,
        collective_timeout_s=567,
        export_timeout_s=8901,
    )
    rec = _Recorded(cfg)
    device = _FakeDevice()
    init, new_group, gather = dist.init_process_group, dist.new_group, dist.all_gather_object
    set_timeout, step, to_float = distributed_c10d._set_pg_timeout, loop._Run.step, float

    def fake_init(**kwargs: Any) -> None:
        rec.init.append(kwargs)
        init(**kwargs, init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)

    def fake_step(self: Any) -> Any:
        result = step(self)
        rec.steps += 1
        device.queued += 1.0  # a second of kernels still to run when step() returns
        return result

    def fake_float(t: torch.Tensor) -> float:
        device.sync()
        return to_float(t.item())

    def fake_new_group(*args: Any, **kwargs: Any) -> Any:
        group = new_group(*args, **kwargs)
        rec.groups.append((kwargs, group))
        return group

    def fake_gather(out: list[Any], obj: Any, group: Any = None) -> None:
        rec.gathers.append(group)
        gather(out, obj, group=group)

    def fake_set_timeout(timeout: timedelta, group: Any = None) -> None:
        rec.timeouts.append((timeout, group, rec.steps))
        set_timeout(timeout, group)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FORCE_DISTRIBUTED_ENV, "1")
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            mp.delenv(name, raising=False)
        mp.setattr(dist, "init_process_group", fake_init)
        mp.setattr(dist, "new_group", fake_new_group)
        mp.setattr(dist, "all_gather_object", fake_gather)
        mp.setattr(distributed_c10d, "_set_pg_timeout", fake_set_timeout)
        mp.setattr(loop._Run, "step", fake_step)
        mp.setattr(torch.Tensor, "__float__", fake_float, raising=False)
        mp.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: device.now))
        with contextlib.redirect_stdout(io.StringIO()) as out:
            loop.train(cfg)
    rec.out = out.getvalue()
    return rec


def test_tokens_per_sec_counts_the_work_the_device_had_still_queued(run: _Recorded) -> None:
    windows = [m for line in run.out.splitlines() if "tokens_per_sec" in (m := parse_metrics(line))]
    assert [m["step"] for m in windows] == [2, 4]
    tokens_per_step = run.cfg.batch_size * 16  # the dataset's seq_len
    # 2 steps per window, each one second of device time: tokens_per_step per second
    assert [m["tokens_per_sec"] for m in windows] == [tokens_per_step, tokens_per_step]


def test_start_up_and_training_have_their_own_timeouts(run: _Recorded) -> None:
    assert len(run.init) == 1
    assert run.init[0] == {"backend": "gloo", "timeout": timedelta(seconds=1234)}
    # switched once, on the default group, after the first step
    assert run.timeouts == [(timedelta(seconds=567), None, 1)]


def test_the_other_ranks_wait_for_the_export_on_a_gloo_group_of_their_own(
    run: _Recorded,
) -> None:
    finish = [g for kw, g in run.groups if kw.get("timeout") == timedelta(seconds=8901)]
    assert len(finish) == 1
    kwargs = next(kw for kw, g in run.groups if g is finish[0])
    assert kwargs["backend"] == "gloo"
    assert run.gathers[-1] is finish[0]  # the end-of-run memory line: after the export
    assert run.gathers[0] is None  # start-up's goes over the default group


def test_the_export_is_written_in_export_dtype(run: _Recorded) -> None:
    weights = load_file(Path(run.cfg.output_dir) / "model.safetensors")
    assert weights and all(t.dtype == torch.bfloat16 for t in weights.values())
    assert "exported model to" in run.out and "(bfloat16)" in run.out
