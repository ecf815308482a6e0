"""The `kubellm` command.

kubellm run --local                      # the whole pipeline on this machine (CPU)
kubellm run --local --set train_steps=200 --set tune_trials=0
kubellm run --local --from evaluate --input model=runs/model --input dataset=runs/dataset
kubellm compile                          # pipelines/*.py -> pipelines/*.yaml
kubellm submit pipelines/llm_train.yaml --endpoint http://localhost:8888 \
    --namespace team-a --token-file ~/.kfp-token --ui-url http://localhost:8080
kubellm schedule pipelines/llm_train.yaml --cron '0 2 * * *' --endpoint http://localhost:8888
kubellm schedule --list --endpoint http://localhost:8888     # --pause, --resume, --delete
kubellm render --set gpus_per_node=8 --set fabric=rdma-ib   # the objects a run creates
kubellm prepare runs/dataset             # one stage by hand
kubellm train --dataset runs/dataset --output runs/model   # --nproc N: default one per GPU
kubellm evaluate runs/model runs/dataset
kubellm serve runs/model --name kubellm-tiny --port 8080
kubellm lineage kubellm-tiny@champion [--json]   # data -> tuning -> training -> gate -> deployment
kubellm promote kubellm-tiny@3 --local           # champion alias -> v3, served from the registry
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from kubellm.config import (
    CPU_NPROC,
    ConfigError,
    PipelineConfig,
    TrainConfig,
    parse_overrides,
    pipeline_config,
    validate,
)
from kubellm.data.records import DataError

DEFAULT_PIPELINE = "pipelines/llm_train.yaml"

# The extras of pyproject.toml a command needs beyond the core install, each with the
# top-level modules whose absence means it is not installed (tests/test_cli.py checks them
# against pyproject.toml and the installed metadata). `local` probes for the full mlflow by
# the MLflow server's and sqlite store's modules: mlflow-skinny (the core's) has `mlflow`.
_TRAIN = ("torch", "transformers", "peft", "tokenizers", "safetensors", "numpy", "pyarrow")
_SERVE = ("torch", "transformers", "tokenizers", "safetensors", "fastapi", "uvicorn", "starlette")
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "train": (*_TRAIN, "zstandard"),
    "serve": _SERVE,
    "local": (
        *dict.fromkeys((*_TRAIN, "zstandard", *_SERVE)),
        "optuna",
        "sqlalchemy",
        "alembic",
        "flask",
    ),
}
COMMAND_EXTRA = {
    "prepare": "train",
    "train": "train",
    "evaluate": "train",
    "serve": "serve",
    "run": "local",  # run --local
}


class MissingExtra(Exception):
    """A command ran where its extra is not installed: one line, exit 2."""

    def __init__(self, command: str, extra: str, module: str) -> None:
        super().__init__(
            f"kubellm {command}: needs the [{extra}] extra: pip install 'kubellm[{extra}]' "
            f"(No module named {module!r})"
        )


def command_extra(command: str, argv: list[str]) -> str | None:
    """The extra `command` needs (None: the core install is enough)."""
    if command == "promote" and "--local" in argv:  # serves on this machine
        return "local"
    return COMMAND_EXTRA.get(command)


def check_extra(command: str, extra: str | None) -> None:
    """Raise MissingExtra unless every module `extra` installs can be found. It imports
    nothing; a pipeline step or torchrun worker would otherwise fail in another process."""
    for module in EXTRA_MODULES.get(extra or "", ()):
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(command, str(extra), module)


def missing_extra(command: str, extra: str | None, err: ModuleNotFoundError) -> MissingExtra | None:
    """The one-line error for an import that failed because `extra` is not installed, or
    None: a module of kubellm or of the core, or a submodule missing from an installed
    package, is a bug whose traceback must show."""
    top = (err.name or "").partition(".")[0]
    if extra is None or top not in EXTRA_MODULES.get(extra, ()):
        return None
    try:
        if importlib.util.find_spec(top) is not None:
            return None
    except (ImportError, ValueError):
        pass
    return MissingExtra(command, extra, top)


def _add_set(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override one {what} (repeatable); values parse as JSON when they can",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubellm",
        description="Train, tune, evaluate, register and serve a language model with Kubeflow.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run the compiled pipeline locally with kfp.local",
        description="Run the committed pipeline YAML on this machine: kfp.local's "
        "SubprocessRunner, torchrun for training, optuna for tuning, a loopback KServe "
        "ModelServer, MLflow on sqlite under --runs-dir.",
    )
    run.add_argument(
        "--local",
        action="store_true",
        required=True,
        help="run the steps on this machine (platform=local; platform=slurm sends the "
        "training jobs to Slurm from this login node)",
    )
    run.add_argument("--pipeline", default=DEFAULT_PIPELINE, help="compiled pipeline YAML")
    run.add_argument(
        "--from",
        dest="start",
        default=None,
        metavar="STAGE",
        help="run only the stages from STAGE (after preflight; the summary still ends it), "
        "built from components/*.py rather than --pipeline",
    )
    run.add_argument(
        "--to", dest="stop", default=None, metavar="STAGE", help="the span's last stage"
    )
    run.add_argument(
        "--input",
        dest="inputs",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="an input the span's stages take from a stage outside it (dataset=DIR, "
        "model=DIR, predictions=FILE; hparams, version, endpoint: a value); repeatable",
    )
    _add_set(run, "pipeline parameter")

    comp = sub.add_parser("compile", help="rebuild pipelines/*.yaml from pipelines/*.py")
    comp.add_argument("--dir", default="pipelines", help="folder of pipeline definitions")

    submit = sub.add_parser(
        "submit",
        help="create a run on a Kubeflow Pipelines endpoint",
        description="Upload a compiled pipeline as the version its content hash names (as "
        "`schedule` does) and create a run of it with the kfp client. The endpoint comes from "
        "--endpoint or $KFP_ENDPOINT; the bearer token from --token-file, $KFP_TOKEN or kfp's "
        "in-cluster token file (never from pipeline parameters); on multi-user Kubeflow, "
        "--user (a port-forward) or --cookie-file (a Dex session) instead.",
    )
    from kubellm.kfp.client import add_kfp_args

    submit.add_argument("pipeline", help="compiled pipeline YAML")
    submit.add_argument("--run-name", default=None, help="run name (default: timestamped)")
    add_kfp_args(submit)
    _add_set(submit, "pipeline parameter")

    sched = sub.add_parser(
        "schedule",
        help="create, update, pause, resume, delete or list a KFP recurring run",
        description="Recurring retraining: one KFP recurring run per --experiment and --name, "
        "created or replaced in place (never duplicated), running the YAML uploaded as a "
        "pipeline version named by its content hash. --cron takes the usual 5 fields "
        "(minute hour day-of-month month day-of-week; sent to KFP with a leading seconds "
        "field 0), 6 fields with seconds first as KFP's robfig/cron reads them, or @daily etc.",
    )
    sched.add_argument(
        "pipeline", nargs="?", default=DEFAULT_PIPELINE, help="compiled pipeline YAML"
    )
    sched.add_argument("--cron", default=None, help="schedule, e.g. '0 2 * * *' (02:00 daily)")
    sched.add_argument(
        "--name", default=None, help="recurring run name (default: the pipeline's name)"
    )
    sched.add_argument(
        "--max-concurrency", type=int, default=1, help="runs at once (1-10; default 1)"
    )
    sched.add_argument(
        "--catchup",
        action="store_true",
        help="backfill every interval missed while paused (default: only the latest)",
    )
    act = sched.add_mutually_exclusive_group()
    act.add_argument("--pause", action="store_true", help="disable the recurring run")
    act.add_argument("--resume", action="store_true", help="enable it again")
    act.add_argument("--delete", action="store_true", help="delete it")
    act.add_argument("--list", action="store_true", help="list the experiment's recurring runs")
    add_kfp_args(sched)
    _add_set(sched, "pipeline parameter")

    rend = sub.add_parser(
        "render",
        help="print the Kubernetes objects a cluster run would create (YAML)",
        description="Print every PyTorchJob, Katib Experiment and InferenceService a run "
        "with these parameters creates, built by the code the stages run; pipe it to "
        "`kubectl apply --dry-run=server -f -` to check it against your cluster's webhooks.",
    )
    rend.add_argument("--run-id", default=None, help="KFP run id to name the objects after")
    rend.add_argument(
        "--target",
        choices=("kubernetes", "slurm"),
        default="kubernetes",
        help="kubernetes: the objects (YAML); slurm: the sbatch scripts of platform=slurm",
    )
    _add_set(rend, "pipeline parameter")

    prep = sub.add_parser("prepare", help="prepare_data by hand: build a Dataset directory")
    prep.add_argument("out_dir", help="where the dataset directory is written")
    _add_set(prep, "pipeline parameter (data_source, num_records, seq_len, ...)")

    tr = sub.add_parser("train", help="train by hand under torchrun (NCCL on GPUs, gloo on CPU)")
    tr.add_argument("--dataset", required=True, help="dataset directory (kubellm prepare)")
    tr.add_argument("--output", required=True, help="model directory to write")
    tr.add_argument(
        "--nproc",
        type=int,
        default=0,
        help=f"processes (torchrun --nproc_per_node); 0: one per GPU, else {CPU_NPROC}",
    )
    _add_set(tr, "TrainConfig field (steps, learning_rate, batch_size, ...)")

    ev = sub.add_parser("evaluate", help="evaluate a model directory on a dataset")
    ev.add_argument("model_dir")
    ev.add_argument("dataset_dir")

    lin = sub.add_parser(
        "lineage",
        help="where a registered model came from: data, tuning, training, gate, deployment",
    )
    lin.add_argument("model", help="NAME (its champion), NAME@ALIAS or NAME@VERSION")
    lin.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///runs/mlflow.db"),
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the local runs/mlflow.db)",
    )
    lin.add_argument("--json", action="store_true", help="the chain as JSON")

    pro = sub.add_parser(
        "promote",
        help="make a registered version the champion and serve it (a rollback)",
        description="Serve NAME@VERSION from the MLflow registry on the configured platform "
        "(the deploy stage's code path), then move the `champion` alias to it; prints the "
        "endpoint. A version the gate rejected needs --force.",
    )
    pro.add_argument("model", help="NAME@VERSION (or NAME@ALIAS)")
    pro.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI"),
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the platform's default: "
        "runs/mlflow.db locally)",
    )
    pro.add_argument("--force", action="store_true", help="promote a version the gate rejected")
    pro.add_argument("--local", action="store_true", help="serve on this machine (platform=local)")
    _add_set(pro, "pipeline parameter (platform, namespace, serving_image, runs_dir, ...)")

    # listed for `kubellm --help`; main() hands its arguments (and --help) to
    # kubellm.serve.server's parser: one set of options, serving imports only for this command
    sv = sub.add_parser(
        "serve",
        help="serve a model directory: KServe V1/V2 and OpenAI-compatible routes, batched",
        add_help=False,
    )
    sv.add_argument("serve_args", nargs=argparse.REMAINDER)
    return parser


def _span(args: argparse.Namespace) -> dict[str, Any] | None:
    """`run --local --from/--to/--input`: the span to run, or None for the whole pipeline."""
    if args.start is None and args.stop is None:
        if args.inputs:
            raise ConfigError("--input needs --from or --to: the whole pipeline makes its own")
        return None
    inputs: dict[str, str] = {}
    for item in args.inputs:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ConfigError(f"--input {item!r}: expected NAME=PATH")
        inputs[name] = value
    return {"start": args.start or "prepare_data", "stop": args.stop, "inputs": inputs}


# -- compile -----------------------------------------------------------------------------


def compile_pipelines(folder: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Compile every pipelines/*.py that defines a `pipeline` to a .yaml beside it (or in
    `out_dir`)."""
    from kfp import compiler

    written = []
    for src in sorted(Path(folder).glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"_kubellm_pipeline_{src.stem}", src)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, "pipeline"):
            continue
        out = Path(out_dir or src.parent) / f"{src.stem}.yaml"
        compiler.Compiler().compile(module.pipeline, str(out))
        written.append(out)
    return written


# -- stages by hand ----------------------------------------------------------------------


def _prepare(out_dir: str, overrides: dict[str, Any]) -> int:
    from kubellm.data.prepare import prepare
    from kubellm.stages.configs import prepare_params

    manifest = prepare(prepare_params(pipeline_config(overrides, platform="local")), out_dir)
    print(json.dumps(manifest["records"], indent=2))
    return 0


def _train(dataset: str, output: str, nproc: int, overrides: list[str]) -> int:
    from kubellm.backends.base import TrainJob
    from kubellm.backends.local.torchrun import TorchrunTrainer, local_nproc

    values = {"dataset_dir": dataset, "output_dir": output}
    values.update(parse_overrides(overrides, TrainConfig))
    train_cfg = validate(TrainConfig, values)
    if nproc <= 0:  # one per GPU; gloo asked for: the CPU default, whatever GPUs there are
        nproc = CPU_NPROC if train_cfg.backend == "gloo" else local_nproc()
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg_path = out.parent / f"{out.name}.train.json"
    cfg_path.write_text(train_cfg.model_dump_json(indent=2))
    log_path = out.parent / f"{out.name}.train.log"
    job = TrainJob(name="train", train_args=["--config", str(cfg_path)], nproc_per_node=nproc)
    print(f"kubellm: training under torchrun; full log: {log_path}", flush=True)
    result = TorchrunTrainer(log_path=log_path).run(job)
    print(json.dumps(result.metrics, indent=2))
    return 0


def _evaluate(model_dir: str, dataset_dir: str) -> int:
    from kubellm.evaluate.metrics import evaluate

    print(json.dumps(evaluate(model_dir, dataset_dir)["metrics"], indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), "")
    extra = command_extra(command, argv)
    try:
        if not {"-h", "--help"} & set(argv) or command == "serve":
            check_extra(command, extra)
        return _main(argv)
    except MissingExtra as err:
        print(err, file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        missing = missing_extra(command, extra, err)
        if missing is None:
            raise
        print(missing, file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:  # its options (and --help) are kubellm.serve.server's
        from kubellm.serve.server import main as serve_main

        serve_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    try:
        if args.command == "compile":
            for out in compile_pipelines(args.dir):
                print(f"compiled {out}")
            return 0
        if args.command == "run":
            from kubellm.commands.local_run import run_local

            overrides = parse_overrides(args.overrides, PipelineConfig)
            return run_local(args.pipeline, overrides, span=_span(args))
        if args.command == "submit":
            from kubellm.commands.submit import submit

            return submit(args)
        if args.command == "schedule":
            from kubellm.commands.schedule import schedule

            return schedule(args)
        if args.command == "render":
            from kubellm.commands.render import RUN_ID, render

            overrides = parse_overrides(args.overrides, PipelineConfig)
            if args.target == "slurm":
                from kubellm.commands.render_slurm import render_slurm

                print(render_slurm(overrides, args.run_id or RUN_ID), end="")
                return 0
            print(render(overrides, args.run_id or RUN_ID), end="")
            return 0
        if args.command == "prepare":
            return _prepare(args.out_dir, parse_overrides(args.overrides, PipelineConfig))
        if args.command == "train":
            return _train(args.dataset, args.output, args.nproc, args.overrides)
        if args.command == "evaluate":
            return _evaluate(args.model_dir, args.dataset_dir)
        if args.command == "lineage":
            from kubellm.commands.lineage import show
            from kubellm.tracking import check_reachable

            check_reachable(args.tracking_uri)
            print(show(args.tracking_uri, args.model, args.json), end="")
            return 0
        if args.command == "promote":
            from kubellm.commands.promote import promote_cli

            overrides = parse_overrides(args.overrides, PipelineConfig)
            if args.local:
                overrides["platform"] = "local"
            return promote_cli(args.model, args.tracking_uri, overrides, args.force)
    except Exception as err:
        code = _error_code(err)
        if code is None:
            raise
        print(f"kubellm: error: {err}", file=sys.stderr)
        return code
    return 2


def _error_code(err: BaseException) -> int | None:
    """The exit code of an error reported in one line, or None for any other exception.

    TrackingUnavailable and JobFailed are looked up only in modules already imported: an
    error cannot be one of their classes otherwise, and importing them would pull MLflow
    and the backends into every command (about 2 s of `kubellm prepare`'s start-up).
    """
    if isinstance(err, ConfigError | DataError):
        return 2
    tracking = sys.modules.get("kubellm.tracking")
    if tracking is not None and isinstance(err, tracking.TrackingUnavailable):
        return 2
    base = sys.modules.get("kubellm.backends.base")
    if base is not None and isinstance(err, base.JobFailed):  # its output is in its log file
        return 2 if err.exit_code == 2 else 1
    return None


def run() -> NoReturn:
    """The `kubellm` console script: main(), then the end of the process without the
    interpreter's teardown (kubellm/process.py). Tests call main() itself."""
    from kubellm.process import exit_now

    exit_now(main())


if __name__ == "__main__":
    run()
