"""gpu-check: its dry run (the GPU stages on the CPU, tiny sizes) passes every stage end to
end and says so in summary.json; a failing stage stops the run and the summary is still
written; the device command (`python3 bench/gpu_check.py` with only src/ on the path) runs;
and its pure parts judge correctly: the resume comparison, the LoRA verdict, the engine's
output read back, the sizes.

The GPU path itself (nccl, bf16, inductor, the d12 anchor) cannot run here; what can be
checked without a GPU is that its plan makes valid TrainConfigs of the intended sizes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from quick_runs import BenchRuns

from bench import gpu_check
from bench.gpu_check import (
    STAGE_ORDER,
    Context,
    EngineRun,
    Proc,
    Stage,
    compare_resume,
    eval_rows,
    export_check,
    lora_problems,
    make_plan,
    read_engine,
    steady_rate,
    train_problems,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # it waits for the batch's runs too
@pytest.mark.bench_run("gpu_check")
def test_the_dry_run_passes_every_stage(bench_runs: BenchRuns) -> None:
    # python -m bench.gpu_check --dry-run --out gpu-check/summary.md (tests/bench/quick_runs.py)
    run = bench_runs.result("gpu_check")
    proc, out = run.proc, run.tmp / "gpu-check"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    d = json.loads((out / "summary.json").read_text())
    assert (d["status"], d["passed"], d["dry_run"], d["not_run"]) == ("passed", True, True, [])
    assert d["failed_stage"] is None and not d["error"] and d["seconds"] > 0
    stages = {s["name"]: s for s in d["stages"]}
    assert [s["name"] for s in d["stages"]] == list(STAGE_ORDER)
    for s in d["stages"]:
        assert s["ok"] and s["seconds"] > 0 and s["figures"], s
        assert all(c["ok"] for c in s["checks"]), s
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
    assert [ln.split()[:3] for ln in lines] == [
        ["PASS", str(i), n] for i, n in enumerate(STAGE_ORDER, 1)
    ]

    versions = stages["versions"]["figures"]
    assert versions["torch"] == torch.__version__ and versions["peak_table_tflops"] is None
    mm = versions["matmul"]
    assert mm["dtype"] == "float32" and mm["tflops"] > 0 and mm["max_rel_err"] < 1e-4

    tiny = stages["tiny"]
    assert [c["name"] for c in tiny["checks"]] == [
        "ddp",
        "fsdp",
        "resume-fsdp",
        "export-ddp",
        "export-fsdp",
    ]
    fig = tiny["figures"]
    for strategy in ("ddp", "fsdp"):
        run_fig = fig[strategy]
        assert run_fig["strategy"] == strategy and run_fig["precision"] == "fp32"
        assert run_fig["loss_last"] < run_fig["loss_first"] and run_fig["tokens_per_s"] > 0
        export = fig[f"export_{strategy}"]
        assert export["new_tokens"] == 8
        assert export["val_loss"] == pytest.approx(run_fig["eval_loss"], rel=1e-3)
    resume = fig["resume_fsdp"]
    assert resume["bit_exact"] is True and resume["tensors_compared"] > 0
    assert (resume["steps"], resume["checkpoint_at"], resume["resumed_at"]) == (20, 10, 10)
    assert resume["losses_compared"] == 20
    assert fig["fsdp"]["steps"] == 20  # the straight run printed every step's loss

    lora = stages["lora"]["figures"]
    assert lora["strategy"] == "fsdp" and 0 < lora["trainable"] < lora["params"]
    assert lora["compile_backend"] == "eager" and lora["activation_checkpointing"]
    assert lora["exported"] and lora["pretrained"].endswith("fsdp-model")
    gap = lora["eval_loss"] - lora["pretrained_eval_loss"]
    assert abs(gap) < abs(lora["eval_loss"] - lora["fresh_model_loss"])

    anchor = stages["anchor"]["figures"]
    assert anchor["model"]["flops_per_token"] > 0 and anchor["peak_table_tflops"] is None
    a = anchor["compiled"]  # the dry run's only anchor run: one process, no torchrun
    assert a["strategy"] == "single" and a["tokens_per_s"] > 0 and a["steps"] == 3, a
    assert a["mfu_vs_matmul"] > 0 and a["mfu_vs_peak_table"] is None
    assert a["compile_backend"] == "eager" and "eager" in anchor["skipped"]

    fabric = stages["fabric"]["figures"]
    assert fabric["world_size"] == 1 and fabric["backend"] == "gloo"
    assert fabric["allreduce_busbw_gbps"] is not None

    md = (out / "summary.md").read_text()
    assert md.startswith("# gpu-check: PASS (dry run on the CPU)")
    for i, name in enumerate(STAGE_ORDER, 1):
        assert f"| {i} {name} | PASS |" in md, name
    assert (out / "logs" / "resume-fsdp-second.log").is_file()
    assert not list((run.tmp / "cache").glob("gpu-check-*"))  # the scratch is gone


@pytest.mark.slow
def test_the_device_command_runs_as_a_script(tmp_path: Path) -> None:
    # the device's shape: the image's python, PYTHONPATH=src (+ the bundle), a file, not -m
    env = {**os.environ, "PYTHONPATH": "src"}
    cmd = [sys.executable, "bench/gpu_check.py", "--dry-run", "--stages", "versions"]
    cmd += ["--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert d["passed"] and [s["name"] for s in d["stages"]] == ["versions"]
    assert d["command"].startswith("python bench/gpu_check.py --dry-run")


# --- fail-fast: stages faked in-process ------------------------------------------------------


def _fake_stages(monkeypatch: pytest.MonkeyPatch, **replace: Any) -> list[str]:
    called: list[str] = []

    def fake(name: str) -> Any:
        def stage(ctx: Context) -> Stage:
            called.append(name)
            return Stage(name, True, {"fake": 1}, f"{name} ok")

        return stage

    for name in STAGE_ORDER:
        monkeypatch.setitem(gpu_check.STAGES, name, replace.get(name, fake(name)))
    return called


def _main(tmp_path: Path) -> tuple[int, dict[str, Any]]:
    args = ["--dry-run", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]
    rc = gpu_check.main(args)
    return rc, json.loads((tmp_path / "out" / "summary.json").read_text())


def test_a_failing_stage_stops_the_run_and_the_summary_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def tiny(ctx: Context) -> Stage:
        return Stage("tiny", False, {"ddp": {"loss_first": 6.2}}, "ddp failed", problem="ddp: nan")

    called = _fake_stages(monkeypatch, tiny=tiny)
    rc, d = _main(tmp_path)
    assert rc == 1 and called == ["versions"]  # nothing after the failure ran
    assert (d["status"], d["passed"], d["failed_stage"]) == ("failed", False, "tiny")
    assert [(s["name"], s["ok"]) for s in d["stages"]] == [("versions", True), ("tiny", False)]
    assert d["stages"][1]["problem"] == "ddp: nan" and d["stages"][1]["seconds"] >= 0
    assert d["stages"][1]["figures"] == {"ddp": {"loss_first": 6.2}}
    assert d["not_run"] == ["lora", "anchor", "fabric"]
    md = (tmp_path / "out" / "summary.md").read_text()
    assert md.startswith("# gpu-check: FAIL") and "| 2 tiny | **FAIL** |" in md
    assert "| 3 lora | not run |" in md and "ddp: nan" in md
    assert not list((tmp_path / "cache").glob("gpu-check-*"))


def test_an_exception_in_a_stage_is_that_stages_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def lora(ctx: Context) -> Stage:
        raise RuntimeError("meta tensors everywhere")

    called = _fake_stages(monkeypatch, lora=lora)
    rc, d = _main(tmp_path)
    assert rc == 1 and called == ["versions", "tiny"]
    failed = d["stages"][-1]
    assert (failed["name"], failed["ok"], d["failed_stage"]) == ("lora", False, "lora")
    assert failed["problem"] == "RuntimeError: meta tensors everywhere"
    assert "Traceback" in failed["log"] and d["not_run"] == ["anchor", "fabric"]


def test_an_interrupted_run_still_writes_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def anchor(ctx: Context) -> Stage:
        raise KeyboardInterrupt

    _fake_stages(monkeypatch, anchor=anchor)
    with pytest.raises(KeyboardInterrupt):
        _main(tmp_path)
    d = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (d["status"], d["error"]) == ("failed", "KeyboardInterrupt: ")
    assert [s["name"] for s in d["stages"]] == ["versions", "tiny", "lora"]
    assert d["not_run"] == ["anchor", "fabric"]


def test_every_stage_passing_is_a_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    called = _fake_stages(monkeypatch)
    rc, d = _main(tmp_path)
    assert rc == 0 and called == list(STAGE_ORDER) and d["status"] == "passed"
    assert d["plan"]["dry_run"] and d["plan"]["nproc"] == 1 and d["budget_s"] == 120
    assert (tmp_path / "out" / "summary.md").read_text().startswith("# gpu-check: PASS")


def test_out_is_a_folder_or_a_markdown_file_in_one() -> None:
    assert gpu_check.out_paths("runs/x") == (Path("runs/x"), Path("runs/x/summary.md"))
    assert gpu_check.out_paths("t/g/summary.md") == (Path("t/g"), Path("t/g/summary.md"))


def test_unknown_stages_are_refused() -> None:
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--stages", "versions,nope"])
    assert gpu_check.parse_args([]).stages.split(",") == list(STAGE_ORDER)


def test_the_timed_matmul_is_checked_against_float32() -> None:
    mm = gpu_check.time_matmul(32, 1, 2, "cpu")
    assert mm["tflops"] > 0 and mm["finite"] and mm["max_rel_err"] < 1e-5
    assert (mm["n"], mm["dtype"], mm["iters"]) == (32, "float32", 2)


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
    fig = gpu_check.train_figures(r, 10)
    assert (fig["loss_first"], fig["loss_last"], fig["peak_mem_gib"]) == (6.23701, 6.01272, 1.5)
    assert fig["tokens_per_s"] == pytest.approx(2000.0) and fig["params"] == 26720


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

    def problems(stdout: str, where: Path | None = out, rc: int = 0) -> list[str]:
        return train_problems(read_engine(_proc(stdout, rc)), "fsdp", where, logged)

    assert problems(ENGINE_OUT) == []
    assert problems(ENGINE_OUT, None) == []  # no export asked for (the anchor)
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


def _lora_run(eval_loss: float, trainable: int = 1000) -> EngineRun:
    out = (
        f"train: params=26720 trainable={trainable} world_size=1 device=cpu strategy=fsdp "
        "precision=fp32\nstep=1 loss=5.1 tokens_per_sec=10\nstep=2 loss=5.2 tokens_per_sec=10\n"
        f"train_loss=5.2 eval_loss={eval_loss} perplexity=180\n"
    )
    return read_engine(_proc(out))


def test_lora_passes_when_the_pretrained_weights_arrived(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    ln_v = math.log(512)  # 6.24: a new model's loss
    # a loss that rose over 2 LoRA steps is no failure; its held-out loss is the pretrained one
    assert lora_problems(_lora_run(5.05), 5.0, 512, tmp_path, 2) == []
    fresh = lora_problems(_lora_run(ln_v - 0.05), 5.0, 512, tmp_path, 2)
    assert len(fresh) == 1 and "did not arrive" in fresh[0]
    full = lora_problems(_lora_run(5.0, trainable=26720), 5.0, 512, tmp_path, 2)
    assert len(full) == 1 and "only adapters" in full[0]


def test_export_check_compares_the_loss_with_the_engines_eval_loss() -> None:
    plan = make_plan(True, 1)
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
    ok = export_check(plan, "fsdp", trained, result)
    assert ok.ok and ok.data["val_loss"] == 6.00251
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


def test_the_gpu_plan_makes_valid_configs_and_a_d12_sized_anchor(tmp_path: Path) -> None:
    plan = make_plan(False, 1)
    assert (plan.backend, plan.precision, plan.device, plan.compile_backend) == (
        "nccl",
        "bf16",
        "cuda",
        "",
    )
    assert (plan.steps, plan.stop, plan.batch, plan.micro_batch) == (20, 10, 8, 4)
    for strategy in ("ddp", "fsdp"):
        cfg = gpu_check.engine_config(plan, tmp_path, tmp_path / "out", strategy, plan.steps)
        assert cfg["backend"] == "nccl" and cfg["precision"] == "bf16" and cfg["save_model"]
    lora = gpu_check.engine_config(
        plan,
        tmp_path,
        tmp_path / "lora",
        "fsdp",
        plan.lora_steps,
        model_name_or_path=str(tmp_path / "fsdp-model"),
        lora={"r": 8},
        compile=True,
        activation_checkpointing=True,
    )
    assert lora["compile"] and lora["activation_checkpointing"] and lora["lora"] == {"r": 8}
    anchor = gpu_check.anchor_config(plan, tmp_path, tmp_path / "a", compile=True)
    assert anchor["compile"] and not anchor["save_model"] and anchor["steps"] == 40
    assert anchor["batch_size"] * 2048 == 65536  # tokens per step
    # nanochat d12: 768 wide, 12 layers, heads of 128, ~85M matmul weights below the lm_head
    assert plan.anchor_hidden // plan.anchor_heads == 128
    params, fpt, matmul = gpu_check.meta_model(768, 12, 6, 2048, 2048, 32768)
    below_head = matmul - 768 * 32768
    assert 84e6 < below_head < 86e6, below_head
    assert fpt == pytest.approx(6 * matmul + 12 * 12 * 6 * 128 * 2048)
    assert 100e6 < params < 120e6


def test_the_dry_run_plan_is_tiny_and_one_process() -> None:
    plan = make_plan(True, 1)
    assert (plan.backend, plan.precision, plan.nproc, plan.compile_backend) == (
        "gloo",
        "fp32",
        1,
        "eager",
    )
    assert (plan.anchor_vocab, plan.anchor_seq_len) == (plan.vocab, plan.seq_len)  # one prepare
    assert plan.direct_launch and plan.anchor_modes == ("compiled",)
    assert plan.hidden <= 64 and plan.anchor_hidden <= 64 and plan.matmul_n <= 512
    assert make_plan(False, 1).anchor_modes == ("eager", "compiled")


def test_one_process_of_the_dry_run_starts_without_a_launcher() -> None:
    env: dict[str, str] = {}
    cmd = gpu_check.launch(make_plan(True, 1), env, "kubellm.train", "--config", "c.json")
    assert cmd == [sys.executable, "-m", "kubellm.train", "--config", "c.json"]
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("0", "1", "0")
    assert int(env["MASTER_PORT"]) > 0
    for plan, launcher in ((make_plan(True, 1), True), (make_plan(True, 2), False)):
        env = {}
        cmd = gpu_check.launch(plan, env, "kubellm.train", launcher=launcher)
        assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and not env
    assert gpu_check.launch(make_plan(False, 1), {}, "m")[2] == "torch.distributed.run"
