"""A task runner for the KFP runtime fake (`python -m fakes.kfp_runtime --run-subprocess
e2e.stop_runner:run ...`): every task's process runs under Argo's emissary semantics
(tests/fakes/emissary.py), and the `train` task is stopped as KFP's terminate stops a run
(SIGTERM to the step's process group; SIGKILL as soon as the launcher has exited) once its
PyTorchJob's master pod is Running: a run stopped mid-training. kfp.local then fails the
task and runs the exit handler, as Argo does (exit handlers are exempt from the deadline).

It is kfp.local's own `run_local_subprocess` (kfp/local/subprocess_task_handler.py) with the
emissary in between: the same output to stdout, the same return code (143 for the stopped
task).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config

from fakes.emissary import EmissaryStep

STOP_TASK = "train"
STOP_TIMEOUT_S = 600.0


def _function(full_command: list[str]) -> str:
    if "--function_to_execute" in full_command:
        return full_command[full_command.index("--function_to_execute") + 1]
    return ""


def _training_runs(core: k8s.CoreV1Api, namespace: str) -> bool:
    """Whether the training job's master pod runs (the job exists and trains)."""
    pods = core.list_namespaced_pod(
        namespace, label_selector="training.kubeflow.org/replica-type=master"
    ).items
    return any(
        "-train-" in p.metadata.name and (p.status and p.status.phase == "Running") for p in pods
    )


def _stop_when_training(step: EmissaryStep, namespace: str) -> None:
    cfg = k8s.Configuration()
    k8s_config.load_kube_config(client_configuration=cfg)
    core = k8s.CoreV1Api(k8s.ApiClient(cfg))
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and step.poll() is None:
        if _training_runs(core, namespace):
            time.sleep(1.0)  # a few steps in: mid-training
            print(f"stop-runner: stopping the {STOP_TASK} step (KFP terminate)", flush=True)
            step.stop()
            return
        time.sleep(0.2)


def run(full_command: list[str], env_vars: dict[str, str] | None = None) -> int:
    env: dict[str, Any] = {**os.environ, **(env_vars or {})}
    step = EmissaryStep(full_command, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT).start()
    watcher = None
    if _function(full_command) == STOP_TASK:
        namespace = env.get("KUBELLM_TEST_NAMESPACE", "kubellm")
        watcher = threading.Thread(target=_stop_when_training, args=(step, namespace))
        watcher.start()
    assert step.proc is not None and step.proc.stdout is not None
    for line in iter(step.proc.stdout.readline, b""):
        sys.stdout.write(line.decode("utf-8", "replace"))
        sys.stdout.flush()
    code = step.wait()
    if watcher is not None:
        watcher.join()
    return code
