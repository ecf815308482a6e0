"""The simulated cluster's Katib: kubeflow.org/v1beta1 Experiment and Trial.

A FAKE, for tests only. It follows kubeflow/katib (pkg/controller.v1beta1, pkg/apis,
pkg/metricscollector) and cites the code each behaviour comes from:

- defaults (experiment_defaults.go SetDefault, applied in memory, not written back):
  parallelTrialCount 3; resumePolicy Never; the objective's metricStrategy min/max by
  objective type, additional metrics the same; StdOut metrics collector; for Kubeflow jobs
  successCondition `status.conditions.#(type=="Succeeded")#|#(status=="True")#`,
  failureCondition the same with Failed, primaryPodLabels
  `training.kubeflow.org/job-role: master`.
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
- the experiment webhook (pkg/webhook/v1beta1/experiment/validation_webhook.go Handle,
  validator/validator.go ValidateExperiment; registered on Experiment CREATE and UPDATE
  through FakeK8s.on_validate, in every namespace): an Experiment in a namespace without
  `katib.kubeflow.org/metrics-collector-injection: enabled` is refused (400, "Cannot create
  the Experiment ... the namespace lacks label ..."); an edit may change only
  parallelTrialCount, maxTrialCount and maxFailedTrialCount, a changed spec needs
  maxTrialCount above status.trials, and a completed experiment takes no change unless it
  succeeded by max trials with resumePolicy LongRunning or FromVolume. The create-time
  checks are k8s_schemas.katib_semantics (answered 422 with the schema's errors).
- the pod webhook (pkg/webhook/v1beta1/pod/inject_webhook.go Mutate, utils.go; registered
  on pod CREATE through FakeK8s.on_admit, before validation, as mutating admission runs),
  only in namespaces labelled `katib.kubeflow.org/metrics-collector-injection: enabled`
  (the MutatingWebhookConfiguration's namespaceSelector; sim.namespace_labels has it by
  default) and only for pods a Trial owns through their owners (getKatibJob: pod ->
  PyTorchJob -> Trial). Every such pod gets the Trial's labels plus
  `katib.kubeflow.org/trial`, and its primary container (primaryContainerName; none: the
  create is refused, 400) env KATIB_TRIAL_NAME from that label. The primary pod
  (primaryPodLabels), unless the collector is Push, also gets: the sidecar
  `metrics-logger-and-collector` (file-metrics-collector:v0.19.0, args -t -m -o-type -s-db
  -path -format TEXT, resources the config defaults 50m/10Mi/500Mi requests and
  500m/100Mi/5Gi limits), `shareProcessNamespace: true`, the emptyDir `metrics-volume` at
  /var/log/katib on the sidecar and the primary container, and the primary container's
  command rewritten (wrapWorkerContainer) to `sh -c "<command and args joined by spaces,
  unquoted> 1>/var/log/katib/metrics.log 2>&1 && echo completed > /var/log/katib/$$$$.pid"`
  (a command that already starts `sh -c`/`bash -c` keeps it and gets the rest appended;
  with earlyStoppingRules the `|| if test -f ...` branch goes before the `&&`). The kubelet
  turns `$$$$` into `$$`, which sh expands to its own pid. So the primary container's
  stdout, its pod log, holds nothing of the program's output.
- metrics (the StdOut collector: cmd/metricscollector/v1beta1/file-metricscollector
  main.go, pns.go WaitMainProcesses, file-metricscollector.go CollectObservationLog with
  common.DefaultFilter `([\\w|-]+)\\s*=\\s*([+-]?\\d*(\\.\\d+)?([Ee][+-]?\\d+)?)`): when the job
  succeeds, the primary pod's metrics file (its metrics-volume, `sim.kubelet.empty_dir`) is
  parsed, never the pod log, and only if the marker `<main pid>.pid` next to it says
  `completed` (WaitPIDs: otherwise the sidecar exits on a fatal error and reports nothing).
  Every `name=value` of the objective or an additional metric counts; observation.metrics
  [{name, min, max, latest}] (getMetrics: "unavailable" when never reported). A pod the
  webhook did not mutate has no collector: nothing is ever reported, and, as in
  trial_controller.go ("metrics are not reported, reconcile requeued"), the trial stays
  Running and the experiment never finishes. SIMPLIFIED: the sidecar is not a process (the
  sim's kubelet runs only the first container); what it would report is read at the job's
  success, when the sidecar would have reported it.
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

from .fake_k8s import ApiError, Event, owner_reference, status_body
from .sim_base import Controller, Key, find_condition, is_true, new_condition, now_rfc3339

EXPERIMENT_LABEL = "katib.kubeflow.org/experiment"
TRIAL_LABEL = "katib.kubeflow.org/trial"  # consts.LabelTrialName
TRIAL_ENV = "KATIB_TRIAL_NAME"  # consts.EnvTrialName
METRICS_FILE = "/var/log/katib/metrics.log"  # common.DefaultFilePath
METRICS_VOLUME = "metrics-volume"  # common.MetricsVolume
SIDECAR = "metrics-logger-and-collector"  # mccommon.MetricLoggerCollectorContainerName
COLLECTOR_IMAGE = "ghcr.io/kubeflow/katib/file-metrics-collector:v0.19.0"  # katib-config.yaml
# pkg/apis/config/v1beta1/defaults.go setResourceRequirements (no resources in katib-config)
SIDECAR_RESOURCES = {
    "requests": {"cpu": "50m", "memory": "10Mi", "ephemeral-storage": "500Mi"},
    "limits": {"cpu": "500m", "memory": "100Mi", "ephemeral-storage": "5Gi"},
}
DB_MANAGER = "katib-db-manager.kubeflow:6789"  # GetDBManagerAddr with the defaults
COMPLETED = "completed"  # mccommon.TrainingCompleted
EARLY_STOPPED = "early-stopped"  # mccommon.TrainingEarlyStopped
INJECTION_LABEL = "katib.kubeflow.org/metrics-collector-injection"
EXPERIMENT_VALIDATOR = "validator.experiment.katib.kubeflow.org"  # webhooks.yaml
EDITABLE = ("parallelTrialCount", "maxTrialCount", "maxFailedTrialCount")
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
    spec["resumePolicy"] = spec.get("resumePolicy") or "Never"
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


def _semantic(value: Any) -> Any:
    """A spec as equality.Semantic.DeepEqual compares it: an empty or null field is the
    field left out."""
    if isinstance(value, dict):
        kept = {k: _semantic(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (None, [], {})}
    if isinstance(value, list):
        return [_semantic(v) for v in value]
    return value


def _go_value(value: Any) -> str:
    """A BadValue as field.Invalid prints it (%q for strings, %v otherwise)."""
    return json.dumps(value) if isinstance(value, str) else str(value)


def experiment_update_errors(new: dict[str, Any], old: dict[str, Any]) -> list[str]:
    """validator.go ValidateExperiment's checks of an edit (oldInst set), on the defaulted
    specs (the defaulter webhook runs on UPDATE too; the stored object was defaulted at
    create): a changed spec is a restart, refused for a completed experiment unless it
    succeeded by max trials with resumePolicy LongRunning or FromVolume
    (IsCompletedExperimentRestartable), and needs maxTrialCount above status.trials; only
    parallelTrialCount, maxTrialCount and maxFailedTrialCount may change."""
    spec, old_spec = _semantic(with_defaults(new)), _semantic(with_defaults(old))
    status = old.get("status") or {}
    errors = []
    if spec != old_spec:
        completed = is_true(status, "Succeeded") or is_true(status, "Failed")
        succeeded = find_condition(status, "Succeeded") or {}
        restartable = (
            is_true(status, "Succeeded")
            and succeeded.get("reason") == "ExperimentMaxTrialsReached"
            and old_spec.get("resumePolicy") in ("LongRunning", "FromVolume")
        )
        if completed and not restartable:
            errors.append(
                f"spec.resumePolicy: Invalid value: {_go_value(spec.get('resumePolicy'))}: "
                "Experiment can be restarted if it is in succeeded state by reaching max "
                "trials and spec.resumePolicy = LongRunning or spec.resumePolicy = FromVolume, "
                "when experiment is completed"
            )
        most = spec.get("maxTrialCount")
        if most is not None and most <= status.get("trials", 0):
            errors.append(
                f"spec.maxTrialCount: Invalid value: {most}: must be greater than status.trials "
                "count"
            )
    unchanged = {k: v for k, v in old_spec.items() if k not in EDITABLE}
    unchanged.update({k: spec[k] for k in EDITABLE if k in spec})
    if spec != unchanged:
        errors.append(
            "spec: Forbidden: only spec.parallelTrialCount, spec.maxTrialCount and "
            "spec.maxFailedTrialCount are editable"
        )
    return errors


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


def wrap_command(container: dict[str, Any], early_stopping: bool) -> None:
    """utils.go wrapWorkerContainer for the StdOut collector, in place."""
    args = [*(container.get("command") or []), *(container.get("args") or [])]
    command = ["sh", "-c"]
    if len(args) >= 2 and args[0] in ("sh", "bash") and args[1] == "-c":
        command, args = args[0:2], args[2:]
    args.append(f"1>{METRICS_FILE} 2>&1")
    marker_dir = METRICS_FILE.rsplit("/", 1)[0]
    if early_stopping:  # getEarlyStoppingCommand
        args += [
            "||",
            f"if test -f {marker_dir}/$$$$.pid && [ $(head -n 1 {marker_dir}/$$.pid) = "
            f"{EARLY_STOPPED} ]; then echo Training Container was Early Stopped; "
            "else echo Training Container was Failed; exit 1; fi",
        ]
    args += ["&&", f"echo {COMPLETED} > {marker_dir}/$$$$.pid"]  # getMarkCompletedCommand
    container["command"] = command
    container["args"] = [" ".join(args)]


class Katib(Controller):
    name = "katib"

    def __init__(self, sim: Any) -> None:
        super().__init__(sim)
        self._rngs: dict[str, random.Random] = {}
        self._grids: dict[str, Any] = {}

    def start(self) -> None:
        self.fake.on_admit("pods", self._mutate_pod)
        self.fake.on_validate("experiments", self._validate_experiment)
        super().start()

    # ------------------------------------------------------------ the experiment webhook

    def _validate_experiment(
        self, _fake: Any, body: dict[str, Any], old: dict[str, Any] | None, ns: str
    ) -> None:
        """validation_webhook.go Handle, on CREATE and UPDATE (no namespaceSelector: every
        namespace): the namespace must carry the collector injection label, then an edit
        must pass ValidateExperiment's update checks (the create-time checks are
        k8s_schemas.katib_semantics). A refusal is admission.Errored(400): the API server
        answers 400 `admission webhook "..." denied the request: <errors>`."""
        name = (body.get("metadata") or {}).get("name", "")
        if self.sim.namespace_labels[ns].get(INJECTION_LABEL) != "enabled":
            why = (
                f'Cannot create the Experiment "{name}" in namespace "{ns}": the namespace '
                f'lacks label "{INJECTION_LABEL}: enabled"'
            )
        else:
            errors = experiment_update_errors(body, old) if old is not None else []
            if not errors:
                return
            # utilerrors.Aggregate: one error as it is, several as [e1, e2]
            why = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
        raise ApiError(
            400,
            status_body(
                400, "", f'admission webhook "{EXPERIMENT_VALIDATOR}" denied the request: {why}'
            ),
        )

    # ------------------------------------------------------------ the pod webhook

    def _owning_trial(self, obj: dict[str, Any], ns: str) -> str | None:
        """inject_webhook.go getKatibJob: the name of the job a Trial owns, through the
        owners of `obj` (the job's name is the Trial's)."""
        for owner in obj["metadata"].get("ownerReferences") or []:
            if owner.get("kind") == "Trial" and owner.get("apiVersion") == "kubeflow.org/v1beta1":
                return str(obj["metadata"]["name"])
        for owner in obj["metadata"].get("ownerReferences") or []:
            plural = {"PyTorchJob": "pytorchjobs"}.get(owner.get("kind", ""))
            nested = self.fake.get_object(plural, owner["name"], ns) if plural else None
            if nested is None:
                return None  # errFailedToGetTrialTemplateJob: MutationRequired says no
            found = self._owning_trial(nested, ns)
            if found:
                return found
        return None

    def _mutate_pod(self, _fake: Any, pod: dict[str, Any], ns: str) -> dict[str, Any]:
        """inject_webhook.go Handle -> MutationRequired -> Mutate."""
        if self.sim.namespace_labels[ns].get(INJECTION_LABEL) != "enabled":
            return pod  # the webhook's namespaceSelector
        job_name = self._owning_trial(pod, ns)
        trial = self.fake.get_object("trials", job_name, ns) if job_name else None
        if trial is None:
            return pod
        spec = trial["spec"]
        mutated = copy.deepcopy(pod)
        labels = mutated["metadata"].setdefault("labels", {})  # mutatePodMetadata
        labels.update(trial["metadata"].get("labels") or {})
        labels[TRIAL_LABEL] = trial["metadata"]["name"]
        containers = mutated["spec"]["containers"]
        primary = next(
            (c for c in containers if c.get("name") == spec.get("primaryContainerName")), None
        )
        if primary is None:  # mutatePodEnv; Handle answers admission.Errored(400)
            names = [c.get("name") for c in containers]
            raise ApiError(
                400,
                status_body(
                    400,
                    "BadRequest",
                    'admission webhook "mutator.pod.katib.kubeflow.org" denied the request: '
                    f"Unable to find primary container {spec.get('primaryContainerName')!r} "
                    f"in mutated pod containers {names}",
                ),
            )
        primary.setdefault("env", []).append(
            {
                "name": TRIAL_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{TRIAL_LABEL}']"}},
            }
        )
        wanted = spec.get("primaryPodLabels") or {}
        original = pod["metadata"].get("labels") or {}
        if wanted and any(original.get(k) != v for k, v in wanted.items()):
            return mutated  # isPrimaryPod: only labels and env for the other pods
        collector = ((spec.get("metricsCollector") or {}).get("collector") or {}).get("kind")
        if collector == "Push":
            return mutated
        if collector != "StdOut":
            raise ValueError(f"the sim's Katib simulates the StdOut collector, not {collector}")
        if not primary.get("command"):
            raise ApiError(
                400,
                status_body(
                    400,
                    "BadRequest",
                    "the sim has no image registry: Katib would read the image's ENTRYPOINT "
                    "(getContainerCommand); give the primary container a command",
                ),
            )
        objective = spec.get("objective") or {}
        metric_names = ";".join(
            [objective.get("objectiveMetricName", ""), *objective.get("additionalMetricNames", [])]
        )
        containers.append(
            {
                "name": SIDECAR,
                "image": COLLECTOR_IMAGE,
                "args": [
                    *("-t", trial["metadata"]["name"], "-m", metric_names),
                    *("-o-type", objective.get("type", ""), "-s-db", DB_MANAGER),
                    *("-path", METRICS_FILE, "-format", "TEXT"),
                ],
                "imagePullPolicy": "IfNotPresent",
                "resources": copy.deepcopy(SIDECAR_RESOURCES),
            }
        )
        mutated["spec"]["shareProcessNamespace"] = True
        mutated["spec"].setdefault("volumes", []).append({"name": METRICS_VOLUME, "emptyDir": {}})
        mount = {"name": METRICS_VOLUME, "mountPath": METRICS_FILE.rsplit("/", 1)[0]}
        for c in containers:
            if c.get("name") in (SIDECAR, spec.get("primaryContainerName")):
                c.setdefault("volumeMounts", []).append(dict(mount))
        wrap_command(primary, early_stopping=bool(spec.get("earlyStoppingRules")))
        return mutated

    # ------------------------------------------------------------ events

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
        """What the primary pod's collector sidecar reported: None when it reported nothing
        (no sidecar, or the main process ended without the `completed` marker)."""
        ns = trial["metadata"]["namespace"]
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
        text = ""
        for pod in pods:
            if not any(c.get("name") == SIDECAR for c in pod["spec"]["containers"]):
                return None  # not mutated: no collector
            folder = self.sim.kubelet.empty_dir(pod, METRICS_VOLUME)
            pid = self.sim.kubelet.main_pid(pod)
            marker = folder / f"{pid}.pid"
            if pid is None or not marker.is_file() or marker.read_text().strip() != COMPLETED:
                return None  # WaitPIDs: "training container is failed": the sidecar exits 1
            metrics = folder / METRICS_FILE.rsplit("/", 1)[1]
            text += metrics.read_text(errors="replace") if metrics.is_file() else ""
        return observation(parse_metrics(text, names))
