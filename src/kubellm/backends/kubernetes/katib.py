"""Tune with a Katib v1beta1 Experiment whose trials are the trainer's PyTorchJobs.

Each trial is `build_pytorchjob(request.trial_job)` with one `--set name=${trialParameters.name}`
per search parameter; Katib substitutes the values and reads the objective from the
`name=value` lines the trainer prints (its StdOut collector), so a trial is exactly a
training run with overrides, as with the local optuna tuner.

Katib's pod webhook rewrites the master pod's training container for its StdOut collector
(pkg/webhook/v1beta1/pod/utils.go wrapWorkerContainer, v0.19.0): `sh -c "<command> 1>
/var/log/katib/metrics.log 2>&1 && echo completed > /var/log/katib/$$$$.pid"` with
`shareProcessNamespace: true`. Two things follow, and each trial container is built for them:

- Its stdout, `kubectl logs` of the container, is empty: the output goes to the metrics
  file (and, line by line, to the log of the sidecar `metrics-logger-and-collector`), and
  Katib deletes the trial's job, pods and logs when the trial ends. So the agent also
  appends its output, and its workers', to `<workspace>/katib/<experiment>/<pod>.log` on the
  workspace PVC (KUBELLM_LOG_DIR; train/agent.py), and `tune` prints the last lines of each
  failed trial's files.
- On pod deletion the kubelet's SIGTERM reaches that `sh` only (the container's main
  process), which dies of it, and the runtime then SIGKILLs the rest of the container
  (containerd's shim, shared PID namespace): the trainer would get no chance to checkpoint.
  So the container runs its own `sh -c` (TRIAL_SHELL): Katib keeps a command that starts
  with `sh -c` and appends its redirection to it, and this shell traps SIGTERM, forwards it
  to the agent and waits for the agent's checkpoint and exit (within the pod's
  terminationGracePeriodSeconds).

Example (a cluster with Katib and the Training Operator):

    KatibTuner().tune(TuneRequest(name="llm-tune", max_trials=8, parallel_trials=2,
        trial_job=TrainJob(name="trial", image="ghcr.io/org/kubellm-trainer:1",
                           train_args=["--config", "/workspace/run/train.json"]),
        space=[SearchParam("learning_rate", 1e-4, 1e-2, log=True)]))
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from pathlib import Path
from typing import Any

from kubeflow_katib_api.models import (
    IoK8sApimachineryPkgApisMetaV1ObjectMeta,
    V1beta1AlgorithmSetting,
    V1beta1AlgorithmSpec,
    V1beta1CollectorSpec,
    V1beta1EarlyStoppingSpec,
    V1beta1Experiment,
    V1beta1ExperimentSpec,
    V1beta1FeasibleSpace,
    V1beta1MetricsCollectorSpec,
    V1beta1MetricStrategy,
    V1beta1ObjectiveSpec,
    V1beta1ParameterSpec,
    V1beta1TrialParameterSpec,
    V1beta1TrialTemplate,
)

from kubellm.backends.base import (
    KATIB_NAME_MAX,
    JobFailed,
    Tuner,
    TuneRequest,
    dns_name,
    workspace_mount,
)
from kubellm.backends.kubernetes.client import (
    CustomResource,
    OnCluster,
    condition_is_true,
    find_condition,
)
from kubellm.backends.kubernetes.podspec import ClusterSettings
from kubellm.backends.kubernetes.pytorchjob import (
    CONTAINER,
    MASTER_ROLE_LABELS,
    pytorchjob_manifest,
)
from kubellm.train.tee import LOG_DIR_ENV, POD_NAME_ENV
from kubellm.tune.search import (
    SearchParam,
    Trial,
    TuneResult,
    grid_points,
    grid_step,
    trial_args,
)

# Katib serves its kinds under kubeflow.org (not katib.kubeflow.org, which is its label prefix).
EXPERIMENT = CustomResource("kubeflow.org", "v1beta1", "experiments", "Experiment")
TRIAL = CustomResource("kubeflow.org", "v1beta1", "trials", "Trial")
EXPERIMENT_LABEL = "katib.kubeflow.org/experiment"
# GJSON conditions on the trial's PyTorchJob (Katib's documented values for Kubeflow jobs).
SUCCESS_CONDITION = 'status.conditions.#(type=="Succeeded")#|#(status=="True")#'
FAILURE_CONDITION = 'status.conditions.#(type=="Failed")#|#(status=="True")#'
# Katib's collector sidecar: under its StdOut collector the trial's output is in this
# container's log (it prints each line of the metrics file), not in the training container's.
COLLECTOR_CONTAINER = "metrics-logger-and-collector"
LOG_TAIL_LINES = 20
# The trial container's shell: `kubellm_trial CMD ARGS...` runs CMD in the background, and a
# SIGTERM to this shell (the kubelet's, to the container's main process) is passed on to it;
# `wait` returns early (>128) when the trap runs, so it waits again for CMD's own exit status.
# A SIGTERM that comes before CMD starts is passed on as soon as it has. No `$(` and no `$$`:
# the kubelet expands those in a container's command.
TRIAL_SHELL = (
    "kubellm_trial() { pid=; stop=; "
    'trap \'stop=1; [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null\' TERM; '
    '"$@" & pid=$!; [ -n "$stop" ] && kill -TERM "$pid" 2>/dev/null; '
    'wait "$pid"; code=$?; '
    'while [ "$code" -gt 128 ] && kill -0 "$pid" 2>/dev/null; do wait "$pid"; code=$?; done; '
    'return "$code"; }; kubellm_trial'
)


def trial_log_dir(experiment: str) -> Path:
    """Where the trials of `experiment` write their output on the workspace PVC: one
    `<pod>.log` per trial pod (the same path in the step's pod and the trials')."""
    return Path(workspace_mount()) / "katib" / experiment


def wrap_trial_container(container: dict[str, Any], log_dir: Path | None) -> None:
    """Run the container's command under TRIAL_SHELL, in place, and (with a workspace)
    have the agent copy its output to `log_dir` (see the module docstring)."""
    argv = [*(container.pop("command", None) or []), *(container.pop("args", None) or [])]
    container["command"] = ["sh", "-c"]
    container["args"] = [f"{TRIAL_SHELL} {shlex.join(argv)}"]
    if log_dir is not None:
        container.setdefault("env", []).extend(
            [
                {"name": LOG_DIR_ENV, "value": str(log_dir)},
                {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            ]
        )


def placeholder(param: str) -> str:
    """What Katib replaces with a trial's value of `param`."""
    return "${trialParameters." + param + "}"


def placeholder_args(request: TuneRequest) -> list[str]:
    """The trial's trainer arguments with a Katib placeholder for each parameter's value.

    Built the way every tuner builds them (`trial_args` owns the `--set name=value` format),
    then each value is swapped for its placeholder: only the value is ours to choose.
    """
    base = request.trial_job.train_args
    names = {p.name for p in request.space}
    probe = trial_args(base, {p.name: 0.0 for p in request.space}, request.space)
    out, tail = list(base), probe[len(base) :]
    for flag, assignment in zip(tail[::2], tail[1::2], strict=True):
        key = assignment.split("=", 1)[0]
        out += [flag, f"{key}={placeholder(key)}" if key in names else assignment]
    return out


# Katib's suggestion services and the settings each accepts: hyperopt (random, tpe) and
# scikit-optimize (bayesianoptimization) take `random_state`; grid takes none and needs a
# `step` on every double parameter (its ValidateAlgorithmSettings: "param ... step is nil").
_SEEDED = {"random", "tpe", "bayesianoptimization"}


def build_experiment(
    request: TuneRequest, cluster: ClusterSettings | None = None
) -> dict[str, Any]:
    """The Experiment body for `request` (the trial PyTorchJob embedded as trialSpec)."""
    if not request.space:
        raise ValueError(f"TuneRequest {request.name!r}: the search space is empty")
    if request.max_trials < 1:
        raise ValueError(f"TuneRequest {request.name!r}: max_trials must be >= 1")
    # Katib's webhook: ^[a-z]([-a-z0-9]*[a-z0-9])?$ and at most 40 characters.
    name = dns_name(request.name, max_len=KATIB_NAME_MAX)
    cluster = cluster or ClusterSettings()
    trial_job = dataclasses.replace(request.trial_job, train_args=placeholder_args(request))
    trial_spec = pytorchjob_manifest(trial_job, cluster)
    # Katib names each trial's job after the trial and puts it in the Experiment's namespace.
    trial_spec["metadata"] = {"labels": trial_spec["metadata"]["labels"]}
    log_dir = trial_log_dir(name) if trial_job.workspace_pvc else None
    for replica in trial_spec["spec"]["pytorchReplicaSpecs"].values():
        for container in replica["template"]["spec"]["containers"]:
            if container["name"] == CONTAINER:
                wrap_trial_container(container, log_dir)

    max_failed = request.max_failed_trials
    if max_failed is None:
        max_failed = request.max_trials - 1  # fail only if no trial can succeed
    # Katib rejects counts above maxTrialCount; more would never be used anyway.
    max_failed = min(max_failed, request.max_trials)
    parallel = max(1, min(request.parallel_trials, request.max_trials))
    settings = (
        [V1beta1AlgorithmSetting(name="random_state", value=str(request.seed))]
        if request.algorithm in _SEEDED
        else None
    )
    grid = request.algorithm == "grid"
    points = grid_points(request.max_trials, len(request.space)) if grid else 0
    early = (
        V1beta1EarlyStoppingSpec(algorithm_name="medianstop") if request.early_stopping else None
    )
    experiment = V1beta1Experiment(
        api_version=EXPERIMENT.api_version,
        kind=EXPERIMENT.kind,
        metadata=IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            name=name, namespace=request.trial_job.namespace, labels=cluster.labels()
        ),
        spec=V1beta1ExperimentSpec(
            objective=V1beta1ObjectiveSpec(
                type=request.goal,
                objective_metric_name=request.objective,
                # The last reported value, as parse_metrics and the local tuner read it.
                metric_strategies=[V1beta1MetricStrategy(name=request.objective, value="latest")],
            ),
            algorithm=V1beta1AlgorithmSpec(
                algorithm_name=request.algorithm, algorithm_settings=settings
            ),
            early_stopping=early,
            parameters=[_parameter(p, points) for p in request.space],
            max_trial_count=request.max_trials,
            parallel_trial_count=parallel,
            max_failed_trial_count=max_failed,
            metrics_collector_spec=V1beta1MetricsCollectorSpec(
                collector=V1beta1CollectorSpec(kind="StdOut")
            ),
            trial_template=V1beta1TrialTemplate(
                primary_container_name=CONTAINER,
                # Only the master's output carries the metrics; wrap only its pod.
                primary_pod_labels=MASTER_ROLE_LABELS,
                success_condition=SUCCESS_CONDITION,
                failure_condition=FAILURE_CONDITION,
                trial_parameters=[
                    V1beta1TrialParameterSpec(
                        name=p.name, reference=p.name, description=f"--set {p.name}=<value>"
                    )
                    for p in request.space
                ],
                trial_spec=trial_spec,
            ),
        ),
    )
    out: dict[str, Any] = experiment.to_dict()
    return out


def _parameter(p: SearchParam, grid_points: int = 0) -> V1beta1ParameterSpec:
    if not p.low < p.high:
        raise ValueError(f"search parameter {p.name!r}: low {p.low} must be below high {p.high}")
    step = None
    if p.kind == "int":
        low, high = str(int(p.low)), str(int(p.high))
        if grid_points:
            step = str(int(grid_step(p, grid_points)))
    else:
        low, high = repr(float(p.low)), repr(float(p.high))
        if grid_points:
            step = repr(grid_step(p, grid_points))
    log = p.log and not grid_points
    return V1beta1ParameterSpec(
        name=p.name,
        parameter_type=p.kind,
        feasible_space=V1beta1FeasibleSpace(
            min=low, max=high, step=step, distribution="logUniform" if log else "uniform"
        ),
    )


class KatibTuner(OnCluster, Tuner):
    """Tuner on a cluster: one Experiment (the request's algorithm, seeded), trials as the
    trainer's PyTorchJobs with the run's `cluster` settings."""

    def tune(self, request: TuneRequest) -> TuneResult:
        body = build_experiment(request, self.cluster)
        name, ns = body["metadata"]["name"], request.trial_job.namespace
        log_dir = trial_log_dir(name) if request.trial_job.workspace_pvc else None
        try:
            exp = self.kube.run(
                EXPERIMENT,
                ns,
                body,
                timeout_s=request.timeout_s,
                done=lambda obj: condition_is_true(obj, "Succeeded"),
            ).obj
        except JobFailed:
            self._print_failed_trials(ns, name, log_dir)
            raise
        self._print_failed_trials(ns, name, log_dir)
        optimal = (exp.get("status") or {}).get("currentOptimalTrial") or {}
        best_trial = optimal.get("bestTrialName") or ""
        best_value = _metric(optimal.get("observation"), request.objective)
        if not best_trial or best_value is None:
            reason = (find_condition(exp, "Succeeded") or {}).get("reason", "")
            raise JobFailed(
                f"experiment/{name} in {ns} finished ({reason}) without a trial that "
                f"reported {request.objective}; {where_trial_output_is(log_dir)}"
            )
        return TuneResult(
            best_params=_assignments(optimal.get("parameterAssignments")),
            best_value=best_value,
            best_trial=best_trial,
            trials=self._trials(ns, name, request.objective),
        )

    def _print_failed_trials(self, ns: str, experiment: str, log_dir: Path | None) -> None:
        """Each failed trial's reason and the last lines of its pods' output: Katib deletes
        a finished trial's pods and logs, and its training container's log is empty."""
        try:
            trials = self.kube.list(TRIAL, ns, f"{EXPERIMENT_LABEL}={experiment}")
        except Exception:  # best effort: the error being raised, if any, matters more
            return
        for obj in sorted(trials, key=lambda t: t["metadata"]["name"]):
            failed = next(
                (c for c in ("Failed", "MetricsUnavailable") if condition_is_true(obj, c)),
                None,
            )
            if failed is None:
                continue
            trial = obj["metadata"]["name"]
            cond = find_condition(obj, failed) or {}
            print(
                f"trial/{trial} {failed}: {cond.get('reason', '')}: {cond.get('message', '')}",
                flush=True,
            )
            files = sorted(log_dir.glob(f"{trial}-*.log")) if log_dir else []
            for path in files:
                lines = tail_lines(path, LOG_TAIL_LINES)
                print(f"  last {len(lines)} lines of {path}:", flush=True)
                for line in lines:
                    print(f"  | {line}", flush=True)
            if not files:
                print(f"  {where_trial_output_is(log_dir)}", flush=True)

    def _trials(self, ns: str, experiment: str, objective: str) -> list[Trial]:
        out = []
        for obj in self.kube.list(TRIAL, ns, f"{EXPERIMENT_LABEL}={experiment}"):
            status = obj.get("status") or {}
            out.append(
                Trial(
                    name=obj["metadata"]["name"],
                    params=_assignments((obj.get("spec") or {}).get("parameterAssignments")),
                    value=_metric(status.get("observation"), objective),
                    state=_trial_state(obj),
                )
            )
        return sorted(out, key=lambda t: t.name)

    def release(self, run_tag: str, namespace: str) -> list[str]:
        """Delete every Experiment labelled with run `run_tag` (Tuner.release): Katib's
        trials and their jobs are owned by it and go with it."""
        from kubellm.backends.kubernetes.release import delete_run_objects

        return delete_run_objects(self.kube, EXPERIMENT, namespace, run_tag)


def where_trial_output_is(log_dir: Path | None) -> str:
    """Where a person finds a trial's output (its training container's log is empty)."""
    saved = f"each trial pod's output is saved in {log_dir}/<pod>.log; " if log_dir else ""
    return (
        f"{saved}while a trial runs, `kubectl logs <trial>-master-0 -c {COLLECTOR_CONTAINER}` "
        "shows it (Katib's StdOut collector sends the training container's output to its "
        "metrics file, so that container's own log is empty)"
    )


def tail_lines(path: Path, n: int) -> list[str]:
    """The last `n` lines of a file (read from its last 64 KiB)."""
    with path.open("rb") as fh:
        fh.seek(0, 2)
        fh.seek(max(fh.tell() - 65536, 0))
        text = fh.read().decode("utf-8", "replace")
    return text.splitlines()[-n:]


def _trial_state(obj: dict[str, Any]) -> str:
    """succeeded, early-stopped (medianstop), or failed (Failed, MetricsUnavailable, ...)."""
    if condition_is_true(obj, "Succeeded"):
        return "succeeded"
    if condition_is_true(obj, "EarlyStopped"):
        return "early-stopped"
    return "failed"


def _assignments(items: list[dict[str, Any]] | None) -> dict[str, float]:
    return {a["name"]: float(a["value"]) for a in items or []}


def _metric(observation: dict[str, Any] | None, name: str) -> float | None:
    """The latest value of metric `name` (Katib writes "unavailable" when it found none)."""
    for m in (observation or {}).get("metrics") or []:
        if m.get("name") == name:
            try:
                value = float(m.get("latest"))
            except (TypeError, ValueError):
                return None
            return None if math.isnan(value) else value
    return None
