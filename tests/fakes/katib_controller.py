"""The simulated cluster's Katib: kubeflow.org/v1beta1 Experiment and Trial.

A FAKE, for tests only. It follows kubeflow/katib (pkg/controller.v1beta1, pkg/apis,
pkg/metricscollector) and cites the code each behaviour comes from:

- defaults (experiment_defaults.go SetDefault, applied in memory, not written back):
  parallelTrialCount 3; the objective's metricStrategy min/max by objective type, additional
  metrics the same; StdOut metrics collector; for Kubeflow jobs successCondition
  `status.conditions.#(type=="Succeeded")#|#(status=="True")#`, failureCondition the same
  with Failed, primaryPodLabels `training.kubeflow.org/job-role: master`.
- suggestions: Trials named `<experiment>-<8 random chars>` from apimachinery's rand
  alphabet (bcdfghjklmnpqrstvwxz2456789), label `katib.kubeflow.org/experiment`, a
  controller ownerReference to the Experiment, spec.parameterAssignments. Values come from a
  seeded RNG (algorithmSettings `random_state`, else the sim's seed): `random` samples
  uniformly (or log-uniformly for `distribution: logUniform`); `grid` walks the cartesian
  product of evenly spaced values (feasibleSpace.step; int step 1; a list for
  discrete/categorical) in order; every other algorithm (tpe, bayesianoptimization, cmaes,
  ...) is random in the sim. New trials are created while active < parallelTrialCount and
  trials < maxTrialCount. earlyStopping (medianstop) is not simulated: trials run to the end.
- the trial's job (manifest/generator.go, trial_controller.go reconcileJob): the trialSpec
  with `${trialParameters.X}` replaced by the value of the parameter X's trialParameter
  references (and `${trialSpec.Name}`/`Namespace`), metadata name = the trial name, created
  through the API server's validation (`create_object`) with an ownerReference to the Trial.
  When the trial completes and retainRun is false, Katib deletes the job (Foreground), pods
  and logs with it.
- trial status (trial_controller_util.go UpdateTrialStatusCondition): Created "Trial is
  created" (TrialCreated); Running "Trial is running" (TrialRunning) once the job exists;
  the job's status matched against failureCondition then successCondition (the gjson forms
  above are what the sim evaluates); Failed: reason `TrialFailed. Job reason: <job reason>`,
  message `Trial has failed. Job message: <job message>`; Succeeded likewise
  (`TrialSucceeded. Job reason: ...`) when the objective metric was observed; when the
  objective never appeared in the log: MetricsUnavailable (`MetricsUnavailable. Job reason:
  ...`, "Metrics are not available. Job message: ..."). Running turns False at the end.
- metrics (the StdOut collector, file-metricscollector.go with common.DefaultFilter
  `([\\w|-]+)\\s*=\\s*([+-]?\\d*(\\.\\d+)?([Ee][+-]?\\d+)?)`): the log of the pod matching
  primaryPodLabels (and the job-name label) is parsed when the job succeeds; every
  `name=value` of the objective or an additional metric counts; observation.metrics
  [{name, min, max, latest}] (getMetrics: "unavailable" when never reported). The collector
  sidecar is injected only in namespaces labelled `katib.kubeflow.org/metrics-collector-
  injection: enabled` (sim.namespace_labels, which has it by default): without it nothing
  is ever reported, and, as in trial_controller.go ("metrics are not reported, reconcile
  requeued"), the trial stays Running and the experiment never finishes.
- experiment status (experiment/util/status_util.go): Created "Experiment is created"
  (ExperimentCreated), Running "Experiment is running" (ExperimentRunning), then Succeeded
  (ExperimentGoalReached "Experiment has succeeded because Objective goal has reached",
  ExperimentMaxTrialsReached "Experiment has succeeded because max trial count has reached")
  or Failed (ExperimentFailed "Experiment has failed because max failed count has reached",
  counting Failed and MetricsUnavailable trials); Running turns False. trials,
  trialsSucceeded/Failed/Running/Pending/Killed/EarlyStopped, trialMetricsUnavailable,
  the trial name lists, currentOptimalTrial {bestTrialName, parameterAssignments,
  observation} by the objective's strategy value, startTime, completionTime. Trials still
  running when the experiment completes are left to finish.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import random
import re
from collections.abc import Iterable
from typing import Any

from .fake_k8s import ApiError, Event, owner_reference
from .sim_base import Controller, Key, find_condition, is_true, new_condition, now_rfc3339

EXPERIMENT_LABEL = "katib.kubeflow.org/experiment"
INJECTION_LABEL = "katib.kubeflow.org/metrics-collector-injection"
DEFAULT_FILTER = r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)"
SUCCESS = 'status.conditions.#(type=="Succeeded")#|#(status=="True")#'
FAILURE = 'status.conditions.#(type=="Failed")#|#(status=="True")#'
PRIMARY_POD_LABELS = {"training.kubeflow.org/job-role": "master"}
UNAVAILABLE = "unavailable"
RAND_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand
# updateTrialsSummary's order: the first condition a trial has decides its list.
_KINDS = {
    "killed": "Killed",
    "failed": "Failed",
    "succeeded": "Succeeded",
    "earlyStopped": "EarlyStopped",
    "running": "Running",
    "metricsUnavailable": "MetricsUnavailable",
}
_COMPLETED = ("Succeeded", "Failed", "Killed", "EarlyStopped", "MetricsUnavailable")
_GJSON = re.compile(r'#\((\w+)=="([^"]*)"\)#')


def set_condition(status: dict[str, Any], ctype: str, cstatus: str, reason: str, msg: str) -> None:
    """Katib's setCondition: unchanged status+reason is a no-op; else replace, at the end."""
    new = new_condition(status, ctype, cstatus, reason, msg)
    if new is None:
        return
    status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != ctype] + [
        new
    ]


def mark_final(status: dict[str, Any], ctype: str, reason: str, msg: str) -> None:
    """Mark*Succeeded/Failed/MetricsUnavailable: Running turns False first."""
    running = find_condition(status, "Running")
    if running:
        set_condition(
            status, "Running", "False", running.get("reason", ""), running.get("message", "")
        )
    set_condition(status, ctype, "True", reason, msg)


def gjson_conditions(job: dict[str, Any], expr: str) -> list[dict[str, Any]]:
    """The job conditions `expr` selects; the sim knows Katib's default gjson form."""
    if not expr.startswith("status.conditions."):
        raise ValueError(f"the sim cannot evaluate the condition {expr!r}")
    out = list((job.get("status") or {}).get("conditions") or [])
    for field, value in _GJSON.findall(expr):
        out = [c for c in out if str(c.get(field)) == value]
    return out


def with_defaults(experiment: dict[str, Any]) -> dict[str, Any]:
    """experiment_defaults.go SetDefault, on a copy."""
    spec = copy.deepcopy(experiment.get("spec") or {})
    spec.setdefault("parallelTrialCount", 3)
    objective = spec.setdefault("objective", {})
    strategies = objective.setdefault("metricStrategies", [])
    by = {"minimize": "min", "maximize": "max"}.get(objective.get("type", ""), "latest")
    named = {s.get("name") for s in strategies}
    for metric in [
        objective.get("objectiveMetricName"),
        *objective.get("additionalMetricNames", []),
    ]:
        if metric not in named:
            strategies.append({"name": metric, "value": by})
    spec.setdefault("metricsCollectorSpec", {}).setdefault("collector", {"kind": "StdOut"})
    template = spec.setdefault("trialTemplate", {})
    template.setdefault("successCondition", SUCCESS)
    template.setdefault("failureCondition", FAILURE)
    if not template.get("primaryPodLabels"):
        template["primaryPodLabels"] = dict(PRIMARY_POD_LABELS)
    return spec


def parse_metrics(log: str, names: list[str]) -> dict[str, list[str]]:
    """Every value the StdOut collector would report, in order, per metric name."""
    out: dict[str, list[str]] = {n: [] for n in names}
    pattern = re.compile(DEFAULT_FILTER)
    for line in log.splitlines():
        for m in pattern.finditer(line):
            name, value = m.group(1), m.group(2)
            if name in out and value not in ("", "+", "-"):
                out[name].append(value)
    return out


def observation(values: dict[str, list[str]]) -> dict[str, Any]:
    """trial_controller_util.go getMetrics."""
    metrics = []
    for name, seen in values.items():
        m = {"name": name, "min": UNAVAILABLE, "max": UNAVAILABLE, "latest": UNAVAILABLE}
        for v in seen:
            f = float(v)
            if m["min"] == UNAVAILABLE:
                m["min"] = m["max"] = v
            elif f < float(m["min"]):
                m["min"] = v
            elif f > float(m["max"]):
                m["max"] = v
            m["latest"] = v
        metrics.append(m)
    return {"metrics": metrics}


def objective_value(trial: dict[str, Any]) -> str:
    """status_util.go getObjectiveMetricValue."""
    spec = trial.get("spec") or {}
    objective = spec.get("objective") or {}
    name = objective.get("objectiveMetricName")
    strategy = next(
        (s.get("value") for s in objective.get("metricStrategies") or [] if s.get("name") == name),
        "latest",
    )
    for m in ((trial.get("status") or {}).get("observation") or {}).get("metrics") or []:
        if m.get("name") == name:
            if strategy in ("min", "max") and m.get(strategy) != UNAVAILABLE:
                return str(m[strategy])
            return str(m.get("latest", UNAVAILABLE))
    return UNAVAILABLE


class Katib(Controller):
    name = "katib"

    def __init__(self, sim: Any) -> None:
        super().__init__(sim)
        self._rngs: dict[str, random.Random] = {}
        self._grids: dict[str, Any] = {}

    def keys_for(self, event: Event) -> Iterable[Key]:
        if event.type == "DELETED" and event.plural in ("experiments", "trials"):
            return self.owner_key(event, "Experiment")
        if event.plural == "experiments":
            return self.own_key(event, "experiments")
        if event.plural == "trials":
            return self.own_key(event, "trials") + self.owner_key(event, "Experiment")
        if event.plural == "pytorchjobs":
            return self.owner_key(event, "Trial")
        return []

    def reconcile(self, key: Key) -> None:
        if key[0] == "experiments":
            self._experiment(key)
        elif key[0] == "trials":
            self._trial(key)

    # ------------------------------------------------------------ experiments

    def _experiment(self, key: Key) -> None:
        exp = self.get(key)
        if exp is None:
            return
        spec = with_defaults(exp)
        status = copy.deepcopy(exp.get("status") or {})
        before = copy.deepcopy(status)
        if find_condition(status, "Created") is None:
            status["startTime"] = now_rfc3339()
            set_condition(status, "Created", "True", "ExperimentCreated", "Experiment is created")
        trials = sorted(self.owned("trials", exp), key=lambda t: t["metadata"]["creationTimestamp"])
        goal_reached = self._summary(spec, status, trials)
        if not (is_true(status, "Succeeded") or is_true(status, "Failed")):
            self._update_condition(spec, status, goal_reached)
        if not (is_true(status, "Succeeded") or is_true(status, "Failed")):
            active = status.get("trialsPending", 0) + status.get("trialsRunning", 0)
            room = min(
                int(spec["parallelTrialCount"]) - active,
                int(spec.get("maxTrialCount") or 1 << 30) - len(trials),
            )
            for _ in range(max(room, 0)):
                self._create_trial(exp, spec)
        if status != before:
            with contextlib.suppress(ApiError):
                self.fake.set_status("experiments", key[2], status, namespace=key[1])

    def _summary(
        self, spec: dict[str, Any], status: dict[str, Any], trials: list[dict[str, Any]]
    ) -> bool:
        """status_util.go updateTrialsSummary; True when the objective goal is reached."""
        lists: dict[str, list[str]] = {
            k: []
            for k in (
                "killed",
                "failed",
                "succeeded",
                "earlyStopped",
                "running",
                "metricsUnavailable",
                "pending",
            )
        }
        best, best_value = None, 0.0
        objective = spec.get("objective") or {}
        minimize = objective.get("type") == "minimize"
        goal = objective.get("goal")
        reached = False
        for t in trials:
            st = t.get("status") or {}
            kind = next((k for k, c in _KINDS.items() if is_true(st, c)), "pending")
            lists[kind].append(t["metadata"]["name"])
            value = objective_value(t)
            if value == UNAVAILABLE:
                continue
            try:
                v = float(value)
            except ValueError:
                best = t
                continue
            if best is None or (v < best_value if minimize else v > best_value):
                best, best_value = t, v
            if goal is not None and (best_value <= goal if minimize else best_value >= goal):
                reached = True
        status["trials"] = len(trials)
        names = {
            "killed": ("killedTrialList", "trialsKilled"),
            "failed": ("failedTrialList", "trialsFailed"),
            "succeeded": ("succeededTrialList", "trialsSucceeded"),
            "earlyStopped": ("earlyStoppedTrialList", "trialsEarlyStopped"),
            "running": ("runningTrialList", "trialsRunning"),
            "metricsUnavailable": ("metricsUnavailableTrialList", "trialMetricsUnavailable"),
            "pending": ("pendingTrialList", "trialsPending"),
        }
        for kind, (list_name, count_name) in names.items():
            if lists[kind]:
                status[list_name] = lists[kind]
                status[count_name] = len(lists[kind])
            else:
                status.pop(list_name, None)
                status.pop(count_name, None)
        if best is not None:
            status["currentOptimalTrial"] = {
                "bestTrialName": best["metadata"]["name"],
                "parameterAssignments": copy.deepcopy(best["spec"]["parameterAssignments"]),
                "observation": copy.deepcopy((best.get("status") or {}).get("observation") or {}),
            }
        else:
            status.setdefault("currentOptimalTrial", {"bestTrialName": "", "observation": {}})
        return reached

    def _update_condition(self, spec: dict[str, Any], status: dict[str, Any], goal: bool) -> None:
        """status_util.go UpdateExperimentStatusCondition."""
        completed = sum(
            status.get(k, 0)
            for k in (
                "trialsSucceeded",
                "trialsFailed",
                "trialsKilled",
                "trialsEarlyStopped",
                "trialMetricsUnavailable",
            )
        )
        failed = status.get("trialsFailed", 0) + status.get("trialMetricsUnavailable", 0)
        max_failed, max_trials = spec.get("maxFailedTrialCount"), spec.get("maxTrialCount")
        if goal:
            mark_final(
                status,
                "Succeeded",
                "ExperimentGoalReached",
                "Experiment has succeeded because Objective goal has reached",
            )
        elif max_failed is not None and failed != 0 and failed >= max_failed:
            mark_final(
                status,
                "Failed",
                "ExperimentFailed",
                "Experiment has failed because max failed count has reached",
            )
        elif max_trials is not None and completed >= max_trials:
            mark_final(
                status,
                "Succeeded",
                "ExperimentMaxTrialsReached",
                "Experiment has succeeded because max trial count has reached",
            )
        else:
            set_condition(status, "Running", "True", "ExperimentRunning", "Experiment is running")
            return
        status["completionTime"] = now_rfc3339()

    # ------------------------------------------------------------ suggestions

    def _rng(self, exp: dict[str, Any], spec: dict[str, Any]) -> random.Random:
        uid = exp["metadata"]["uid"]
        if uid not in self._rngs:
            settings = {
                s.get("name"): s.get("value")
                for s in (spec.get("algorithm") or {}).get("algorithmSettings") or []
            }
            seed = settings.get("random_state", self.sim.seed)
            self._rngs[uid] = random.Random(f"{seed}")
        return self._rngs[uid]

    def _suggest(self, exp: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, str]] | None:
        rng = self._rng(exp, spec)
        params = spec.get("parameters") or []
        if (spec.get("algorithm") or {}).get("algorithmName") == "grid":
            uid = exp["metadata"]["uid"]
            if uid not in self._grids:
                self._grids[uid] = itertools.product(*(self._grid_values(p) for p in params))
            point = next(self._grids[uid], None)
            if point is None:
                return None
            return [{"name": p["name"], "value": v} for p, v in zip(params, point, strict=True)]
        return [{"name": p["name"], "value": self._sample(p, rng)} for p in params]

    @staticmethod
    def _grid_values(param: dict[str, Any]) -> list[str]:
        fs = param.get("feasibleSpace") or {}
        if param.get("parameterType") in ("discrete", "categorical"):
            return [str(v) for v in fs.get("list") or []]
        if param.get("parameterType") == "int":
            every = int(fs.get("step") or 1)
            return [str(v) for v in range(int(fs["min"]), int(fs["max"]) + 1, every)]
        low, high, step = float(fs["min"]), float(fs["max"]), float(fs["step"])
        n = math.floor((high - low) / step + 1e-9) + 1
        return [str(low + i * step) for i in range(n)]

    @staticmethod
    def _sample(param: dict[str, Any], rng: random.Random) -> str:
        fs = param.get("feasibleSpace") or {}
        ptype = param.get("parameterType")
        if ptype in ("discrete", "categorical"):
            return str(rng.choice(fs["list"]))
        low, high = float(fs["min"]), float(fs["max"])
        if fs.get("distribution") == "logUniform":
            value = math.exp(rng.uniform(math.log(low), math.log(high)))
        else:
            value = rng.uniform(low, high)
        if ptype == "int":
            return str(min(int(high), max(int(low), round(value))))
        return str(value)

    def _create_trial(self, exp: dict[str, Any], spec: dict[str, Any]) -> None:
        assignments = self._suggest(exp, spec)
        if assignments is None:
            return
        meta = exp["metadata"]
        rng = self._rng(exp, spec)
        name = f"{meta['name']}-{''.join(rng.choice(RAND_ALPHABET) for _ in range(8))}"
        template = spec["trialTemplate"]
        values = {a["name"]: a["value"] for a in assignments}
        run_spec = json.dumps(template.get("trialSpec") or {})
        for tp in template.get("trialParameters") or []:
            ref = tp.get("reference", "")
            if ref in values:
                value = values[ref]
            elif m := re.fullmatch(r"\$\{trialSpec\.(Name|Namespace)\}", ref):
                value = name if m[1] == "Name" else meta["namespace"]
            else:
                continue
            run_spec = run_spec.replace(f"${{trialParameters.{tp['name']}}}", value)
        job = json.loads(run_spec)
        job.setdefault("metadata", {}).update(name=name, namespace=meta["namespace"])
        trial = {
            "apiVersion": "kubeflow.org/v1beta1",
            "kind": "Trial",
            "metadata": {
                "name": name,
                "labels": {EXPERIMENT_LABEL: meta["name"]},
                "ownerReferences": [owner_reference(exp)],
            },
            "spec": {
                "objective": copy.deepcopy(spec["objective"]),
                "parameterAssignments": assignments,
                "runSpec": job,
                "metricsCollector": copy.deepcopy(spec["metricsCollectorSpec"]),
                "primaryPodLabels": dict(template["primaryPodLabels"]),
                "primaryContainerName": template.get("primaryContainerName", ""),
                "successCondition": template["successCondition"],
                "failureCondition": template["failureCondition"],
                **({"retainRun": True} if template.get("retain") else {}),
            },
        }
        try:
            self.fake.create_object("trials", trial, meta["namespace"])
        except ApiError as e:
            self.sim.errors.append(f"{self.name}: creating trial {name}: {e}")

    # ------------------------------------------------------------ trials

    def _trial(self, key: Key) -> None:
        trial = self.get(key)
        if trial is None:
            return
        status = copy.deepcopy(trial.get("status") or {})
        before = copy.deepcopy(status)
        spec = trial.get("spec") or {}
        completed = any(
            is_true(status, c)
            for c in ("Succeeded", "Failed", "Killed", "EarlyStopped", "MetricsUnavailable")
        )
        ns, name = key[1], key[2]
        job = self.fake.get_object("pytorchjobs", name, ns)
        if find_condition(status, "Created") is None:
            status["startTime"] = now_rfc3339()
            set_condition(status, "Created", "True", "TrialCreated", "Trial is created")
        elif job is None and not completed:
            body = copy.deepcopy(spec["runSpec"])
            body["metadata"]["ownerReferences"] = [owner_reference(trial)]
            try:
                job = self.fake.create_object("pytorchjobs", body, ns)
            except ApiError as e:
                self.sim.errors.append(f"{self.name}: trial {name} job: {e}")
                return
        elif job is not None and completed and not spec.get("retainRun"):
            with contextlib.suppress(ApiError):
                self.fake.delete_object("pytorchjobs", name, ns, propagation="Foreground")
            return
        if job is not None and not completed:
            self._job_status(trial, job, status)
        if status != before:
            with contextlib.suppress(ApiError):
                self.fake.set_status("trials", name, status, namespace=ns)

    def _job_status(
        self, trial: dict[str, Any], job: dict[str, Any], status: dict[str, Any]
    ) -> None:
        """trial_controller.go reconcileTrial + UpdateTrialStatusCondition."""
        spec = trial["spec"]
        failed = gjson_conditions(job, spec["failureCondition"])
        succeeded = [] if failed else gjson_conditions(job, spec["successCondition"])
        cond = (failed or succeeded or [{}])[0]
        reason = f". Job reason: {cond['reason']}" if cond.get("reason") else ""
        message = f". Job message: {cond['message']}" if cond.get("message") else ""
        if failed:
            mark_final(status, "Failed", f"TrialFailed{reason}", f"Trial has failed{message}")
            status["completionTime"] = now_rfc3339()
        elif succeeded:
            observed = self._collect(trial, job)
            if observed is None:  # no collector sidecar: nothing ever reported
                return
            status["observation"] = observed
            name = spec["objective"]["objectiveMetricName"]
            if any(m["name"] == name and m["latest"] != UNAVAILABLE for m in observed["metrics"]):
                mark_final(
                    status, "Succeeded", f"TrialSucceeded{reason}", f"Trial has succeeded{message}"
                )
            else:
                mark_final(
                    status,
                    "MetricsUnavailable",
                    f"MetricsUnavailable{reason}",
                    f"Metrics are not available{message}",
                )
            status["completionTime"] = now_rfc3339()
        elif find_condition(status, "Running") is None:
            set_condition(status, "Running", "True", "TrialRunning", "Trial is running")

    def _collect(self, trial: dict[str, Any], job: dict[str, Any]) -> dict[str, Any] | None:
        ns = trial["metadata"]["namespace"]
        if self.sim.namespace_labels[ns].get(INJECTION_LABEL) != "enabled":
            return None
        spec = trial["spec"]
        wanted = {
            **spec.get("primaryPodLabels", {}),
            "training.kubeflow.org/job-name": job["metadata"]["name"],
        }
        pods = [
            p
            for p in self.fake.list_objects("pods", ns)
            if all(p["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
        ]
        names = [s["name"] for s in spec["objective"].get("metricStrategies") or []]
        log = "".join(self.fake.pod_log(ns, p["metadata"]["name"]) for p in pods)
        return observation(parse_metrics(log, names))
