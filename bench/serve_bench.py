"""Benchmark of the model server (issue 12): latency and throughput of `python -m kubellm.serve`
against the same model called in-process, and a bounded locust load test.

On this machine, one run, one model, the same arithmetic prompts ("62+51=", from
kubellm.data.synthetic), max_tokens 8, greedy, the same torch threads on every side (the
bench calls torch.set_num_threads; each server process gets OMP_NUM_THREADS, which torch
reads at start-up: the server has no threads flag):

1. Latency, one client, sequential requests; in each round the contenders take turns of
   SLICE (10) requests, the order rotating every turn, so noise falls on all alike:
   - the server's OpenAI completions route over HTTP on loopback (a keep-alive connection);
   - in-process, the server's own engine: `BatchEngine.generate_sync`, a batch of one (the
     like-for-like peer; target: server p50 <= 1.1 x it, p99 <= 1.2 x);
   - the same engine with max_wait_ms 0 (information: its batching wait can fire for a lone
     caller, at random, so this is the engine's cost without it);
   - in-process, `generate.complete` (model.generate, what evaluate calls; information);
   - the server's V1 predict route (information: what the issue's "before" figure used);
   - bench/peers/bare_http.py, a bare HTTP server (uvloop, httptools, no framework) on the
     same engine (information: the floor of HTTP in Python, so the report tells the
     framework's and handler's share of the gap from HTTP's own).
   Both in-process callers tokenize the prompt inside the timed call, as the server does.
2. Throughput, requests/s: one client sequential; 16 concurrent clients against a server
   started with --max-batch 1 (no batching); 16 concurrent clients against --max-batch 16.
   Target: 16 concurrent batched >= 4 x one at a time.
3. A locust run (bench/locustfile.py, its own process): headless, 16 users, exactly 200
   requests against the --max-batch 16 server; target: no failure.

The model is the `make run` shape (kubellm.stages.configs.model_shape of the default
PipelineConfig: a Llama via kubellm.train.model.new_llama, with a BPE trained on the default
synthetic records), built once, seeded and untrained, under --cache-dir; `--model-dir` serves
a trained one instead. Warm-up requests run before every timed block, on both sides.
`--max-wait-ms` sets the servers' and the in-process engine's batching wait (default: the
server's).

    python -m bench.serve_bench --out docs/benchmarks-serve.md [--model-dir DIR] [--check]
    python -m bench.serve_bench --quick --out /tmp/serve-bench.md   # the test's size, ~30 s
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import math
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httptools

from bench.machine import machine_info

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
NAME = "bench"
# server / engine in-process, at most: p50 (issue 20's 1.1), p99 (issue 12's 1.2)
TARGET_LATENCY = {"p50": 1.1, "p99": 1.2}
TARGET_THROUGHPUT = 4.0  # 16 concurrent batched / one client sequential, requests/s (issue 20)
LATENCY = (
    "server_openai",
    "engine",
    "engine_nowait",
    "complete",
    "server_v1",
    "server_openai_httpclient",
    "bare_openai",
)
LABELS = {
    "server_openai": "server, OpenAI completions (HTTP)",
    "server_v1": "server, V1 predict (HTTP)",
    "server_openai_httpclient": "server, OpenAI completions (HTTP, http.client)",
    "bare_openai": "bare HTTP server on the same engine (bench/peers/bare_http.py)",
    "engine": "in-process, BatchEngine.generate_sync",
    "engine_nowait": "in-process, BatchEngine.generate_sync, max_wait_ms 0",
    "complete": "in-process, generate.complete",
    "sequential": "one client, sequential",
    "mb1": "16 clients, --max-batch 1",
    "mb16": "16 clients, --max-batch 16",
}
THROUGHPUT = ("sequential", "mb1", "mb16")
PACKAGES = ("torch", "transformers", "kserve", "fastapi", "uvicorn", "locust")
# The issue's "before": one V1 request through the server vs model.generate in-process.
BEFORE = "single V1 request p50 10.4 ms vs in-process 6.7 ms (1.55 x)"


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every side shares."""

    rounds: int
    requests: int  # sequential latency requests per contender per round
    throughput_requests: int  # requests per throughput block
    clients: int
    warmup: int
    max_tokens: int
    max_batch: int
    max_wait_ms: float | None  # None: the server's default (EngineOptions)
    threads: int
    locust_requests: int
    locust_users: int
    seed: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Setup:
        """The setup `parse_args`'s flags ask for."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


Answer = tuple[str, int | None]  # (text, generated tokens when the caller can tell)
Call = Callable[[str], Answer]


# --- the model ------------------------------------------------------------------------------


def ensure_model(cache_dir: Path, seed: int) -> Path:
    """The `make run` model shape, seeded and untrained, built once per shape and cached.

    An untrained model does the same work per token as a trained one of its shape; greedy, it
    rarely picks EOS, so every request generates its max_tokens (the report shows the count).
    """
    from kubellm.config import PipelineConfig
    from kubellm.stages.configs import model_shape

    cfg = PipelineConfig()
    shape = model_shape(cfg)
    name = (
        f"serve-model-h{shape.hidden_size}-l{shape.num_layers}-a{shape.num_heads}"
        f"-i{shape.intermediate_size}-v{cfg.vocab_size}-seed{seed}"
    )
    path = cache_dir / name
    if (path / "model.safetensors").is_file():
        return path
    import torch

    from kubellm.data.synthetic import arithmetic_records
    from kubellm.data.tokenizer import train_bpe
    from kubellm.train.model import new_llama

    cache_dir.mkdir(parents=True, exist_ok=True)
    texts = [r["text"] for r in arithmetic_records(cfg.num_records, seed=cfg.seed)]
    tokenizer = train_bpe(texts, cfg.vocab_size)
    torch.manual_seed(seed)
    model = new_llama(shape, tokenizer)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".serve-model-"))
    with contextlib.redirect_stdout(sys.stderr):
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def bench_prompts(n: int, seed: int) -> list[str]:
    from kubellm.data.synthetic import arithmetic_records

    return [r["prompt"] for r in arithmetic_records(n, seed=seed + 1)]


def describe_model(model: Any, model_dir: Path) -> dict[str, Any]:
    c = model.config
    return {
        "dir": str(model_dir),
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "hidden": c.hidden_size,
        "layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "intermediate": c.intermediate_size,
        "vocab": c.vocab_size,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }


# --- in-process -----------------------------------------------------------------------------


class InProcess:
    """The model loaded as the server loads it, and its in-process callers: the engine with
    the server's options, the engine with max_wait_ms 0 (never waits to fill a batch), and
    generate.complete."""

    def __init__(self, model_dir: Path, setup: Setup) -> None:
        import torch

        from kubellm.serve.engine import BatchEngine, EngineOptions
        from kubellm.serve.generate import load_model

        torch.set_num_threads(setup.threads)
        self.max_tokens = setup.max_tokens
        self.model, self.tokenizer = load_model(model_dir)
        self.engines = {
            "engine": BatchEngine(
                self.model, self.tokenizer, engine_options(setup.max_batch, setup.max_wait_ms)
            ),
            "engine_nowait": BatchEngine(
                self.model, self.tokenizer, EngineOptions(max_batch=setup.max_batch, max_wait_ms=0)
            ),
        }
        for engine in self.engines.values():
            engine.start()

    def engine_call(self, name: str) -> Call:
        from kubellm.serve.engine import SamplingParams

        engine = self.engines[name]
        params = SamplingParams(max_tokens=self.max_tokens)

        # as the server encodes (kubellm.serve.model): the fast tokenizer's own Tokenizer
        backend = getattr(self.tokenizer, "backend_tokenizer", None)

        def call(prompt: str) -> Answer:
            if backend is None:
                ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            else:
                ids = backend.encode(prompt, add_special_tokens=False).ids
            (gen,) = engine.generate_sync([(ids, params)])
            return gen.text, len(gen.token_ids)

        return call

    def complete_call(self, prompt: str) -> Answer:
        from kubellm.serve.generate import complete

        (text,) = complete(self.model, self.tokenizer, [prompt], self.max_tokens)
        return text, None

    def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()


# --- servers and the HTTP client ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def engine_options(max_batch: int, max_wait_ms: float | None) -> Any:
    """The options a server started with these flags gives its engine."""
    from kubellm.serve.engine import EngineOptions

    if max_wait_ms is None:
        return EngineOptions(max_batch=max_batch)
    return EngineOptions(max_batch=max_batch, max_wait_ms=max_wait_ms)


def server_command(
    model_dir: Path, port: int, max_batch: int, max_wait_ms: float | None = None
) -> list[str]:
    wait = [] if max_wait_ms is None else ["--max-wait-ms", f"{max_wait_ms:g}"]
    return [
        sys.executable,
        "-m",
        "kubellm.serve",
        str(model_dir),
        "--name",
        NAME,
        "--host",
        HOST,
        "--port",
        str(port),
        "--max-batch",
        str(max_batch),
        *wait,
    ]


def server_env(setup: Setup) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(setup.threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


@dataclasses.dataclass
class Server:
    max_batch: int
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    cmd: list[str]
    started: float  # time.perf_counter() at launch

    def log_size(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def bare_command(
    model_dir: Path, port: int, max_batch: int, max_wait_ms: float | None
) -> list[str]:
    wait = [] if max_wait_ms is None else ["--max-wait-ms", f"{max_wait_ms:g}"]
    cmd = [sys.executable, "-m", "bench.peers.bare_http", str(model_dir), "--host", HOST]
    return [*cmd, "--port", str(port), "--name", NAME, "--max-batch", str(max_batch), *wait]


def start_server(
    model_dir: Path, max_batch: int, setup: Setup, work: Path, bare: bool = False
) -> Server:
    """The model server (bare: bench/peers/bare_http.py instead) on a free port."""
    port = free_port()
    make = bare_command if bare else server_command
    cmd = make(model_dir, port, max_batch, setup.max_wait_ms)
    log = work / f"{'bare' if bare else 'server'}-mb{max_batch}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=server_env(setup),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped whole
        )
    return Server(max_batch, port, proc, log, cmd, time.perf_counter())


def wait_ready(server: Server, timeout: float) -> float:
    """Poll the readiness route until the model is ready; seconds since the launch."""
    while time.perf_counter() - server.started < timeout:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"the server exited ({server.proc.returncode}): {shlex.join(server.cmd)}\n"
                f"{server.log_tail()}"
            )
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
            conn = http.client.HTTPConnection(HOST, server.port, timeout=2)
            try:
                conn.request("GET", f"/v1/models/{NAME}")
                resp = conn.getresponse()
                if resp.status == 200 and json.loads(resp.read()).get("ready"):
                    return time.perf_counter() - server.started
            finally:
                conn.close()
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"the server was not ready in {timeout:.0f} s:\n{server.log_tail()}")


def stop_server(*servers: Server, timeout: float = 15.0) -> None:
    """SIGTERM to every server's process group at once (each shuts down gracefully in a
    few seconds), SIGKILL to any still running after `timeout`."""
    running = [s for s in servers if s.proc.poll() is None]
    for s in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(s.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for s in running:
        try:
            s.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()


class _JsonClient:
    """The bench's requests (OpenAI completions, V1 predict) over one keep-alive connection;
    `post` sends JSON and returns the parsed 200 answer."""

    max_tokens: int

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        raise NotImplementedError

    def openai(self, prompt: str) -> Answer:
        out = self.post(
            "/openai/v1/completions",
            {"model": NAME, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0},
        )
        return out["choices"][0]["text"], out["usage"]["completion_tokens"]

    def v1(self, prompt: str) -> Answer:
        payload = {"instances": [{"prompt": prompt, "max_new_tokens": self.max_tokens}]}
        return self.post(f"/v1/models/{NAME}:predict", payload)["predictions"][0], None

    @staticmethod
    def _answer(path: str, status: int, data: bytes) -> Any:
        if status != 200:
            raise RuntimeError(f"POST {path}: HTTP {status}: {data[:300]!r}")
        return json.loads(data)


class Client(_JsonClient):
    """One keep-alive connection (what a client library holds), JSON in and out, HTTP/1.1
    parsed in C by httptools (what uvicorn parses requests with), as load generators such as
    wrk parse natively: the client's own work is not the server's latency. `HttpClient`
    is the same over the standard library's http.client, whose header parsing (the email
    package) costs more per request than the rest of the client (docs/benchmarks.md)."""

    def __init__(self, port: int, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.sock = socket.create_connection((HOST, port), timeout=120)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._head = f"Host: {HOST}:{port}\r\nContent-Type: application/json\r\n".encode()
        self._body: list[bytes] = []
        self._done = False
        self._keep_alive = False
        self._parser = httptools.HttpResponseParser(self)

    # httptools' callbacks
    def on_headers_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._done = True

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        body = json.dumps(payload).encode()
        self.sock.sendall(
            b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s"
            % (path.encode(), self._head, len(body), body)
        )
        self._body.clear()
        self._done = False
        while not self._done:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError(f"POST {path}: the server closed the connection")
            self._parser.feed_data(data)
        answer = self._answer(path, self._parser.get_status_code(), b"".join(self._body))
        if not self._keep_alive:
            raise ConnectionError(f"POST {path}: the server did not keep the connection")
        return answer

    def close(self) -> None:
        self.sock.close()


class HttpClient(_JsonClient):
    """The same requests over the standard library's http.client (information)."""

    def __init__(self, port: int, max_tokens: int) -> None:
        self.conn = http.client.HTTPConnection(HOST, port, timeout=120)
        self.max_tokens = max_tokens

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        body = json.dumps(payload).encode()
        self.conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        return self._answer(path, resp.status, resp.read())

    def close(self) -> None:
        self.conn.close()


# --- measuring ------------------------------------------------------------------------------


@dataclasses.dataclass
class Block:
    """One timed block: a contender's requests in one round."""

    contender: str
    round: int
    latencies: list[float]  # seconds, one per request
    wall_s: float
    answers: dict[str, str]
    tokens: list[int]

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall_s


def percentile(values: list[float], p: float) -> float:
    """Nearest rank: the smallest value with at least p % of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def sequential(
    name: str, call: Call, prompts: list[str], n: int, warmup: int, rnd: int, first: int = 0
) -> Block:
    """`n` requests one after the other (after `warmup` untimed), prompts from `first` on."""
    for i in range(warmup):
        call(prompts[-1 - i % len(prompts)])
    latencies, answers, tokens = [], {}, []
    t0 = time.perf_counter()
    for i in range(first, first + n):
        prompt = prompts[i % len(prompts)]
        t = time.perf_counter()
        text, count = call(prompt)
        latencies.append(time.perf_counter() - t)
        answers[prompt] = text
        if count is not None:
            tokens.append(count)
    return Block(name, rnd, latencies, time.perf_counter() - t0, answers, tokens)


def concurrent(
    name: str, port: int, prompts: list[str], setup: Setup, clients: int, total: int, rnd: int
) -> Block:
    """`clients` threads, each with its own connection, share `total` requests; the wall
    time runs from their common start to the last response. Each first sends a warm-up
    request (all at once), untimed."""
    lock = threading.Lock()
    issued = [0]
    latencies: list[float] = []
    answers: dict[str, str] = {}
    tokens: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(clients + 1)

    def worker(k: int) -> None:
        client = Client(port, setup.max_tokens)
        try:
            for w in range(setup.warmup and 2):
                client.openai(prompts[-1 - (k * 2 + w) % len(prompts)])
        except BaseException as err:
            errors.append(err)
        try:
            start.wait()
            while not errors:
                with lock:
                    i = issued[0]
                    issued[0] += 1
                if i >= total:
                    break
                prompt = prompts[i % len(prompts)]
                t = time.perf_counter()
                text, count = client.openai(prompt)
                dt = time.perf_counter() - t
                with lock:
                    latencies.append(dt)
                    answers[prompt] = text
                    tokens.append(count or 0)
        except BaseException as err:
            errors.append(err)
            start.abort()
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{LABELS[name]}: a request failed: {errors[0]!r}") from errors[0]
    return Block(name, rnd, latencies, wall, answers, tokens)


def rotate(items: tuple[str, ...], k: int) -> list[str]:
    k %= len(items)
    return list(items[k:] + items[:k])


SLICE = 10  # latency: requests a contender sends in one turn


def measure_latency(
    setup: Setup, inproc: InProcess, server: Server, bare: Server, prompts: list[str]
) -> list[Block]:
    """Per round, the contenders take turns of SLICE requests each (the order rotates every
    turn), each turn after one untimed request: every contender meets the machine as it is
    in the same few seconds, so a slow patch of this shared machine falls on all of them
    alike rather than on whoever held the round's block then."""
    in_process: dict[str, Call] = {
        "engine": inproc.engine_call("engine"),
        "engine_nowait": inproc.engine_call("engine_nowait"),
        "complete": inproc.complete_call,
    }
    blocks = []
    for rnd in range(setup.rounds):
        openai, v1 = Client(server.port, setup.max_tokens), Client(server.port, setup.max_tokens)
        stdlib = HttpClient(server.port, setup.max_tokens)
        floor = Client(bare.port, setup.max_tokens)
        calls = {
            **in_process,
            "server_openai": openai.openai,
            "server_v1": v1.v1,
            "server_openai_httpclient": stdlib.openai,
            "bare_openai": floor.openai,
        }
        parts: dict[str, list[Block]] = {name: [] for name in LATENCY}
        try:
            for name in LATENCY:
                for i in range(setup.warmup):
                    calls[name](prompts[-1 - i % len(prompts)])
            for turn, first in enumerate(range(0, setup.requests, SLICE)):
                n = min(SLICE, setup.requests - first)
                for name in rotate(LATENCY, rnd + turn):
                    calls[name](prompts[-1 - turn % len(prompts)])  # the first after a switch
                    parts[name].append(sequential(name, calls[name], prompts, n, 0, rnd, first))
        finally:
            openai.close()
            v1.close()
            stdlib.close()
            floor.close()
        for name in LATENCY:
            block = Block(name, rnd, [], 0.0, {}, [])
            for part in parts[name]:
                block.latencies += part.latencies
                block.wall_s += part.wall_s
                block.answers.update(part.answers)
                block.tokens += part.tokens
            blocks.append(block)
            print(_latency_line(block), flush=True)
    return blocks


def measure_throughput(setup: Setup, servers: dict[int, Server], prompts: list[str]) -> list[Block]:
    blocks = []
    batched = servers[setup.max_batch]
    for rnd in range(setup.rounds):
        for name in rotate(THROUGHPUT, rnd):
            if name == "sequential":
                client = Client(batched.port, setup.max_tokens)
                try:
                    block = sequential(
                        name, client.openai, prompts, setup.throughput_requests, setup.warmup, rnd
                    )
                finally:
                    client.close()
            else:
                server = servers[1] if name == "mb1" else batched
                block = concurrent(
                    name, server.port, prompts, setup, setup.clients, setup.throughput_requests, rnd
                )
            blocks.append(block)
            print(
                f"round {rnd + 1} {LABELS[name]:<28} {block.rps:8.1f} req/s  "
                f"p50 {percentile(block.latencies, 50) * 1e3:6.2f} ms",
                flush=True,
            )
    return blocks


def _latency_line(b: Block) -> str:
    return (
        f"round {b.round + 1} {LABELS[b.contender]:<40} p50 "
        f"{percentile(b.latencies, 50) * 1e3:6.2f} ms  p99 {percentile(b.latencies, 99) * 1e3:6.2f}"
        " ms"
    )


# --- locust ---------------------------------------------------------------------------------


def locust_command(url: str, setup: Setup, prompts_file: Path, summary: Path) -> list[str]:
    locust = Path(sys.executable).parent / "locust"
    return [
        str(locust if locust.exists() else "locust"),
        "-f",
        "bench/locustfile.py",
        "--headless",
        "-u",
        str(setup.locust_users),
        "-r",
        str(setup.locust_users),
        "--host",
        url,
        "--only-summary",
        "--run-time",
        "300s",  # a safety net: the locustfile quits after --bench-requests responses
        "--bench-model",
        NAME,
        "--bench-requests",
        str(setup.locust_requests),
        "--bench-max-tokens",
        str(setup.max_tokens),
        "--bench-prompts",
        str(prompts_file),
        "--bench-summary",
        str(summary),
    ]


def run_locust(server: Server, setup: Setup, prompts: list[str], work: Path) -> dict[str, Any]:
    prompts_file, summary = work / "locust-prompts.json", work / "locust-summary.json"
    prompts_file.write_text(json.dumps(prompts))
    summary.unlink(missing_ok=True)
    cmd = locust_command(f"http://{HOST}:{server.port}", setup, prompts_file, summary)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=360)
    wall = time.perf_counter() - t0
    if not summary.is_file():
        raise RuntimeError(
            f"locust wrote no summary (exit {proc.returncode}): {shlex.join(cmd)}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    out: dict[str, Any] = json.loads(summary.read_text())
    out["exit_code"] = proc.returncode
    out["wall_s"] = wall
    out["command"] = cmd
    return out


# --- figures and the report -----------------------------------------------------------------


def latency_figures(blocks: list[Block]) -> dict[str, dict[str, Any]]:
    """Per contender: percentiles over all its requests (every round), per-round p50s."""
    out: dict[str, dict[str, Any]] = {}
    for name in LATENCY:
        mine = [b for b in blocks if b.contender == name]
        lat = [x for b in mine for x in b.latencies]
        tokens = [x for b in mine for x in b.tokens]
        out[name] = {
            "requests": len(lat),
            "p50_ms": percentile(lat, 50) * 1e3,
            "p90_ms": percentile(lat, 90) * 1e3,
            "p99_ms": percentile(lat, 99) * 1e3,
            "mean_ms": statistics.fmean(lat) * 1e3,
            "round_p50_ms": [percentile(b.latencies, 50) * 1e3 for b in mine],
            "round_p99_ms": [percentile(b.latencies, 99) * 1e3 for b in mine],
            "tokens_per_request": statistics.fmean(tokens) if tokens else None,
        }
    return out


def throughput_figures(blocks: list[Block]) -> dict[str, dict[str, Any]]:
    """Per setting: requests/s of each round, their median, latency under that load."""
    out: dict[str, dict[str, Any]] = {}
    for name in THROUGHPUT:
        mine = [b for b in blocks if b.contender == name]
        lat = [x for b in mine for x in b.latencies]
        out[name] = {
            "rounds_rps": [b.rps for b in mine],
            "rps": statistics.median(b.rps for b in mine),
            "requests": sum(len(b.latencies) for b in mine),
            "p50_ms": percentile(lat, 50) * 1e3,
            "p99_ms": percentile(lat, 99) * 1e3,
            "tokens_per_request": statistics.fmean(x for b in mine for x in b.tokens),
        }
    return out


def ratios(lat: dict[str, Any], thr: dict[str, Any], loc: dict[str, Any], setup: Setup) -> Any:
    """Every comparison the report makes; `target` None: information only."""

    def per_round(a: str, b: str, key: str) -> list[float]:
        return [x / y for x, y in zip(lat[a][key], lat[b][key], strict=True)]

    rows: dict[str, dict[str, Any]] = {}
    for q in ("p50", "p99"):
        for peer, target in (
            ("engine", TARGET_LATENCY[q]),
            ("engine_nowait", None),
            ("complete", None),
        ):
            ratio = lat["server_openai"][f"{q}_ms"] / lat[peer][f"{q}_ms"]
            rows[f"latency_{q}_vs_{peer}"] = {
                "ratio": ratio,
                "per_round": per_round("server_openai", peer, f"round_{q}_ms"),
                "target": target,
                "pass": None if target is None else ratio <= target,
            }
    rows["latency_p50_httpclient_vs_engine"] = {
        "ratio": lat["server_openai_httpclient"]["p50_ms"] / lat["engine"]["p50_ms"],
        "per_round": per_round("server_openai_httpclient", "engine", "round_p50_ms"),
        "target": None,
        "pass": None,
    }
    rows["latency_p50_bare_vs_engine"] = {
        "ratio": lat["bare_openai"]["p50_ms"] / lat["engine"]["p50_ms"],
        "per_round": per_round("bare_openai", "engine", "round_p50_ms"),
        "target": None,
        "pass": None,
    }
    rows["latency_p50_v1_vs_complete"] = {
        "ratio": lat["server_v1"]["p50_ms"] / lat["complete"]["p50_ms"],
        "per_round": per_round("server_v1", "complete", "round_p50_ms"),
        "target": None,
        "pass": None,
    }
    seq, mb1, mb16 = (thr[k]["rounds_rps"] for k in THROUGHPUT)
    ratio = thr["mb16"]["rps"] / thr["sequential"]["rps"]
    rows["throughput_batched_vs_sequential"] = {
        "ratio": ratio,
        "per_round": [b / s for b, s in zip(mb16, seq, strict=True)],
        "target": TARGET_THROUGHPUT,
        "pass": ratio >= TARGET_THROUGHPUT,
    }
    rows["throughput_batched_vs_max_batch_1"] = {
        "ratio": thr["mb16"]["rps"] / thr["mb1"]["rps"],
        "per_round": [b / s for b, s in zip(mb16, mb1, strict=True)],
        "target": None,
        "pass": None,
    }
    total = loc["total"]
    rows["locust"] = {
        "ratio": None,
        "per_round": [],
        "target": f"{setup.locust_requests} requests, 0 failures",
        "pass": total["requests"] == setup.locust_requests and total["failures"] == 0,
    }
    return rows


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else "PASS" if ok else "MISS"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _rounds(values: list[float], fmt: str = ".2f") -> str:
    return ", ".join(format(v, fmt) for v in values)


def report(
    setup: Setup,
    lat: dict[str, Any],
    thr: dict[str, Any],
    loc: dict[str, Any],
    rat: dict[str, Any],
    info: dict[str, str],
    model: dict[str, Any],
    agree: dict[str, tuple[int, int]],
    cmds: dict[str, str],
    loads: tuple[str, str],
) -> tuple[str, str]:
    """(the results table, the whole markdown report)."""
    so = lat["server_openai"]
    rows = [
        "| metric | kubellm server | peer | ratio | target | result |",
        "|---|---:|---:|---:|---|---|",
    ]
    for peer, title in (
        ("engine", "BatchEngine in-process"),
        ("engine_nowait", "BatchEngine in-process, max_wait_ms 0"),
        ("complete", "generate.complete in-process"),
    ):
        for q in ("p50", "p99"):
            r = rat[f"latency_{q}_vs_{peer}"]
            target = "—" if r["target"] is None else f"≤ {r['target']}"
            rows.append(
                f"| {q} latency (ms), one client, vs {title} (per round "
                f"{_rounds(r['per_round'])}) | {_ms(so[f'{q}_ms'])} | {_ms(lat[peer][f'{q}_ms'])} "
                f"| {r['ratio']:.2f} | {target} | {_verdict(r['pass'])} |"
            )
    r = rat["latency_p50_httpclient_vs_engine"]
    rows.append(
        f"| p50 latency (ms), one client on http.client, vs BatchEngine in-process (per round "
        f"{_rounds(r['per_round'])}) | {_ms(lat['server_openai_httpclient']['p50_ms'])} "
        f"| {_ms(lat['engine']['p50_ms'])} | {r['ratio']:.2f} | — | — |"
    )
    r = rat["latency_p50_bare_vs_engine"]
    rows.append(
        f"| p50 latency (ms), one client, the bare HTTP server (no framework) on the same "
        f"engine, vs BatchEngine in-process (per round {_rounds(r['per_round'])}) "
        f"| {_ms(lat['bare_openai']['p50_ms'])} | {_ms(lat['engine']['p50_ms'])} "
        f"| {r['ratio']:.2f} | — | — |"
    )
    r = rat["latency_p50_v1_vs_complete"]
    rows.append(
        f"| p50 latency (ms), V1 predict vs generate.complete in-process (the issue's before: "
        f"{BEFORE}) | {_ms(lat['server_v1']['p50_ms'])} | {_ms(lat['complete']['p50_ms'])} "
        f"| {r['ratio']:.2f} | — | — |"
    )
    for key, peer, target in (
        ("throughput_batched_vs_sequential", "sequential", f"≥ {TARGET_THROUGHPUT}"),
        ("throughput_batched_vs_max_batch_1", "mb1", "—"),
    ):
        r = rat[key]
        rows.append(
            f"| requests/s, {LABELS['mb16']} vs {LABELS[peer]} (per round "
            f"{_rounds(r['per_round'])}) | {thr['mb16']['rps']:.1f} | {thr[peer]['rps']:.1f} "
            f"| {r['ratio']:.2f} | {target} | {_verdict(r['pass'])} |"
        )
    t = loc["total"]
    rows.append(
        f"| locust: {setup.locust_users} users, {setup.locust_requests} requests: requests, "
        f"failures | {t['requests']}, {t['failures']} | — | — | {rat['locust']['target']} "
        f"| {_verdict(rat['locust']['pass'])} |"
    )
    table = "\n".join(rows)

    lat_rows = [
        "| contender | requests | p50 ms | p90 ms | p99 ms | mean ms | p50 per round | "
        "tokens/request |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name in LATENCY:
        x = lat[name]
        tok = "n/a" if x["tokens_per_request"] is None else f"{x['tokens_per_request']:.2f}"
        lat_rows.append(
            f"| {LABELS[name]} | {x['requests']} | {_ms(x['p50_ms'])} | {_ms(x['p90_ms'])} "
            f"| {_ms(x['p99_ms'])} | {_ms(x['mean_ms'])} | {_rounds(x['round_p50_ms'])} "
            f"| {tok} |"
        )
    thr_rows = [
        "| setting | server | requests/s (median) | per round | latency p50 ms | latency p99 ms "
        "| tokens/request |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for name in THROUGHPUT:
        x = thr[name]
        mb = 1 if name == "mb1" else setup.max_batch
        thr_rows.append(
            f"| {LABELS[name]} | --max-batch {mb} | {x['rps']:.1f} | "
            f"{_rounds(x['rounds_rps'], '.1f')} | {_ms(x['p50_ms'])} | {_ms(x['p99_ms'])} "
            f"| {x['tokens_per_request']:.2f} |"
        )
    loc_route = loc["route"]
    loc_rows = [
        "| requests | failures | p50 ms | p95 ms | p99 ms | mean ms | max ms | requests/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {loc_route['requests']} | {loc_route['failures']} | {loc_route['p50_ms']} "
        f"| {loc_route['p95_ms']} | {loc_route['p99_ms']} | {loc_route['avg_ms']:.1f} "
        f"| {loc_route['max_ms']:.1f} | {loc_route['rps']:.1f} |",
    ]
    errors = "".join(f"\n- error: {e['error']} ({e['occurrences']}x)" for e in loc["errors"])

    eng, eng0 = lat["engine"]["p50_ms"], lat["engine_nowait"]["p50_ms"]
    wait = engine_options(setup.max_batch, setup.max_wait_ms).max_wait_ms
    waits = (
        f"In-process the engine takes {eng:.2f} ms with the servers' options (max_wait_ms "
        f"{wait:g}) and {eng0:.2f} ms with max_wait_ms 0"
    )
    if wait > 0 and eng - eng0 > 0.2 * wait:
        waits += (
            f": {eng - eng0:.2f} ms is its batching wait firing for a lone caller "
            "(`generate_sync` hands the result over and submits the next prompt before the "
            "worker is back in `_take`, which then reads the queued request as load and waits "
            "up to max_wait_ms for company that never comes)."
        )
    elif wait > 0:
        waits += (
            ": in this run the batching wait seldom fired for a lone in-process caller (it is "
            "a race: when `generate_sync` submits the next prompt before the worker is back in "
            "`_take`, the worker reads it as load and waits up to max_wait_ms)."
        )
    else:
        waits += "."
    if wait > 0:
        waits += (
            " The servers' engines run with the same options, so their requests can pay the "
            "same wait (the per-round p50s show it); `--max-wait-ms 0` runs the servers and "
            "the in-process engine without it."
        )
    breakdown = waits
    a_eng, n_eng = agree["openai_vs_engine"]
    a_v1, n_v1 = agree["v1_vs_complete"]
    a_bare, n_bare = agree["bare_vs_engine"]
    machine = "\n".join(f"| {k} | {v} |" for k, v in info.items())
    opts = dataclasses.asdict(engine_options(setup.max_batch, setup.max_wait_ms))
    wait_source = "the server's default" if setup.max_wait_ms is None else "--max-wait-ms"
    md = f"""# Serving benchmark

Issues 12's and 20's targets, measured in one run on this machine ({info["nproc"]} CPUs,
{info["date"]}). Rerun with `make bench-serve`, or:

```
{cmds["bench"]}
```

## Results

{table}

Latency: {setup.requests} sequential requests per contender per round, {setup.rounds}
round(s); within a round the {len(LATENCY)} contenders take turns of {SLICE} requests (the order
rotates every turn; one untimed request opens each turn), so each meets the machine of the
same seconds; percentiles over all of them (nearest rank); "per round" is the same ratio
within each round. Throughput: the
median over the rounds of requests/s, {setup.throughput_requests} requests per block. The
machine is shared: load average {loads[0]} at the start, {loads[1]} at the end.

## Latency, one client, sequential

{chr(10).join(lat_rows)}

- server: HTTP on loopback, one keep-alive connection (a socket, the response parsed by
  httptools, as load generators parse natively; "on http.client": the standard library's
  client instead, information), the JSON body built, sent, read and parsed inside the timed
  span; `{{"model", "prompt", "max_tokens":
  {setup.max_tokens}, "temperature": 0}}`; V1: `{{"instances": [{{"prompt", "max_new_tokens":
  {setup.max_tokens}}}]}}`.
- in-process: the same model directory loaded with `kubellm.serve.generate.load_model`;
  `BatchEngine(model, tokenizer, EngineOptions(max_batch={setup.max_batch},
  max_wait_ms={opts["max_wait_ms"]:g}))` (the servers' options),
  `.generate_sync([(ids, SamplingParams(max_tokens={setup.max_tokens}))])` after tokenizing
  the prompt; `generate.complete(model, tokenizer, [prompt], {setup.max_tokens})`
  (model.generate, greedy, one prompt per pass).
- {setup.warmup} warm-up requests before every timed block; tokens/request: the generated
  tokens the engine and the server's `usage` report (generate.complete and V1 do not say).
- bare: `python -m bench.peers.bare_http` (uvloop, httptools, `json`, the same engine
  options and tokenizer call; no framework, validation, limits, metrics or access log, and
  its headers and body in one write): the floor for any Python server around this engine.
- Answers: the server's OpenAI text equals the in-process engine's for {a_eng} of {n_eng}
  prompts, the bare server's for {a_bare} of {n_bare}; V1's stripped text equals
  generate.complete's for {a_v1} of {n_v1} (batched and unbatched greedy may differ on
  near-ties, see kubellm.serve.engine).

{breakdown}

## Throughput

{chr(10).join(thr_rows)}

- one client: sequential requests on one connection to the --max-batch {setup.max_batch}
  server; 16 clients: {setup.clients} threads, one keep-alive connection each, sharing
  {setup.throughput_requests} requests, timed from their common start to the last response
  (each first sends 2 untimed warm-up requests, all at once).
- Both servers run for the whole bench (an idle one costs nothing), so rounds interleave.
  Engine options: max_wait_ms {opts["max_wait_ms"]:g} ({wait_source}); the defaults
  max_queue {opts["max_queue"]}, request_timeout_s {opts["request_timeout_s"]:g}.

## Load test (locust)

`{cmds["locust"]}`

{chr(10).join(loc_rows)}{errors}

Locust's own figures (bench/locustfile.py writes them from its stats at the end: locust
rounds response times to whole ms below 100 ms, and its requests/s is all requests over
first to last request), {setup.locust_users} users spawned at once, no think time, exactly
{setup.locust_requests} requests (locust {info.get("locust", "?")} has no `--iterations`:
the locustfile counts and quits), against the --max-batch {setup.max_batch} server after
the rounds above; locust exit code {loc["exit_code"]}, {loc["wall_s"]:.1f} s with start-up.

## Setup

- Model: {model["class"]}, {model["parameters"]:,} parameters, hidden {model["hidden"]},
  {model["layers"]} layers, {model["heads"]} heads, MLP {model["intermediate"]}, vocabulary
  {model["vocab"]}, {model["dtype"]} on CPU; {model["source"]}.
- Prompts: `kubellm.data.synthetic.arithmetic_records` (seed {setup.seed + 1}), e.g.
  {cmds["example_prompt"]}; max_tokens {setup.max_tokens}, greedy.
- Threads: {setup.threads} torch thread(s) on both sides: `torch.set_num_threads` in this
  process, `OMP_NUM_THREADS={setup.threads}` (and MKL_NUM_THREADS) in each server process
  (the server has no threads flag; torch reads the variable at start-up).
- Servers: `{cmds["server"]}` (and `--max-batch 1`), started by the bench on free ports,
  ready in {cmds["ready"]}.

| machine | |
|---|---|
{machine}
"""
    return table, md


def agreement(blocks: list[Block], a: str, b: str) -> tuple[int, int]:
    """How many prompts contender `a` answered as `b` did (first round of each)."""
    first = {x.contender: x.answers for x in blocks if x.round == 0}
    common = sorted(set(first[a]) & set(first[b]))
    return sum(first[a][p] == first[b][p] for p in common), len(common)


def loadavg() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


# --- the command line -----------------------------------------------------------------------

FULL = {
    "rounds": 3,
    "requests": 200,
    "throughput_requests": 480,
    "warmup": 10,
}
QUICK = {
    "rounds": 1,
    "requests": 30,
    "throughput_requests": 96,
    "warmup": 3,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default="docs/benchmarks-serve.md", help="markdown report")
    ap.add_argument("--json", default="", help="also write the figures as JSON here")
    ap.add_argument("--model-dir", default="", help="serve this model (default: build one)")
    ap.add_argument("--requests", type=int, help="sequential latency requests per contender")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 3; quick 1)")
    ap.add_argument("--throughput-requests", type=int, help="requests per throughput block")
    ap.add_argument("--warmup", type=int, help="warm-up requests before each timed block")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients")
    ap.add_argument("--max-batch", type=int, default=16, help="the batched server's --max-batch")
    ap.add_argument(
        "--max-wait-ms",
        type=float,
        help="the servers' --max-wait-ms, and the in-process engine's (default: the server's)",
    )
    ap.add_argument("--max-tokens", type=int, default=8, help="max_tokens of every request")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    ap.add_argument("--locust-requests", type=int, default=200, help="locust's request count")
    ap.add_argument("--locust-users", type=int, default=16, help="locust's users")
    ap.add_argument("--seed", type=int, default=0, help="model init; prompts use seed + 1")
    ap.add_argument("--cache-dir", default="runs/bench", help="model cache and scratch")
    ap.add_argument("--ready-timeout", type=float, default=180.0, help="server start-up, s")
    ap.add_argument("--quick", action="store_true", help="1 round, few requests (the test)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.requests, args.rounds, args.throughput_requests, args.clients) < 1:
        ap.error("--requests, --rounds, --throughput-requests and --clients must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench_cmd = shlex.join(
        ["python", "-m", "bench.serve_bench", *(sys.argv[1:] if argv is None else argv)]
    )
    setup = Setup.from_args(args)
    t_start = time.perf_counter()
    cache = Path(args.cache_dir).resolve()
    if args.model_dir:
        model_dir = Path(args.model_dir).resolve()
        source = f"the trained model in {args.model_dir}"
    else:
        model_dir = ensure_model(cache, setup.seed)
        source = (
            "untrained (seeded init), the `make run` shape, built by the bench and cached in "
            f"{args.cache_dir}/{model_dir.name}"
        )
    prompts = bench_prompts(max(setup.requests, 64), setup.seed)
    work = Path(tempfile.mkdtemp(dir=cache, prefix="serve-"))
    info = machine_info(PACKAGES)
    info["torch threads"] = str(setup.threads)
    load_start = loadavg()

    servers: dict[int, Server] = {}
    bare: Server | None = None
    inproc: InProcess | None = None
    try:
        for mb in sorted({setup.max_batch, 1}):
            servers[mb] = start_server(model_dir, mb, setup, work)
        bare = start_server(model_dir, setup.max_batch, setup, work, bare=True)
        inproc = InProcess(model_dir, setup)  # loads while the servers start
        model = describe_model(inproc.model, model_dir) | {"source": source}
        ready = {mb: wait_ready(s, args.ready_timeout) for mb, s in servers.items()}
        wait_ready(bare, args.ready_timeout)
        print(
            f"model: {model['parameters']:,} parameters; servers ready "
            + ", ".join(f"--max-batch {mb} in {t:.1f} s" for mb, t in ready.items()),
            flush=True,
        )
        lat_blocks = measure_latency(setup, inproc, servers[setup.max_batch], bare, prompts)
        inproc.close()
        inproc = None
        stop_server(bare)
        thr_blocks = measure_throughput(setup, servers, prompts)
        loc = run_locust(servers[setup.max_batch], setup, prompts, work)
        print(f"locust: {json.dumps(loc['total'])}", flush=True)
    finally:
        if inproc is not None:
            inproc.close()
        stop_server(*servers.values(), *([bare] if bare is not None else []))
    load_end = loadavg()

    lat = latency_figures(lat_blocks)
    thr = throughput_figures(thr_blocks)
    rat = ratios(lat, thr, loc, setup)
    agree = {
        "openai_vs_engine": agreement(lat_blocks, "server_openai", "engine"),
        "bare_vs_engine": agreement(lat_blocks, "bare_openai", "engine"),
        "v1_vs_complete": agreement(lat_blocks, "server_v1", "complete"),
    }
    cmds = {
        "bench": bench_cmd,
        "server": shlex.join(
            [
                "python",
                *server_command(Path("MODEL_DIR"), 8080, setup.max_batch, setup.max_wait_ms)[1:],
            ]
        ).replace("8080", "PORT"),
        "locust": shlex.join([".venv/bin/locust", *loc["command"][1:]])
        .replace(str(work), "SCRATCH")
        .replace(f"{HOST}:{servers[setup.max_batch].port}", f"{HOST}:PORT"),
        "ready": ", ".join(f"--max-batch {mb}: {t:.1f} s" for mb, t in ready.items()),
        "example_prompt": ", ".join(f"`{p}`" for p in prompts[:3]),
    }
    table, md = report(setup, lat, thr, loc, rat, info, model, agree, cmds, (load_start, load_end))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    if args.json:
        figures = {
            "setup": dataclasses.asdict(setup),
            "model": model,
            "latency": lat,
            "throughput": thr,
            "locust": {k: v for k, v in loc.items() if k != "command"},
            "ratios": rat,
            "agreement": agree,
        }
        Path(args.json).write_text(json.dumps(figures, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    print()
    print(table)
    print(f"\nwrote {out} ({time.perf_counter() - t_start:.0f} s)")
    ok = all(r["pass"] is not False for r in rat.values())
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    raise SystemExit(main())
