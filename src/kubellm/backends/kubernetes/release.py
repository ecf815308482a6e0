"""The end of a pipeline run on a cluster: delete the jobs and experiments labelled with it.

Why the exit handler does this and not only the step that created them. KFP stops a run by
setting its Argo Workflow's `activeDeadlineSeconds` to 0 (kubeflow/pipelines
backend/src/apiserver/resource/resource_manager.go TerminateWorkflow, 2.17.0). Argo then
SIGTERMs each running step's container; its emissary (PID 1) passes the signal to the
step's whole process group, so the KFP launcher (a Go binary without a signal handler)
exits at once beside our Python; the emissary reaps it within a second and exits, and the
kernel SIGKILLs what is left of the container. The step's own SIGTERM path
(`KubeClient.run`: delete the job, then exit 143) runs inside that window: a best effort,
which a slow API server or the second's end cuts short. The step pod is not deleted
either (Argo keeps it), so the job's ownerReference to it does not fire until the run is
deleted. Argo exempts exit handlers from the deadline (workflow/controller/workflowpod.go,
exec_control.go; KFP compiles dsl.ExitHandler into an Argo exit hook), so the exit handler
runs on a stopped run as on a failed or a finished one: it is where cleanup is certain.
tests/fakes/emissary.py plays that stop, with the upstream lines.

A run that is deleted rather than stopped never runs its exit handler; there the
ownerReferences do it (the step pods go with the Workflow). Every request here is allowed
by manifests/base/rbac.yaml: `list` (with a label selector) and `delete` on each kind.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TypeVar

from kubernetes.client.rest import ApiException

from kubellm.backends.kubernetes.client import CustomResource, KubeClient
from kubellm.backends.kubernetes.podspec import RUN_LABEL, label_value
from kubellm.backends.kubernetes.responses import TRANSIENT, api_message

# Tries of one list or delete through transient errors (429, 5xx), 0.2 s apart and doubling.
_ATTEMPTS = 4
_T = TypeVar("_T")


def run_selector(run_tag: str) -> str:
    """The label selector of every object run `run_tag` created ("" when it has no label)."""
    value = label_value(run_tag)
    return f"{RUN_LABEL}={value}" if value else ""


def delete_run_objects(
    kube: KubeClient, res: CustomResource, namespace: str, run_tag: str
) -> list[str]:
    """Delete every `res` object labelled with run `run_tag` in `namespace`; one line per
    object (deleted, already gone, or why not and how to do it by hand).

    A kind the cluster does not serve (404 on the list: Katib not installed) has nothing to
    delete. Deletion is Background: the object goes at once, its pods after it.
    """
    selector = run_selector(run_tag)
    if not selector:
        return []
    kind = res.kind.lower()
    by_hand = f"kubectl delete {res.plural}.{res.group} -n {namespace} -l {selector}"
    try:
        items = _retry(lambda: kube.list(res, namespace, selector))
    except ApiException as e:
        if e.status == 404:
            return []
        return [
            f"{res.plural} of the run could not be listed (HTTP {e.status} {api_message(e)}); "
            f"delete them by hand: {by_hand}"
        ]
    done = []
    for obj in items:
        name = str((obj.get("metadata") or {}).get("name"))
        try:
            gone = _retry(functools.partial(kube.delete, res, namespace, name))
        except ApiException as e:
            done.append(
                f"{kind}/{name} in {namespace}: deleting it failed "
                f"(HTTP {e.status} {api_message(e)}); delete it by hand: {by_hand}"
            )
            continue
        done.append(f"{kind}/{name} in {namespace}: " + ("deleted" if gone else "already gone"))
    return done


def _retry(call: Callable[[], _T]) -> _T:
    for attempt in range(_ATTEMPTS):
        try:
            return call()
        except ApiException as e:
            if e.status not in TRANSIENT or attempt == _ATTEMPTS - 1:
                raise
            time.sleep(0.2 * 2**attempt)
    raise AssertionError("unreachable")
