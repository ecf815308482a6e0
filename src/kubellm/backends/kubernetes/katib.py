"""Tune with a Katib v1beta1 Experiment whose trials are the trainer's PyTorchJobs.

Each trial is `build_pytorchjob(request.trial_job)` with one `--set name=${trialParameters.name}`
per search parameter; Katib substitutes the values and reads the objective from the
`name=value` lines the trainer prints (its StdOut collector), so a trial is exactly a
training run with overrides, as with the local optuna tuner.

Example (a cluster with Katib and the Training Operator):

    KatibTuner().tune(TuneRequest(name="llm-tune", max_trials=8, parallel_trials=2,
        trial_job=TrainJob(name="trial", image="ghcr.io/org/kubellm-trainer:1",
                           train_args=["--config", "/workspace/run/train.json"]),
        space=[SearchParam("learning_rate", 1e-4, 1e-2, log=True)]))
"""

from __future__ import annotations

import dataclasses
import math
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
from kubernetes import client as k8s

from kubellm.backends.base import KATIB_NAME_MAX, JobFailed, Tuner, TuneRequest, dns_name
from kubellm.backends.kubernetes.client import (
    CustomResource,
    KubeClient,
    condition_is_true,
    find_condition,
)
from kubellm.backends.kubernetes.podspec import ClusterSettings
from kubellm.backends.kubernetes.pytorchjob import (
    CONTAINER,
    MASTER_ROLE_LABELS,
    pytorchjob_manifest,
)
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


class KatibTuner(Tuner):
    """Tuner on a cluster: one Experiment (the request's algorithm, seeded), trials as the
    trainer's PyTorchJobs with the run's `cluster` settings."""

    def __init__(
        self,
        api_client: k8s.ApiClient | None = None,
        *,
        cluster: ClusterSettings | None = None,
        poll_interval_s: float = 10.0,
        request_timeout_s: float = 30.0,
    ) -> None:
        self.kube = KubeClient(api_client, poll_interval_s, request_timeout_s)
        self.cluster = cluster or ClusterSettings()

    def tune(self, request: TuneRequest) -> TuneResult:
        body = build_experiment(request, self.cluster)
        name, ns = body["metadata"]["name"], request.trial_job.namespace
        exp = self.kube.run(
            EXPERIMENT,
            ns,
            body,
            timeout_s=request.timeout_s,
            done=lambda obj: condition_is_true(obj, "Succeeded"),
        ).obj
        optimal = (exp.get("status") or {}).get("currentOptimalTrial") or {}
        best_trial = optimal.get("bestTrialName") or ""
        best_value = _metric(optimal.get("observation"), request.objective)
        if not best_trial or best_value is None:
            reason = (find_condition(exp, "Succeeded") or {}).get("reason", "")
            raise JobFailed(
                f"experiment/{name} in {ns} finished ({reason}) without a trial that "
                f"reported {request.objective}; check the trials' logs for metric lines"
            )
        return TuneResult(
            best_params=_assignments(optimal.get("parameterAssignments")),
            best_value=best_value,
            best_trial=best_trial,
            trials=self._trials(ns, name, request.objective),
        )

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
