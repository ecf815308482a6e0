"""gpu-check on CPU: every check runs and passes end to end (gloo, tiny model), and its pure
parts judge correctly: the resume comparison, the engine's output read back, the sizes.

The GPU path itself (nccl, bf16, the ~91M model) cannot run here; what can be checked
without a GPU is that its plan makes a valid TrainConfig of the intended size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quick_runs import BenchRuns

from bench import gpu_check
from bench.gpu_check import (
    CHECKS,
    Proc,
    compare_resume,
    eval_rows,
    export_check,
    make_plan,
    read_engine,
    steady_rate,
    train_problems,
)

QUICK_CHECKS = ("fabric", "ddp", "export-ddp", "fsdp", "export-fsdp", "resume-fsdp")


@pytest.mark.slow
@pytest.mark.timeout(2400)  # it waits for the batch's runs too
@pytest.mark.bench_run("gpu_check")
def test_quick_cpu_gpu_check_passes_every_check(bench_runs: BenchRuns) -> None:
    # python -m bench.gpu_check --device cpu --quick --out gpu-check.md (tests/bench/conftest.py)
    run = bench_runs.result("gpu_check")
    proc, out, tmp_path = run.proc, run.tmp / "gpu-check.md", run.tmp
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    verdicts = {ln.split()[1]: ln.split()[0] for ln in lines if ln.startswith(("PASS", "FAIL"))}
    assert verdicts == dict.fromkeys(QUICK_CHECKS, "PASS"), proc.stdout
    fabric = next(ln for ln in lines if ln.startswith("PASS  fabric"))
    assert "busbw" in fabric and "GB/s" in fabric
    for name in ("ddp", "fsdp"):
        line = next(ln for ln in lines if ln.startswith(f"PASS  {name} "))
        assert f"strategy {name}" in line and "tokens/s" in line, line
    assert "bit-identical" in next(ln for ln in lines if ln.startswith("PASS  resume-fsdp"))
    assert "gpu-check: PASS (6/6 checks passed" in proc.stdout

    md = out.read_text()
    assert md.startswith("# gpu-check: PASS")
    for name in QUICK_CHECKS:
        assert f"| {name} | PASS |" in md, name
    assert "python -m bench.gpu_check --device cpu --quick" in md
    assert not list((tmp_path / "cache").glob("gpu-check-*/*-model"))  # exports cleaned up


# --- the resume comparison ----------------------------------------------------------------

STOP, STEPS = 3, 6


def _losses(steps: range, bump: int | None = None) -> dict[int, str]:
    return {s: ("9.99999" if s == bump else f"{6 - s / 10:.6g}") for s in steps}


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}


def _compare(**change: object) -> list[str]:
    args: dict[str, object] = {
        "straight": _losses(range(1, STEPS + 1)),
        "first": _losses(range(1, STOP + 1)),
        "second": _losses(range(STOP + 1, STEPS + 1)),
        "stop": STOP,
        "steps": STEPS,
        "weights_a": _weights(),
        "weights_b": _weights(),
        "resumed_at": STOP,
    }
    args.update(change)
    return compare_resume(**args)  # type: ignore[arg-type]


def test_resume_comparison_passes_identical_runs() -> None:
    assert _compare() == []


def test_resume_comparison_fails_when_one_weight_differs_by_one_ulp() -> None:
    b = _weights()
    w = b["model.norm.weight"]
    w[2] = torch.nextafter(w[2], torch.tensor(2.0))
    problems = _compare(weights_b=b)
    assert len(problems) == 1
    assert "1 of 2 exported tensors differ" in problems[0]
    assert "model.norm.weight" in problems[0]


def test_resume_comparison_fails_on_missing_or_extra_tensors() -> None:
    b = _weights()
    del b["model.norm.weight"]
    assert any("different tensors" in p for p in _compare(weights_b=b))
    assert any("no tensors" in p for p in _compare(weights_a={}, weights_b={}))


def test_resume_comparison_fails_on_a_dtype_change() -> None:
    b = _weights()
    b["model.norm.weight"] = b["model.norm.weight"].to(torch.bfloat16)
    assert any("exported tensors differ" in p for p in _compare(weights_b=b))


def test_a_loss_difference_after_the_resume_is_a_resume_failure() -> None:
    problems = _compare(second=_losses(range(STOP + 1, STEPS + 1), bump=5))
    assert len(problems) == 1
    assert f"after resuming at step {STOP}" in problems[0] and "step 5" in problems[0]


def test_a_loss_difference_before_the_checkpoint_blames_the_kernels() -> None:
    problems = _compare(first=_losses(range(1, STOP + 1), bump=2))
    assert len(problems) == 1
    assert "before the checkpoint, at step 2" in problems[0]
    assert "not deterministic" in problems[0]


def test_nan_losses_are_never_bit_exact() -> None:
    nan = {s: "nan" for s in range(1, STEPS + 1)}
    problems = _compare(
        straight=nan,
        first={s: "nan" for s in range(1, STOP + 1)},
        second={s: "nan" for s in range(STOP + 1, STEPS + 1)},
    )
    assert any("non-finite losses" in p for p in problems)


def test_a_run_that_did_not_resume_fails() -> None:
    problems = _compare(resumed_at=None, second=_losses(range(1, STEPS + 1)))
    assert any("did not resume at step 3" in p for p in problems)
    assert any("resumed run printed losses for steps" in p for p in problems)


# --- reading the engine's output ---------------------------------------------------------

ENGINE_OUT = """\
train: params=26720 trainable=26720 world_size=2 device=cpu strategy=fsdp precision=fp32 \
sequences=1565 seq_len=64 micro_batch=2 grad_accum_steps=2 steps=4
train: resumed from /tmp/ckpt/step-00000002 at step 2
step=3 loss=6.23701 lr=0.003 grad_norm=0.42 tokens_per_sec=1000 mfu=0.01
train: 3/4 steps (75%), eta 0m00s
step=4 loss=6.01272 lr=0.002 grad_norm=0.4 tokens_per_sec=2000 mfu=0.02 peak_mem_gb=1.5
train_loss=6.01272 eval_loss=6.00251 perplexity=404.1
train: exported model to /tmp/out
"""


def _proc(stdout: str = ENGINE_OUT, rc: int = 0) -> Proc:
    return Proc(["torchrun"], rc, stdout, "", 1.0)


def test_read_engine_keeps_the_printed_losses_exactly() -> None:
    r = read_engine(_proc())
    assert r.ok and r.header["strategy"] == "fsdp" and r.header["micro_batch"] == "2"
    assert r.losses == {3: "6.23701", 4: "6.01272"}
    assert r.resumed_at == 2
    assert r.final == {"train_loss": 6.01272, "eval_loss": 6.00251, "perplexity": 404.1}
    assert [m["step"] for m in r.steps] == [3, 4] and r.steps[1]["peak_mem_gb"] == 1.5


def test_steady_rate_leaves_out_the_first_window() -> None:
    steps = [
        {"step": 4, "tokens_per_sec": 100.0},
        {"step": 8, "tokens_per_sec": 200.0},
        {"step": 12, "tokens_per_sec": 400.0},
    ]
    # windows 2 and 3: 8 steps of 10 tokens over 4*10/200 + 4*10/400 seconds
    assert steady_rate(steps, 10) == pytest.approx(80 / (0.2 + 0.1))
    assert steady_rate(steps[:1], 10) == pytest.approx(100.0)
    assert steady_rate([], 10) is None


def test_train_problems(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")
    logged = [3, 4]

    def problems(stdout: str, where: Path = out, rc: int = 0) -> list[str]:
        return train_problems(read_engine(_proc(stdout, rc)), "fsdp", where, logged)

    assert problems(ENGINE_OUT) == []
    # a one-process run the engine did not wrap (it must, under torchrun)
    single = problems(ENGINE_OUT.replace("strategy=fsdp", "strategy=single"))
    assert any("strategy='single'" in p for p in single)
    rising = problems(ENGINE_OUT.replace("loss=6.01272", "loss=6.5"))
    assert any("did not fall" in p for p in rising)
    # a NaN is no number to parse_metrics: it must not just vanish from the losses
    nan = problems(ENGINE_OUT.replace("loss=6.01272 lr", "loss=nan lr"))
    assert any("not all finite: {4: 'nan'}" in p for p in nan), nan
    missing = problems(ENGINE_OUT.replace("step=3 loss=6.23701", "step=3"))
    assert any("losses printed for steps [4], expected [3, 4]" in p for p in missing), missing
    assert any("no Hugging Face export" in p for p in problems(ENGINE_OUT, tmp_path))
    assert problems(ENGINE_OUT, rc=1) == ["kubellm.train failed (exit 1)"]
    assert gpu_check.logged_steps(10, 4) == [4, 8, 10]


def test_export_check_compares_the_loss_with_the_engines_eval_loss() -> None:
    plan = make_plan("cpu", 2, quick=True)
    trained = read_engine(_proc())
    result = {
        "dir": "/tmp/out",
        "device": "cpu",
        "loss": 6.00251,
        "finite": True,
        "new_tokens": plan.new_tokens,
        "text": "abc",
        "seconds": 1.0,
    }
    assert export_check(plan, "fsdp", trained, result).ok
    off = export_check(plan, "fsdp", trained, {**result, "loss": 6.1})
    assert not off.ok and "eval_loss" in off.problem
    short = export_check(plan, "fsdp", trained, {**result, "new_tokens": 2})
    assert not short.ok and "generated 2 tokens" in short.problem
    assert not export_check(plan, "fsdp", None, None).ok
    broken = export_check(plan, "fsdp", trained, {"dir": "x", "error": "OSError: gone"})
    assert not broken.ok and "OSError" in broken.problem


def test_eval_rows_are_the_engines_first_validation_rows() -> None:
    # micro-batch 4, 2 ranks, 2 eval batches: rows 0-15 in chunks of 4, rank-major per batch
    assert eval_rows(100, 2, 4, 2) == [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
    assert eval_rows(3, 2, 4, 8) == [range(0, 1), range(1, 2)]  # fewer rows than a batch


# --- the GPU plan, checked without a GPU --------------------------------------------------


def test_the_gpu_plan_is_a_valid_config_of_about_100m_parameters(tmp_path: Path) -> None:
    plan = make_plan("cuda", 8, quick=False)
    assert (plan.backend, plan.precision, plan.seq_len) == ("nccl", "bf16", 512)
    assert plan.batch == 64 and plan.micro_batch == 4
    assert plan.resume_strategies == ("fsdp", "ddp")
    for strategy in ("ddp", "fsdp"):
        cfg = gpu_check.engine_config(plan, tmp_path, tmp_path / "out", strategy, plan.steps)
        assert cfg["backend"] == "nccl" and cfg["precision"] == "bf16" and cfg["save_model"]
    params = gpu_check.model_params(plan, plan.vocab)
    assert 80e6 < params < 110e6, params
    assert make_plan("cuda", 1, quick=True).resume_strategies == ("fsdp",)


def test_unknown_checks_are_refused() -> None:
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--checks", "fabric,nope"])
    assert gpu_check.parse_args([]).checks.split(",") == list(CHECKS)
