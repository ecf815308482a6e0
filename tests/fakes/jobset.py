"""The simulated cluster's JobSet controller (jobset.x-k8s.io/v1alpha2) and the batch/v1 Job
controller's Indexed completion mode, which turns each child Job into pods.

A FAKE, for tests only. The JobSet part follows kubernetes-sigs/jobset at tag v0.12.0 (the
version kubeflow/trainer v2.3.0's go.mod pins); paths are at that tag. The Job part follows
the behaviour of kube-controller-manager's job controller (pkg/controller/job) for what a
JobSet's Jobs use. tests/fakes/UPSTREAM.md has one row per rule.

JobSet:
- defaults (pkg/webhooks/jobset_webhook.go Default): successPolicy `All`, each replicated
  Job's completionMode `Indexed` and its pod restartPolicy `OnFailure` when unset, network
  enableDNSHostnames true. The fake API server has no defaulting webhook, so the controller
  applies them when it reads a JobSet (the stored object is what was sent).
- child Jobs (pkg/controllers/jobset_controller.go constructJob, labelAndAnnotateObject):
  `replicas` Jobs per replicated Job, named `<jobset>-<rjob>-<index>`, owned (controller) by
  the JobSet, with the labels and annotations jobset.sigs.k8s.io/jobset-name,
  replicatedjob-name, job-index, restart-attempt (= status.restarts), replicatedjob-replicas,
  job-key (sha1 of `<ns>/<job>`) on the Job and its pod template; the pod template gets
  `subdomain` (network.subdomain, else the JobSet name) while DNS hostnames are on; a Job is
  created suspended when the JobSet is.
- failure (pkg/controllers/failure_policy.go executeFailurePolicy, the default action
  RestartJobSet): with no failurePolicy a failed Job fails the JobSet, reason `FailedJobs`,
  `jobset failed due to one or more job failures (first failed job: <job>)`; with one, while
  status.restartsCountTowardsMax < maxRestarts, status.restarts and restartsCountTowardsMax
  go up by one and Restarting turns True (reason `DefaultFailurePolicy`, `applying RestartJobSet
  failure policy action (first failed job: <job>)`); the next reconcile deletes the Jobs whose
  restart-attempt label is below status.restarts (getChildJobs) and creates them anew. At
  maxRestarts the JobSet fails: reason `ReachedMaxRestarts`, `jobset failed due to reaching max
  number of restarts (first failed job: <job>)`. failurePolicy.rules
  (findFirstFailedPolicyRuleAndJob, ruleIsApplicable): the first rule some failed Job
  matches (onJobFailureReasons, onJobFailureMessagePatterns, targetReplicatedJobs) picks the
  action: FailJobSet fails the
  JobSet at once, reason `FailJobSetFailurePolicyAction`, `applying FailJobSet failure
  policy action (first failed job: <job>)`; RestartJobSet restarts as above with reason
  `FailurePolicy_<rule name>`; no matching rule is the default RestartJobSet.
- success (success_policy.go, operator All): every Job of every replicated Job complete:
  Completed True, reason `AllJobsCompleted`, `jobset completed successfully`.
- finished (reconcile L162-176): a completed or failed JobSet deletes its active Jobs.
- suspend (suspendJobs / resumeJobsIfNecessary): spec.suspend sets each Job's suspend;
  Suspended True `SuspendedJobs` "jobset is suspended", on resume False `ResumeJobs`
  "jobset is resumed". Resuming a Job (resumeJob L636-L682) first merges its replicated
  Job's pod template labels, annotations, nodeSelector (the JobSet's win), tolerations and
  schedulingGates (added when missing) into the Job's pod template: what Kueue set while the
  JobSet was suspended reaches the pods.
- status.replicatedJobsStatus per replicated Job: ready, succeeded, failed, active, suspended
  (Jobs counted, calculateReplicatedJobStatuses); terminalState Completed or Failed.

Job (Indexed completion mode only; pkg/controller/job/indexed_job_utils.go and job_controller.go):
- one pod per completion index not yet succeeded, named `<job>-<index>-<5 random>`
  (generateName `<job>-<index>-`), labels batch.kubernetes.io/job-name, job-name,
  batch.kubernetes.io/controller-uid, controller-uid, batch.kubernetes.io/job-completion-index,
  the annotation batch.kubernetes.io/job-completion-index, hostname `<job>-<index>`, env
  JOB_COMPLETION_INDEX in every container (fieldRef to the label: PodIndexLabel is on by
  default); owned by the Job.
- podFailurePolicy (pkg/controller/job/pod_failure_policy.go matchPodFailurePolicy): each
  failed pod is matched against the rules in order (onExitCodes: a terminated container,
  `containerName` if set, non-zero exit code In / NotIn the values; onPodConditions); FailJob
  fails the Job at once (reason PodFailurePolicy, `Container <c> for pod <ns>/<pod> failed
  with exit code <n> matching FailJob rule at index <i>`) and deletes its active pods; Ignore
  does not count toward backoffLimit; Count and no match count.
- backoffLimit (default 6): restartPolicy Never counts failed pods, OnFailure the containers'
  restarts; more than backoffLimit fails the Job (Failed, reason BackoffLimitExceeded, "Job has
  reached the specified backoff limit") and deletes its active pods; below it a failed
  index gets a new pod. All indexes succeeded: Complete (reason CompletionsReached, "Reached
  expected number of succeeded pods").
- suspend: a suspended Job deletes its active pods and creates none.

SIMPLIFIED: no headless Service (the fake serves no Services; pods reach each other on
127.0.0.1, see trainer_v2.py); the RestartJob* failure policy actions, startupPolicy
InOrder, successPolicy Any / targetReplicatedJobs, TTL, coordinator, exclusive placement,
volumeClaimPolicies, in-place restart, managedBy and elastic scaling are not simulated (a
JobSet that sets such an action, Any or targetReplicatedJobs is a sim error, never silently
ignored); the Job controller's FailureTarget/SuccessCriteriaMet interim conditions (a FailJob
match is Failed at once), the FailIndex action, backoff delays, podReplacementPolicy and
NonIndexed mode are not simulated.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import re
from collections.abc import Iterable
from typing import Any

from .fake_k8s import ApiError, Event, owner_reference
from .sim_base import Controller, Key, find_condition, is_true, now_rfc3339

PREFIX = "jobset.sigs.k8s.io/"
JOBSET_NAME = PREFIX + "jobset-name"
JOBSET_UID = PREFIX + "jobset-uid"
RJOB_NAME = PREFIX + "replicatedjob-name"
RJOB_REPLICAS = PREFIX + "replicatedjob-replicas"
JOB_INDEX = PREFIX + "job-index"
JOB_KEY = PREFIX + "job-key"
RESTARTS = PREFIX + "restart-attempt"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOB_NAME_LABELS = ("batch.kubernetes.io/job-name", "job-name")
CONTROLLER_UID_LABELS = ("batch.kubernetes.io/controller-uid", "controller-uid")
DEFAULT_BACKOFF_LIMIT = 6


def set_condition(
    status: dict[str, Any], ctype: str, cstatus: str, reason: str, message: str
) -> None:
    """apimachinery meta.SetStatusCondition: lastTransitionTime moves only with the status."""
    conds = [dict(c) for c in status.get("conditions") or []]
    for c in conds:
        if c.get("type") == ctype:
            if c.get("status") != cstatus:
                c["lastTransitionTime"] = now_rfc3339()
            c.update(status=cstatus, reason=reason, message=message)
            break
    else:
        conds.append(
            {
                "type": ctype,
                "status": cstatus,
                "reason": reason,
                "message": message,
                "lastTransitionTime": now_rfc3339(),
            }
        )
    status["conditions"] = conds


def js_condition(
    status: dict[str, Any], ctype: str, cstatus: str, reason: str, message: str
) -> None:
    """jobset_controller.go updateCondition: like SetStatusCondition, but a condition that
    does not exist yet is added only when True (setRestartingConditionFalse on a JobSet that
    never restarted adds nothing)."""
    if find_condition(status, ctype) is None and cstatus != "True":
        return
    set_condition(status, ctype, cstatus, reason, message)


def collect_if_orphaned(
    fake: Any, owner_plural: str, owner: dict[str, Any], plural: str, name: str
) -> None:
    """The garbage collector deleting a dependent whose owner is absent: an owner deleted
    while its controller was creating the dependent (the fake's GC runs only inside a
    delete, so the controller asks for it)."""
    meta = owner["metadata"]
    now = fake.get_object(owner_plural, meta["name"], meta["namespace"])
    if now is None or now["metadata"]["uid"] != meta["uid"]:
        with contextlib.suppress(ApiError):
            fake.delete_object(plural, name, meta["namespace"])


def with_defaults(js: dict[str, Any]) -> dict[str, Any]:
    """jobset_webhook.go Default, applied to a copy."""
    spec = copy.deepcopy(js.get("spec") or {})
    spec.setdefault("successPolicy", {"operator": "All"})
    for rjob in spec.get("replicatedJobs") or []:
        rjob.setdefault("replicas", 1)
        jspec = rjob.setdefault("template", {}).setdefault("spec", {})
        jspec.setdefault("completionMode", "Indexed")
        pspec = jspec.setdefault("template", {}).setdefault("spec", {})
        pspec.setdefault("restartPolicy", "OnFailure")
    net = spec.setdefault("network", {})
    net.setdefault("enableDNSHostnames", True)
    return spec


def job_finished(job: dict[str, Any]) -> str | None:
    status = job.get("status") or {}
    for ctype in ("Complete", "Failed"):
        if is_true(status, ctype):
            return ctype
    return None


def matching_rule(
    rules: list[dict[str, Any]],
    failed: list[dict[str, Any]],
    failed_at: Any,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """failure_policy.go findFirstFailedPolicyRuleAndJob L87-L119 and ruleIsApplicable
    L142-L164: the first rule (in order) that some failed Job matches, with the earliest
    failed Job it matches. A rule matches a Job whose Failed condition's reason is in
    onJobFailureReasons (empty: any), whose message matches one of
    onJobFailureMessagePatterns (regular expressions; empty: any), and whose parent
    replicated Job is in targetReplicatedJobs (empty: any)."""
    for rule in rules:
        matched = []
        for job in failed:
            cond = find_condition(job.get("status") or {}, "Failed")
            if cond is None:
                continue
            reasons = rule.get("onJobFailureReasons") or []
            patterns = rule.get("onJobFailureMessagePatterns") or []
            targets = rule.get("targetReplicatedJobs") or []
            parent = (job["metadata"].get("labels") or {}).get(RJOB_NAME)
            if reasons and cond.get("reason") not in reasons:
                continue
            if patterns and not any(re.search(p, cond.get("message", "")) for p in patterns):
                continue
            if parent is None or (targets and parent not in targets):
                continue
            matched.append(job)
        if matched:
            return rule, min(matched, key=failed_at)
    return None, None


def pod_failure_match(
    policy: dict[str, Any] | None, pod: dict[str, Any]
) -> tuple[str | None, bool]:
    """kubernetes pkg/controller/job/pod_failure_policy.go matchPodFailurePolicy L35-L81,
    getMatchingContainerFromList L105-L120, isOnExitCodesOperatorMatching L122-L141: the
    first rule a failed pod matches decides; onExitCodes matches a terminated container
    (containerName, if set) with a non-zero exit code that is In / NotIn the values, the
    containers first, then the init containers; onPodConditions a condition of the given type
    and status. Returns (the FailJob message, whether the failure counts toward
    backoffLimit): Ignore does not count, Count and no match do."""
    status = pod.get("status") or {}
    meta = pod["metadata"]
    for index, rule in enumerate((policy or {}).get("rules") or []):
        hit: str | None = None
        on_codes = rule.get("onExitCodes")
        if on_codes is not None:
            values = [int(v) for v in on_codes.get("values") or []]
            for cs in [
                *(status.get("containerStatuses") or []),
                *(status.get("initContainerStatuses") or []),
            ]:
                term = (cs.get("state") or {}).get("terminated")
                if term is None or int(term.get("exitCode", 0)) == 0:
                    continue
                if on_codes.get("containerName") not in (None, cs.get("name")):
                    continue
                code = int(term["exitCode"])
                if (code in values) == (on_codes.get("operator") == "In"):
                    hit = (
                        f"Container {cs['name']} for pod {meta.get('namespace')}/{meta['name']} "
                        f"failed with exit code {code} matching FailJob rule at index {index}"
                    )
                    break
        elif rule.get("onPodConditions") is not None:
            for cond in status.get("conditions") or []:
                if any(
                    cond.get("type") == want.get("type")
                    and cond.get("status") == want.get("status", "True")
                    for want in rule["onPodConditions"]
                ):
                    hit = (
                        f"Pod {meta.get('namespace')}/{meta['name']} has condition "
                        f"{cond['type']} matching FailJob rule at index {index}"
                    )
                    break
        if hit is None:
            continue
        action = rule.get("action")
        if action == "Ignore":
            return None, False
        if action == "FailJob":
            return hit, True
        return None, True  # Count (FailIndex needs backoffLimitPerIndex: not simulated)
    return None, True


class JobSetController(Controller):
    name = "jobset-controller"

    def keys_for(self, event: Event) -> Iterable[Key]:
        if event.plural == "jobsets":
            return [] if event.type == "DELETED" else self.own_key(event, "jobsets")
        if event.plural == "jobs":
            return self.owner_key(event, "JobSet")
        return []

    def reconcile(self, key: Key) -> None:
        js = self.get(key)
        if js is None:
            return
        spec = with_defaults(js)
        unsupported = self._unsupported(spec)
        if unsupported:
            self.sim.errors.append(f"{self.name} {key}: not simulated: {unsupported}")
            return
        status = copy.deepcopy(js.get("status") or {})
        before = copy.deepcopy(status)
        restarts = int(status.get("restarts", 0))
        jobs = self.owned("jobs", js)
        previous = [j for j in jobs if int(j["metadata"]["labels"].get(RESTARTS, 0)) < restarts]
        current = [j for j in jobs if j not in previous]
        failed = [j for j in current if job_finished(j) == "Failed"]
        succeeded = [j for j in current if job_finished(j) == "Complete"]
        active = [j for j in current if job_finished(j) is None]
        status["replicatedJobsStatus"] = self._rjob_statuses(spec, current)
        if is_true(status, "Completed") or is_true(status, "Failed"):
            for job in active:
                self._delete("jobs", job)
            self._write(key, status, before)
            return
        for job in previous:
            self._delete("jobs", job)
        suspended = bool(spec.get("suspend"))
        if not suspended and self._all_ready(spec, status["replicatedJobsStatus"]):
            js_condition(status, "Restarting", "False", "JobsReady", "all jobs are ready")
        if failed:
            self._failure_policy(spec, status, failed)
        elif succeeded and len(succeeded) == sum(
            int(r["replicas"]) for r in spec["replicatedJobs"]
        ):
            set_condition(
                status, "Completed", "True", "AllJobsCompleted", "jobset completed successfully"
            )
            js_condition(
                status, "Restarting", "False", "JobSetCompleted", "jobset completed successfully"
            )
            status["terminalState"] = "Completed"
        else:
            existing = {j["metadata"]["name"] for j in current}
            for rjob in spec["replicatedJobs"]:
                for idx in range(int(rjob["replicas"])):
                    name = f"{js['metadata']['name']}-{rjob['name']}-{idx}"
                    if name not in existing:
                        self._create_job(js, spec, rjob, idx, restarts)
            templates = {r["name"]: r["template"] for r in spec["replicatedJobs"]}
            for job in active:
                if bool((job.get("spec") or {}).get("suspend")) != suspended:
                    rjob_name = (job["metadata"].get("labels") or {}).get(RJOB_NAME, "")
                    self._set_job_suspend(job, suspended, templates.get(rjob_name))
            if suspended:
                js_condition(status, "Suspended", "True", "SuspendedJobs", "jobset is suspended")
                js_condition(
                    status, "Restarting", "False", "JobSetSuspended", "jobset is suspended"
                )
            elif is_true(status, "Suspended"):
                js_condition(status, "Suspended", "False", "ResumeJobs", "jobset is resumed")
        self._write(key, status, before)
        if status != before:
            self.requeue(key)  # the status write's own event, as upstream

    @staticmethod
    def _all_ready(spec: dict[str, Any], statuses: list[dict[str, Any]]) -> bool:
        """jobset_controller.go allJobsReady: ready + succeeded Jobs == all replicas."""
        total = sum(int(r["replicas"]) for r in spec["replicatedJobs"])
        return total == sum(s["ready"] + s["succeeded"] for s in statuses)

    @staticmethod
    def _unsupported(spec: dict[str, Any]) -> str:
        out = []
        for rule in (spec.get("failurePolicy") or {}).get("rules") or []:
            if rule.get("action") not in ("FailJobSet", "RestartJobSet"):
                out.append(f"failurePolicy action {rule.get('action')}")
        success = spec.get("successPolicy") or {}
        if success.get("operator", "All") != "All" or success.get("targetReplicatedJobs"):
            out.append("successPolicy other than operator All over every replicated Job")
        if (spec.get("startupPolicy") or {}).get("startupPolicyOrder", "AnyOrder") != "AnyOrder":
            out.append("startupPolicy InOrder")
        return ", ".join(out)

    def _failure_policy(
        self, spec: dict[str, Any], status: dict[str, Any], failed: list[dict[str, Any]]
    ) -> None:
        """failure_policy.go executeFailurePolicy with the default RestartJobSet action."""

        def failed_at(job: dict[str, Any]) -> tuple[str, str]:
            cond = find_condition(job.get("status") or {}, "Failed") or {}
            return (str(cond.get("lastTransitionTime", "")), job["metadata"]["name"])

        first = min(failed, key=failed_at)["metadata"]["name"]
        policy = spec.get("failurePolicy")
        if policy is None:
            msg = f"jobset failed due to one or more job failures (first failed job: {first})"
            self._failed(status, "FailedJobs", msg)
            return
        rule, job = matching_rule(policy.get("rules") or [], failed, failed_at)
        action = rule["action"] if rule else "RestartJobSet"  # defaultFailurePolicyRuleAction
        first = job["metadata"]["name"] if job else first
        if action == "FailJobSet":  # failJobSetActionApplier
            msg = f"applying FailJobSet failure policy action (first failed job: {first})"
            self._failed(status, "FailJobSetFailurePolicyAction", msg)
            return
        if int(status.get("restartsCountTowardsMax", 0)) >= int(policy.get("maxRestarts", 0)):
            msg = (
                f"jobset failed due to reaching max number of restarts (first failed job: {first})"
            )
            self._failed(status, "ReachedMaxRestarts", msg)
            return
        status["restarts"] = int(status.get("restarts", 0)) + 1
        status["restartsCountTowardsMax"] = int(status.get("restartsCountTowardsMax", 0)) + 1
        msg = f"applying RestartJobSet failure policy action (first failed job: {first})"
        reason = f"FailurePolicy_{rule.get('name', '')}" if rule else "DefaultFailurePolicy"
        js_condition(status, "Restarting", "True", reason, msg)

    @staticmethod
    def _failed(status: dict[str, Any], reason: str, msg: str) -> None:
        """failure_policy.go setJobSetFailedCondition."""
        js_condition(status, "Failed", "True", reason, msg)
        js_condition(status, "Restarting", "False", "JobSetFailed", "jobset failed")
        status["terminalState"] = "Failed"

    @staticmethod
    def _rjob_statuses(spec: dict[str, Any], jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for rjob in spec["replicatedJobs"]:
            mine = [j for j in jobs if j["metadata"]["labels"].get(RJOB_NAME) == rjob["name"]]
            counts = dict.fromkeys(("ready", "succeeded", "failed", "active", "suspended"), 0)
            for job in mine:
                done = job_finished(job)
                jstatus = job.get("status") or {}
                parallelism = int((job.get("spec") or {}).get("parallelism", 1))
                if done == "Complete":
                    counts["succeeded"] += 1
                elif done == "Failed":
                    counts["failed"] += 1
                elif (job.get("spec") or {}).get("suspend"):
                    counts["suspended"] += 1
                else:
                    ready = int(jstatus.get("ready", 0)) + int(jstatus.get("succeeded", 0))
                    if ready >= parallelism:
                        counts["ready"] += 1
                    if int(jstatus.get("active", 0)) > 0:
                        counts["active"] += 1
            out.append({"name": rjob["name"], **counts})
        return out

    def _create_job(
        self,
        js: dict[str, Any],
        spec: dict[str, Any],
        rjob: dict[str, Any],
        idx: int,
        restarts: int,
    ) -> None:
        """jobset_controller.go constructJob and labelAndAnnotateObject."""
        meta = js["metadata"]
        name = f"{meta['name']}-{rjob['name']}-{idx}"
        template = copy.deepcopy(rjob["template"])
        ours = {
            JOBSET_NAME: meta["name"],
            JOBSET_UID: meta["uid"],
            RJOB_NAME: rjob["name"],
            RESTARTS: str(restarts),
            RJOB_REPLICAS: str(rjob["replicas"]),
            JOB_INDEX: str(idx),
            JOB_KEY: hashlib.sha1(f"{meta['namespace']}/{name}".encode()).hexdigest(),
        }
        tmeta = template.get("metadata") or {}
        jspec = copy.deepcopy(template.get("spec") or {})
        pod_template = jspec.setdefault("template", {})
        pmeta = pod_template.setdefault("metadata", {})
        pmeta["labels"] = {**(pmeta.get("labels") or {}), **ours}
        pmeta["annotations"] = {**(pmeta.get("annotations") or {}), **ours}
        if spec["network"].get("enableDNSHostnames"):
            pod_template.setdefault("spec", {})["subdomain"] = (
                spec["network"].get("subdomain") or meta["name"]
            )
        jspec["suspend"] = bool(spec.get("suspend"))
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": name,
                "labels": {**(tmeta.get("labels") or {}), **ours},
                "annotations": {**(tmeta.get("annotations") or {}), **ours},
                "ownerReferences": [owner_reference(js)],
            },
            "spec": jspec,
        }
        try:
            self.fake.create_object("jobs", job, meta["namespace"])
        except ApiError as e:
            if e.code != 409:
                self.sim.errors.append(f"{self.name}: creating job {name}: {e}")
            return
        collect_if_orphaned(self.fake, "jobsets", js, "jobs", name)

    def _set_job_suspend(
        self, job: dict[str, Any], suspend: bool, template: dict[str, Any] | None = None
    ) -> None:
        """suspendJobs, or resumeJob (jobset_controller.go L636-L682): on resume, the
        replicated Job's pod template labels, annotations and nodeSelector merged over the
        Job's (collections.MergeMaps), its tolerations and schedulingGates added where
        missing (MergeSlices; upstream's order is a map's, the sim keeps the Job's first)."""
        job = copy.deepcopy(job)
        if not suspend and template is not None:
            src = ((template.get("spec") or {}).get("template")) or {}
            dst = job["spec"].setdefault("template", {})
            for holder, into, field in (
                (src.get("metadata") or {}, dst.setdefault("metadata", {}), "labels"),
                (src.get("metadata") or {}, dst["metadata"], "annotations"),
                (src.get("spec") or {}, dst.setdefault("spec", {}), "nodeSelector"),
            ):
                merged = {**(into.get(field) or {}), **(holder.get(field) or {})}
                if merged:
                    into[field] = merged
            for field in ("tolerations", "schedulingGates"):
                items = list(dst["spec"].get(field) or [])
                items += [i for i in (src.get("spec") or {}).get(field) or [] if i not in items]
                if items:
                    dst["spec"][field] = items
        job["spec"]["suspend"] = suspend
        self.fake.put_object("jobs", job)

    def _delete(self, plural: str, obj: dict[str, Any]) -> None:
        with contextlib.suppress(ApiError):
            self.fake.delete_object(plural, obj["metadata"]["name"], obj["metadata"]["namespace"])

    def _write(self, key: Key, status: dict[str, Any], before: dict[str, Any]) -> None:
        if status != before:
            with contextlib.suppress(ApiError):
                self.fake.set_status(key[0], key[2], status, namespace=key[1])


class JobController(Controller):
    """batch/v1 Job, Indexed completion mode (what JobSet's Jobs use)."""

    name = "job-controller"

    def keys_for(self, event: Event) -> Iterable[Key]:
        if event.plural == "jobs":
            return [] if event.type == "DELETED" else self.own_key(event, "jobs")
        if event.plural == "pods":
            return self.owner_key(event, "Job")
        return []

    def reconcile(self, key: Key) -> None:
        job = self.get(key)
        if job is None:
            return
        spec = job.get("spec") or {}
        status = copy.deepcopy(job.get("status") or {})
        before = copy.deepcopy(status)
        pods = self.owned("pods", job)
        phase = {id(p): (p.get("status") or {}).get("phase", "Pending") for p in pods}
        live = [p for p in pods if phase[id(p)] not in ("Succeeded", "Failed")]
        if job_finished(job):
            return
        if spec.get("completionMode", "NonIndexed") != "Indexed":
            self.sim.errors.append(f"{self.name} {key}: only Indexed Jobs are simulated")
            return
        completions = int(spec.get("completions", spec.get("parallelism", 1)))
        restart_policy = ((spec.get("template") or {}).get("spec") or {}).get("restartPolicy")
        if restart_policy == "OnFailure":
            failures = sum(
                int(cs.get("restartCount", 0))
                for p in pods
                for cs in (p.get("status") or {}).get("containerStatuses") or []
            )
        else:
            policy = spec.get("podFailurePolicy")
            matches = [pod_failure_match(policy, p) for p in pods if phase[id(p)] == "Failed"]
            fail_job = next((msg for msg, _ in matches if msg), None)
            if fail_job is not None:  # job_controller.go: FailJob ends the Job at once
                for pod in live:
                    self._delete_pod(pod)
                status["active"] = 0
                set_condition(status, "Failed", "True", "PodFailurePolicy", fail_job)
                self._write(key, status, before)
                return
            failures = sum(1 for _, counts in matches if counts)
        done = {self._index(p) for p in pods if phase[id(p)] == "Succeeded"}
        status["failed"] = sum(1 for p in pods if phase[id(p)] == "Failed")
        status["succeeded"] = len(done)
        status["ready"] = sum(
            1
            for p in live
            if any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or []
            )
            or phase[id(p)] == "Running"
        )
        if spec.get("suspend"):
            for pod in live:
                self._delete_pod(pod)
            status["active"] = 0
            set_condition(status, "Suspended", "True", "JobSuspended", "Job suspended")
            self._write(key, status, before)
            return
        if is_true(status, "Suspended"):
            set_condition(status, "Suspended", "False", "JobResumed", "Job resumed")
        if failures > int(spec.get("backoffLimit", DEFAULT_BACKOFF_LIMIT)):
            for pod in live:
                self._delete_pod(pod)
            status["active"] = 0
            set_condition(
                status,
                "Failed",
                "True",
                "BackoffLimitExceeded",
                "Job has reached the specified backoff limit",
            )
            self._write(key, status, before)
            return
        if len(done) >= completions:
            status["active"] = 0
            status["completionTime"] = now_rfc3339()
            set_condition(
                status,
                "Complete",
                "True",
                "CompletionsReached",
                "Reached expected number of succeeded pods",
            )
            self._write(key, status, before)
            return
        running = {self._index(p) for p in live}
        for idx in range(completions):
            if idx not in done and idx not in running:
                self._create_pod(job, idx)
                running.add(idx)
        status["active"] = len(running)
        status.setdefault("startTime", now_rfc3339())
        self._write(key, status, before)

    @staticmethod
    def _index(pod: dict[str, Any]) -> int:
        return int((pod["metadata"].get("annotations") or {}).get(COMPLETION_INDEX, -1))

    def _create_pod(self, job: dict[str, Any], idx: int) -> None:
        meta = job["metadata"]
        template = copy.deepcopy((job.get("spec") or {}).get("template") or {})
        tmeta = template.get("metadata") or {}
        pod_spec = template.get("spec") or {}
        labels = dict(tmeta.get("labels") or {})
        for name in JOB_NAME_LABELS:
            labels[name] = meta["name"]
        for name in CONTROLLER_UID_LABELS:
            labels[name] = meta["uid"]
        labels[COMPLETION_INDEX] = str(idx)
        annotations = {**(tmeta.get("annotations") or {}), COMPLETION_INDEX: str(idx)}
        pod_spec.setdefault("hostname", f"{meta['name']}-{idx}")
        index_env = {
            "name": "JOB_COMPLETION_INDEX",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{COMPLETION_INDEX}']"}},
        }
        for container in [*(pod_spec.get("initContainers") or []), *pod_spec["containers"]]:
            env = container.setdefault("env", [])
            if not any(e.get("name") == "JOB_COMPLETION_INDEX" for e in env):
                env.append(copy.deepcopy(index_env))
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": f"{meta['name']}-{idx}-",
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [owner_reference(job)],
            },
            "spec": pod_spec,
        }
        try:
            created = self.fake.create_object("pods", pod, meta["namespace"])
        except ApiError as e:
            self.sim.errors.append(f"{self.name}: creating a pod of {meta['name']}: {e}")
            return
        collect_if_orphaned(self.fake, "jobs", job, "pods", created["metadata"]["name"])

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        with contextlib.suppress(ApiError):
            self.fake.delete_object("pods", pod["metadata"]["name"], pod["metadata"]["namespace"])

    def _write(self, key: Key, status: dict[str, Any], before: dict[str, Any]) -> None:
        if status != before:
            with contextlib.suppress(ApiError):
                self.fake.set_status(key[0], key[2], status, namespace=key[1])
