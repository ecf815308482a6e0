"""The installs: the core and each extra (pyproject.toml) is enough for the commands it is for.

Real installs first: the kubellm wheel is built once, then three fresh venvs (no system
site-packages), created side by side (`venvs`): the core alone, torch + [serve], torch +
[train]. In each, its commands run as a person runs them, and `pip check` passes. pip's
own configuration applies (indexes, find-links, constraints), and torch is the Makefile's
TORCH_PIN, installed with the extra as the README says.

Then a fast check in the dev venv: the top-level modules `kubellm render` and `kubellm
serve` import belong to distributions in the requirement closure of the core and of
[serve] (pyproject.toml's requirements, then every installed distribution's Requires-Dist
with the extras asked for, recursively), so an extra that forgets a dependency fails here
without a venv; and the CLI's probe modules per extra (kubellm.cli.EXTRA_MODULES) agree with
pyproject.toml.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kubellm.backends.local.model_server import free_port
from kubellm.cli import EXTRA_MODULES

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
TORCH_PIN = re.search(r"^TORCH_PIN \?= (\S+)$", (REPO / "Makefile").read_text(), re.M)
INSTALL_TIMEOUT_S = 1500
# What each venv installs besides the wheel: (extras, torch first)
VENVS = {"core": ("", False), "serve": ("[serve]", True), "train": ("[train]", True)}


def _venv_env() -> dict[str, str]:
    """The environment a venv's commands run in: this one without the dev venv's paths, and
    with bytecode written (the venvs are installed `--no-compile`: the first command to import
    a module compiles it for the others, where PYTHONDONTWRITEBYTECODE would have every
    process compile torch again)."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
    return {k: v for k, v in os.environ.items() if k not in drop}


@dataclass(frozen=True)
class Venv:
    name: str
    root: Path
    install_s: float  # seconds to create it and install into it (the three run side by side)

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    def run(
        self, *args: str, cwd: Path, timeout: float = 300, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        env = _venv_env()
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        proc = subprocess.run(
            list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
        if check:
            assert proc.returncode == 0, f"{args}: {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc

    def kubellm(self, *args: str, cwd: Path, **kw) -> subprocess.CompletedProcess[str]:
        return self.run(str(self.root / "bin" / "kubellm"), *args, cwd=cwd, **kw)


def _build_wheel(out: Path) -> Path:
    """kubellm's wheel from a copy of what the build reads (the build writes build/ and
    egg-info beside its sources; the checkout stays as it is)."""
    src = out / "src-copy"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("*.egg-info"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("kubellm-*.whl")
    return wheel


def _make_venv(root: Path, wheel: Path, extras: str, torch: bool) -> Venv:
    assert TORCH_PIN, "TORCH_PIN not found in the Makefile"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300)
    packages = [*([TORCH_PIN.group(1)] if torch else []), f"{wheel}{extras}"]
    # --no-compile: pip byte-compiles every file it installs (half of a torch venv's install
    # CPU); the commands below compile what they import instead, once (`_venv_env`)
    proc = subprocess.run(
        [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", *packages],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"pip install {packages}: {proc.stdout}\n{proc.stderr[-5000:]}"
    return Venv(root.name, root, time.monotonic() - started)


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Venv]]]:
    """The three venvs, installing side by side; a test waits for its own only."""
    root = tmp_path_factory.mktemp("installs")
    wheel = _build_wheel(root / "wheel")
    with ThreadPoolExecutor(len(VENVS)) as pool:
        futures = {
            name: pool.submit(_make_venv, root / name, wheel, extras, torch)
            for name, (extras, torch) in VENVS.items()
        }
        yield futures
        for name, future in futures.items():
            if future.done() and future.exception() is None:
                venv = future.result()
                print(f"\nvenv {name}: installed in {venv.install_s:.0f}s")


def _venv(venvs: dict[str, Future[Venv]], name: str) -> Venv:
    return venvs[name].result(timeout=INSTALL_TIMEOUT_S)


def _extra_line(command: str, extra: str, module: str) -> str:
    return (
        f"kubellm {command}: needs the [{extra}] extra: pip install 'kubellm[{extra}]' "
        f"(No module named {module!r})"
    )


# --------------------------------------------------------------------------- core


def test_core_has_no_torch_and_its_commands_run(venvs, tmp_path: Path) -> None:
    core = _venv(venvs, "core")
    proc = core.run(core.python, "-c", "import torch", cwd=tmp_path)
    assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr, proc.stderr
    for absent in ("transformers", "pyarrow", "optuna", "sqlalchemy"):
        proc = core.run(core.python, "-c", f"import {absent}", cwd=tmp_path)
        assert proc.returncode != 0, f"the core install has {absent}"

    helped = core.kubellm("submit", "--help", cwd=tmp_path, check=True)
    assert helped.stdout.startswith("usage: kubellm submit"), helped.stdout

    rendered = core.kubellm("render", "--set", "gpus_per_node=8", cwd=tmp_path, check=True)
    objects = [o for o in yaml.safe_load_all(rendered.stdout) if o]
    kinds = {o["kind"] for o in objects}
    assert {"PyTorchJob", "InferenceService"} <= kinds, kinds


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["train", "--dataset", "ds", "--output", "model"], "train"),
        (["prepare", "ds"], "train"),
        (["serve", "model"], "serve"),
        (["run", "--local"], "local"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else v,
)
def test_core_names_the_missing_extra_in_one_line(
    venvs, tmp_path: Path, argv: list[str], extra: str
) -> None:
    core = _venv(venvs, "core")
    proc = core.kubellm(*argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [_extra_line(argv[0], extra, "torch")]
    assert list(tmp_path.iterdir()) == [], "the command started"


# --------------------------------------------------------------------------- serve


def test_serve_serves_a_saved_model(venvs, tmp_path: Path) -> None:
    serve = _venv(venvs, "serve")
    build = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1])\n"
        "from serve.tiny_model import build_tiny_model\n"
        "build_tiny_model(Path(sys.argv[2]))\n"
    )
    model = tmp_path / "model"
    serve.run(serve.python, "-c", build, str(REPO / "tests"), str(model), cwd=tmp_path, check=True)
    assert (model / "model.safetensors").is_file()
    for absent in ("pyarrow", "peft", "optuna"):  # [train]'s and [local]'s, not [serve]'s
        assert serve.run(serve.python, "-c", f"import {absent}", cwd=tmp_path).returncode != 0

    port = free_port()
    log = tmp_path / "serve.log"
    env = _venv_env()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                *(str(serve.root / "bin" / "kubellm"), "serve", str(model), "--name", "tiny"),
                *("--host", "127.0.0.1", "--port", str(port)),
            ],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        body = {"model": "tiny", "prompt": "12+7=", "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            f"{base}/openai/v1/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            answer = json.load(r)
        assert answer["object"] == "text_completion", answer
        assert answer["usage"]["completion_tokens"] == 4, answer
        assert isinstance(answer["choices"][0]["text"], str)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# --------------------------------------------------------------------------- train


def test_train_prepares_and_trains_ten_steps(venvs, tmp_path: Path) -> None:
    train = _venv(venvs, "train")
    for absent in ("optuna", "sqlalchemy"):  # [local]'s
        assert train.run(train.python, "-c", f"import {absent}", cwd=tmp_path).returncode != 0
    train.kubellm("prepare", "ds", "--set", "num_records=500", cwd=tmp_path, check=True)
    assert (tmp_path / "ds" / "manifest.json").is_file()
    proc = train.kubellm(
        *("train", "--dataset", "ds", "--output", "model", "--nproc", "1"),
        *("--set", "steps=10", "--set", "log_every=5", "--set", "eval_batches=1"),
        cwd=tmp_path,
        check=True,
        timeout=600,
    )
    metrics = json.loads(proc.stdout[proc.stdout.index("\n{") :])
    assert metrics["step"] == 10 and metrics["eval_loss"] > 0, metrics
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "model").iterdir()
    }


@pytest.mark.parametrize("name", list(VENVS))
def test_pip_check_passes(venvs, tmp_path: Path, name: str) -> None:
    venv = _venv(venvs, name)
    proc = venv.run(venv.python, "-m", "pip", "check", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- closures, fast


def _requirements(extras: set[str]) -> list[Requirement]:
    """kubellm's requirements with `extras` (from pyproject.toml: the tree under test, which
    `make install` puts into the dev venv's metadata), kubellm[...] references expanded."""
    optional = PYPROJECT["optional-dependencies"]
    out: list[Requirement] = [Requirement(r) for r in PYPROJECT["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in optional[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == "kubellm":
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def closure(extras: set[str]) -> set[str]:
    """The distributions kubellm with `extras` needs: its requirements, then each installed
    distribution's Requires-Dist whose marker holds for the extras asked of it, recursively
    (canonical names)."""
    found: dict[str, set[str]] = {}  # name -> the extras asked of it
    todo = [(req, "") for req in _requirements(extras)]
    while todo:
        req, asked_by_extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": asked_by_extra}):
            continue
        name = canonicalize_name(req.name)
        new = set(req.extras) - found.get(name, set())
        if name in found and not new:
            continue
        first = name not in found
        found.setdefault(name, set()).update(req.extras)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: its own requirements are unknown
        for text in requires:
            dep = Requirement(text)
            for extra in (("",) if first else ()) + tuple(new):
                todo.append((dep, extra))
    return set(found)


def _distributions_of(modules: set[str]) -> dict[str, set[str]]:
    """Top-level module -> the distributions that install it (canonical names)."""
    table = importlib.metadata.packages_distributions()
    return {m: {canonicalize_name(d) for d in table.get(m, [])} for m in modules}


def site_of(allowed: set[str], root: Path) -> Path:
    """A site-packages of links to the dev venv's installed files of the distributions in
    `allowed` only (modules and metadata: what an install of them alone would hold). A
    top-level entry that other distributions share (a namespace package such as google/) is
    linked file by file."""
    site = root / "site-packages"
    owners: dict[str, set[str]] = {}
    files: dict[str, list[Path]] = {}
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in files:  # an earlier sys.path entry shadows it, as import does
            continue
        files[name] = []
        for f in dist.files or []:
            if f.parts[0] == "..":
                continue
            owners.setdefault(f.parts[0], set()).add(name)
            files[name].append(Path(dist.locate_file(f)))
    for name in allowed & set(files):
        dist = importlib.metadata.distribution(name)
        base = Path(dist.locate_file(""))
        for path in files[name]:
            rel = path.relative_to(base)
            top = rel.parts[0]
            link = site / (top if owners[top] == {name} else rel)
            if link.exists() or link.is_symlink() or not (base / link.relative_to(site)).exists():
                continue
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(base / link.relative_to(site))
    return site


# Run in a process that sees only the standard library, the tree's src/ and a site-packages
# of the install under test (`site_of`): an optional import (transformers' of accelerate)
# falls back as it does in that install. The modules imported by the end (exit_now runs the
# atexit handlers) are written to a file.
PROLOGUE = """\
import atexit, json, site, sys
site.addsitedir(sys.argv[1])
sys.path.insert(0, sys.argv[2])
atexit.register(lambda: open(sys.argv[3], "w").write(json.dumps(sorted(sys.modules))))
"""


def _run_within(
    allowed: set[str], code: str, cwd: Path, timeout: float = 300
) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run `code` where only the distributions in `allowed` (and the standard library) are
    installed; the process and the top-level modules it imported."""
    site, dump = site_of(allowed, cwd / "install"), cwd / "modules.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [sys.executable, "-S", "-c", PROLOGUE + code, str(site), str(REPO / "src"), str(dump)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    modules = (
        {m.partition(".")[0] for m in json.loads(dump.read_text())} if dump.exists() else set()
    )
    return proc, modules


def _outside(modules: set[str], allowed: set[str]) -> dict[str, set[str]]:
    """Imported modules that a distribution installs, none of them in `allowed`."""
    found = _distributions_of(modules - {"kubellm"})
    return {m: d for m, d in found.items() if d and not d & allowed}


def test_the_closures_nest() -> None:
    core, serve, train, local = (closure(e) for e in (set(), {"serve"}, {"train"}, {"local"}))
    assert {"torch", "transformers"}.isdisjoint(core), "the core reaches torch"
    assert {"mlflow-skinny", "kserve", "kfp"} <= core
    assert "torch" in serve and "pyarrow" not in serve and "optuna" not in serve
    assert {"torch", "pyarrow", "peft"} <= train and "optuna" not in train
    assert core < serve < local and core < train < local
    assert {"mlflow", "optuna", "sqlalchemy"} <= local - (serve | train)


RENDER = "from kubellm.cli import main\nraise SystemExit(main(['render']))\n"


def test_render_runs_within_the_core(tmp_path: Path) -> None:
    core = closure(set())
    proc, modules = _run_within(core, RENDER, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kind: PyTorchJob" in proc.stdout and "kind: InferenceService" in proc.stdout
    assert {"kserve", "kubernetes", "yaml"} <= modules, sorted(modules)
    assert "torch" not in modules and _outside(modules, core) == {}


def test_render_fails_within_less_than_the_core(tmp_path: Path) -> None:
    """The check itself: without a distribution render needs (kserve), render fails."""
    proc, _ = _run_within(closure(set()) - {"kserve"}, RENDER, tmp_path)
    assert proc.returncode != 0 and "No module named 'kserve'" in proc.stderr, proc.stderr


def test_serve_runs_within_its_extra(tmp_path: Path) -> None:
    """`kubellm serve` on a tiny model where only [serve]'s closure can be imported: it gets
    ready, answers one completion, and ends on SIGTERM."""
    from serve.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    port = free_port()
    code = (
        "import json, os, signal, threading, time, urllib.request\n"
        "from kubellm.cli import main\n"
        "def client():\n"
        f"    base = 'http://127.0.0.1:{port}'\n"
        "    for _ in range(600):\n"
        "        try:\n"
        "            urllib.request.urlopen(base + '/v2/health/ready', timeout=5)\n"
        "            break\n"
        "        except OSError:\n"
        "            time.sleep(0.2)\n"
        "    body = json.dumps({'model': 'tiny', 'prompt': '1+2=', 'max_tokens': 2}).encode()\n"
        "    req = urllib.request.Request(base + '/openai/v1/completions', data=body,\n"
        "                                 headers={'content-type': 'application/json'})\n"
        "    answer = json.load(urllib.request.urlopen(req, timeout=60))\n"
        "    print('ANSWER', json.dumps(answer), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "threading.Thread(target=client, daemon=True).start()\n"
        f"main(['serve', {str(model)!r}, '--name', 'tiny', '--host', '127.0.0.1',"
        f" '--port', '{port}'])\n"
    )
    serve = closure({"serve"})
    proc, modules = _run_within(serve, code, tmp_path)
    answers = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line[:7] == "ANSWER "]
    assert answers, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert answers[0]["usage"]["completion_tokens"] == 2, answers
    assert {"torch", "transformers", "kserve", "fastapi", "uvicorn"} <= modules, sorted(modules)
    assert "pyarrow" not in modules and "optuna" not in modules
    assert _outside(modules, serve) == {}


def test_the_cli_probes_each_extra_by_what_it_installs() -> None:
    """kubellm.cli.EXTRA_MODULES (how a command tells that its extra is missing) names a
    module of every distribution the extra lists, and only modules its closure installs;
    [local]'s full mlflow by modules that mlflow-skinny (the core's) lacks."""
    optional = PYPROJECT["optional-dependencies"]
    core = closure(set())
    for extra, probes in EXTRA_MODULES.items():
        wanted = closure({extra})
        owners = _distributions_of(set(probes))
        for module, dists in owners.items():
            assert dists & wanted, f"[{extra}] probes {module}, which it does not install"
        direct = {canonicalize_name(Requirement(r).name) for r in optional[extra]}
        probed = set().union(*owners.values())
        if "mlflow" in direct:  # probed by what the full mlflow adds to mlflow-skinny
            full_only = {
                canonicalize_name(Requirement(r).name)
                for r in importlib.metadata.requires("mlflow") or []
            } - core
            assert probed & full_only, f"[{extra}] cannot tell mlflow from mlflow-skinny"
        for name in direct - {"kubellm", "mlflow"}:
            assert name in probed, f"[{extra}] installs {name}; kubellm.cli does not probe it"
