"""The fake API server itself: it must reject what a real one rejects, or its passes are empty."""

from __future__ import annotations

import copy
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client as k8s
from kubernetes import watch
from kubernetes.client.rest import ApiException

from fakes.fake_k8s import RESOURCES, ApiError, FakeK8s, merge_patch, selector_matches
from kubellm.backends.base import ServeRequest, ServeResources, TrainJob, TuneRequest
from kubellm.backends.kubernetes.inferenceservice import build_inferenceservice
from kubellm.backends.kubernetes.katib import build_experiment
from kubellm.backends.kubernetes.pytorchjob import pytorchjob_manifest
from kubellm.tune.search import SearchParam

JOB = TrainJob(name="j", image="img", train_args=["--config", "c.json"], nnodes=2)


def valid_body(plural: str) -> dict[str, Any]:
    if plural == "pytorchjobs":
        return pytorchjob_manifest(JOB)
    if plural == "experiments":
        space = [SearchParam("lr", 0.001, 0.1)]
        return build_experiment(TuneRequest(name="e", trial_job=JOB, space=space, max_trials=2))
    # up to 4 replicas: a case below raises minReplicas (KServe's webhook: min <= max)
    resources = ServeResources(max_replicas=4)
    return build_inferenceservice(ServeRequest("m", "pvc://ws/m", image="img", resources=resources))


def master_container(body: dict[str, Any]) -> Any:
    """The master's container in `body` itself (cases mutate it in place)."""
    return body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def trial_spec(body: dict[str, Any]) -> Any:
    return body["spec"]["trialTemplate"]["trialSpec"]


@dataclass
class InvalidCase:
    name: str
    plural: str
    mutate: Callable[[dict[str, Any]], None]
    field: str  # the path the error must name


INVALID_CASES = [
    InvalidCase(
        "pytorchjob-unknown-spec-field",
        "pytorchjobs",
        lambda b: b["spec"].update(numNodes=2),
        "spec.numNodes",
    ),
    InvalidCase(
        "pytorchjob-unknown-container-field",
        "pytorchjobs",
        lambda b: master_container(b).update(gpus=1),
        "spec.pytorchReplicaSpecs.Master.template.spec.containers[0].gpus",
    ),
    InvalidCase(
        "pytorchjob-wrong-type",
        "pytorchjobs",
        lambda b: b["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas="one"),
        "spec.pytorchReplicaSpecs.Worker.replicas",
    ),
    InvalidCase(
        "pytorchjob-container-not-named-pytorch",
        "pytorchjobs",
        lambda b: master_container(b).update(name="trainer"),
        "spec.pytorchReplicaSpecs.Master.template.spec.containers",
    ),
    InvalidCase(
        "pytorchjob-unknown-metadata-field",
        "pytorchjobs",
        lambda b: b["metadata"].update(label={"a": "b"}),
        "metadata.label",
    ),
    InvalidCase(
        "isvc-storage-uri-on-predictor",  # not in this KServe's predictor schema
        "inferenceservices",
        lambda b: b["spec"]["predictor"].update(storageUri="s3://bucket/model"),
        "spec.predictor.storageUri",
    ),
    InvalidCase(
        "isvc-missing-predictor",
        "inferenceservices",
        lambda b: b["spec"].pop("predictor"),
        "spec",
    ),
    InvalidCase(
        "experiment-unknown-field",
        "experiments",
        lambda b: b["spec"].update(maxTrials=3),
        "spec.maxTrials",
    ),
    InvalidCase(
        "experiment-wrong-type",
        "experiments",
        lambda b: b["spec"].update(maxTrialCount="3"),
        "spec.maxTrialCount",
    ),
    InvalidCase(
        "experiment-parallel-above-max",
        "experiments",
        lambda b: b["spec"].update(parallelTrialCount=5),
        "spec.parallelTrialCount",
    ),
    InvalidCase(
        "experiment-trialspec-named",
        "experiments",
        lambda b: trial_spec(b).update(metadata={"name": "x"}),
        "spec.trialTemplate.trialSpec.metadata",
    ),
    InvalidCase(
        "experiment-trialspec-unknown-field",
        "experiments",
        lambda b: trial_spec(b)["spec"].update(replicas=2),
        "spec.trialTemplate.trialSpec.spec.replicas",
    ),
    InvalidCase(
        "experiment-undeclared-placeholder",
        "experiments",
        lambda b: b["spec"]["trialTemplate"]["trialParameters"].pop(),
        "spec.trialTemplate.trialSpec",
    ),
    InvalidCase(
        "experiment-wrong-primary-container",
        "experiments",
        lambda b: b["spec"]["trialTemplate"].update(primaryContainerName="training-container"),
        "spec.trialTemplate.primaryContainerName",
    ),
]


@pytest.mark.parametrize("case", INVALID_CASES, ids=lambda c: c.name)
def test_invalid_body_is_rejected_naming_the_field(case: InvalidCase, fake_k8s: FakeK8s) -> None:
    body = valid_body(case.plural)
    assert fake_k8s.validate(case.plural, body) == []
    case.mutate(body)
    kind = RESOURCES[case.plural]
    api = k8s.CustomObjectsApi(fake_k8s.api_client())

    with pytest.raises(ApiException) as info:
        api.create_namespaced_custom_object(kind.group, kind.version, "default", case.plural, body)

    assert info.value.status == 422
    status = json.loads(info.value.body)
    assert status["kind"] == "Status" and status["reason"] == "Invalid"
    assert case.field in status["message"]
    assert any(case.field in e for e in fake_k8s.errors), fake_k8s.errors
    assert fake_k8s.get_object(case.plural, body["metadata"]["name"]) is None


def test_scripted_status_is_checked_too(fake_k8s: FakeK8s) -> None:
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    api.create_namespaced_custom_object(
        "kubeflow.org", "v1", "default", "pytorchjobs", valid_body("pytorchjobs")
    )
    fake_k8s.set_status("pytorchjobs", "j", {"conditions": [{"type": "Running"}]})
    assert any("status" in e and "required" in e for e in fake_k8s.errors), fake_k8s.errors


def test_unknown_resource_and_object_are_404(fake_k8s: FakeK8s) -> None:
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    # The Role allows pytorchjobs in kubeflow.org (any version): past RBAC, no such version.
    with pytest.raises(ApiException) as info:
        api.get_namespaced_custom_object("kubeflow.org", "v1beta1", "default", "pytorchjobs", "x")
    assert info.value.status == 404
    # RBAC runs before routing (the authorization filter): tfjobs are not in the Role.
    with pytest.raises(ApiException) as info:
        api.get_namespaced_custom_object("kubeflow.org", "v1", "default", "tfjobs", "x")
    assert info.value.status == 403
    with pytest.raises(ApiException) as info:
        api.get_namespaced_custom_object("kubeflow.org", "v1", "default", "pytorchjobs", "x")
    assert info.value.status == 404


def test_replace_and_patch_keep_status_and_bump_generation() -> None:
    # the API server's semantics of PATCH, which kubellm's Role does not grant: no RBAC here
    with FakeK8s(rbac=None) as fake:
        _replace_and_patch(fake)


def _replace_and_patch(fake_k8s: FakeK8s) -> None:
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    args = ("serving.kserve.io", "v1beta1", "default", "inferenceservices")
    created = api.create_namespaced_custom_object(*args, valid_body("inferenceservices"))
    fake_k8s.set_status("inferenceservices", "m", {"url": "http://m", "observedGeneration": 1})

    with pytest.raises(ApiException) as info:  # the status write bumped the resourceVersion
        api.replace_namespaced_custom_object(*args, "m", created)
    assert info.value.status == 409
    created = api.get_namespaced_custom_object(*args, "m")
    changed = copy.deepcopy(created)
    changed["spec"]["predictor"]["minReplicas"] = 2
    replaced = api.replace_namespaced_custom_object(*args, "m", changed)
    assert replaced["metadata"]["generation"] == 2
    assert replaced["status"] == {"url": "http://m", "observedGeneration": 1}

    stale = copy.deepcopy(changed)  # carries the old resourceVersion
    with pytest.raises(ApiException) as info:
        api.replace_namespaced_custom_object(*args, "m", stale)
    assert info.value.status == 409

    patched = api.patch_namespaced_custom_object(
        *args, "m", {"metadata": {"labels": {"team": "a"}}}
    )
    assert patched["metadata"]["labels"]["team"] == "a"
    assert patched["metadata"]["generation"] == 2
    assert fake_k8s.errors == []


@dataclass
class SelectorCase:
    selector: str
    labels: dict[str, str]
    matches: bool


@pytest.mark.parametrize(
    "case",
    [
        SelectorCase("", {}, True),
        SelectorCase("a=1", {"a": "1"}, True),
        SelectorCase("a==1,b=2", {"a": "1", "b": "2"}, True),
        SelectorCase("a=1,b=2", {"a": "1"}, False),
        SelectorCase("a!=1", {"a": "2"}, True),
        SelectorCase("a!=1", {"a": "1"}, False),
        SelectorCase("a", {"a": ""}, True),
        SelectorCase("!a", {"a": ""}, False),
    ],
    ids=lambda c: f"{c.selector or 'empty'}->{c.matches}",
)
def test_label_selectors(case: SelectorCase) -> None:
    assert selector_matches(case.selector, case.labels) is case.matches


def test_merge_patch_follows_rfc7386() -> None:
    target = {"a": {"b": 1, "c": 2}, "d": [1]}
    assert merge_patch(target, {"a": {"b": None, "e": 3}, "d": [2]}) == {
        "a": {"c": 2, "e": 3},
        "d": [2],
    }


# ---------------------------------------------------------------- API server semantics
# Each test drives the fake with the real kubernetes client, the way kubellm's code does.

JOBS = ("kubeflow.org", "v1", "default", "pytorchjobs")
SA = "system:serviceaccount:kubellm:kubellm-pipeline"


def job_body(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    body = pytorchjob_manifest(TrainJob(name=name, image="img", train_args=[]))
    body["metadata"]["labels"] = labels or {}
    del body["metadata"]["namespace"]  # the URL's
    return body


def drain(stream: Iterator[dict[str, Any]], n: int) -> list[tuple[str, str]]:
    """The next n events as (type, name)."""
    return [(e["type"], e["raw_object"]["metadata"]["name"]) for e in itertools.islice(stream, n)]


def later(delay_s: float, fn: Callable[[], object]) -> threading.Timer:
    timer = threading.Timer(delay_s, fn)
    timer.start()
    return timer


def test_watch_replays_from_a_resource_version_then_streams_live(fake_k8s: FakeK8s) -> None:
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    api.create_namespaced_custom_object(*JOBS, job_body("a"))
    rv = api.list_namespaced_custom_object(*JOBS)["metadata"]["resourceVersion"]
    fake_k8s.set_status("pytorchjobs", "a", {"conditions": [], "replicaStatuses": {}})
    api.create_namespaced_custom_object(*JOBS, job_body("b"))
    api.delete_namespaced_custom_object(*JOBS, "b")

    w = watch.Watch()
    stream = w.stream(api.list_namespaced_custom_object, *JOBS, resource_version=rv)
    assert drain(stream, 3) == [("MODIFIED", "a"), ("ADDED", "b"), ("DELETED", "b")]
    later(0.1, lambda: api.create_namespaced_custom_object(*JOBS, job_body("c")))
    (event,) = itertools.islice(stream, 1)
    w.stop()
    assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "c")
    assert int(event["object"]["metadata"]["resourceVersion"]) == fake_k8s.resource_version
    assert w.resource_version == event["object"]["metadata"]["resourceVersion"]


def test_watch_without_version_lists_first_and_filters_by_selectors(fake_k8s: FakeK8s) -> None:
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    api.create_namespaced_custom_object(*JOBS, job_body("a", {"team": "x"}))
    api.create_namespaced_custom_object(*JOBS, job_body("b", {"team": "y"}))
    stream = watch.Watch().stream(
        api.list_namespaced_custom_object, *JOBS, label_selector="team=x", timeout_seconds=1
    )
    # b leaves nothing; a relabelled out of the selector arrives as DELETED (the watch cache)
    relabelled = job_body("a", {"team": "z"})  # the Role has no patch on jobs: a control
    later(0.1, lambda: fake_k8s.put_object("pytorchjobs", relabelled))
    assert drain(stream, 2) == [("ADDED", "a"), ("DELETED", "a")]

    by_name = watch.Watch().stream(
        api.list_namespaced_custom_object,
        *JOBS,
        field_selector="metadata.name=b",
        timeout_seconds=1,
    )
    assert drain(by_name, 5) == [("ADDED", "b")]  # the stream ends at timeoutSeconds

    with pytest.raises(ApiException) as info:
        api.list_namespaced_custom_object(*JOBS, field_selector="spec.x=1")
    assert info.value.status == 400


def test_watch_from_compacted_history_gets_410_expired(fake_k8s: FakeK8s) -> None:
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    api.create_namespaced_custom_object(*JOBS, job_body("a"))
    rv = api.list_namespaced_custom_object(*JOBS)["metadata"]["resourceVersion"]
    fake_k8s.set_status("pytorchjobs", "a", {"conditions": [], "replicaStatuses": {}})
    fake_k8s.compact()

    raw = api.list_namespaced_custom_object(
        *JOBS, watch=True, resource_version=rv, _preload_content=False
    )
    (line,) = raw.data.decode().splitlines()
    event = json.loads(line)
    assert event["type"] == "ERROR"
    assert event["object"]["code"] == 410 and event["object"]["reason"] == "Expired"
    assert (
        event["object"]["message"]
        == f"too old resource version: {rv} ({fake_k8s.resource_version})"
    )
    # the client raises it (with timeout_seconds it does not retry)
    with pytest.raises(ApiException) as info:
        list(
            watch.Watch().stream(
                api.list_namespaced_custom_object, *JOBS, resource_version=rv, timeout_seconds=1
            )
        )
    assert info.value.status == 410
    # a watch from now is fine
    now = api.list_namespaced_custom_object(*JOBS)["metadata"]["resourceVersion"]
    assert (
        list(
            watch.Watch().stream(
                api.list_namespaced_custom_object, *JOBS, resource_version=now, timeout_seconds=1
            )
        )
        == []
    )


def test_bounded_history_expires_old_versions() -> None:
    with FakeK8s(rbac=None, history=3) as fake:
        api = k8s.CustomObjectsApi(fake.api_client())
        start = int(api.list_namespaced_custom_object(*JOBS)["metadata"]["resourceVersion"])
        for name in "abcde":  # resourceVersions start+1 .. start+5; the last 3 retained
            api.create_namespaced_custom_object(*JOBS, job_body(name))
        with pytest.raises(ApiException) as info:
            list(
                watch.Watch().stream(
                    api.list_namespaced_custom_object,
                    *JOBS,
                    resource_version=str(start + 1),  # b (start+2) is gone
                    timeout_seconds=1,
                )
            )
        assert info.value.status == 410
        events = watch.Watch().stream(
            api.list_namespaced_custom_object,
            *JOBS,
            resource_version=str(start + 2),
            timeout_seconds=1,
        )
        assert drain(events, 5) == [("ADDED", "c"), ("ADDED", "d"), ("ADDED", "e")]


def test_drop_watches_breaks_the_stream_and_timeout_ends_it_cleanly(fake_k8s: FakeK8s) -> None:
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    api.create_namespaced_custom_object(*JOBS, job_body("a"))
    stream = watch.Watch().stream(api.list_namespaced_custom_object, *JOBS)
    assert drain(stream, 1) == [("ADDED", "a")]
    later(0.2, fake_k8s.drop_watches)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        next(stream)

    # a clean drop (the server's own watch timeout) just ends a stream with timeout_seconds
    stream = watch.Watch().stream(api.list_namespaced_custom_object, *JOBS, timeout_seconds=30)
    assert drain(stream, 1) == [("ADDED", "a")]
    later(0.2, lambda: fake_k8s.drop_watches(clean=True))
    started = time.monotonic()
    assert list(stream) == []
    assert time.monotonic() - started < 5

    started = time.monotonic()
    assert drain(
        watch.Watch().stream(api.list_namespaced_custom_object, *JOBS, timeout_seconds=1), 9
    ) == [("ADDED", "a")]
    assert 0.9 < time.monotonic() - started < 5


def test_bookmarks_when_allowed(fake_k8s: FakeK8s) -> None:
    fake_k8s.bookmark_s = 0.1
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    stream = watch.Watch().stream(
        api.list_namespaced_custom_object, *JOBS, allow_watch_bookmarks=True, timeout_seconds=1
    )
    event = next(iter(stream))
    assert event["type"] == "BOOKMARK"
    assert event["raw_object"]["metadata"]["resourceVersion"] == str(fake_k8s.resource_version)


def test_scripted_status_advances_for_a_client_that_only_watches(fake_k8s: FakeK8s) -> None:
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    running = {"conditions": [{"type": "Running", "status": "True"}], "replicaStatuses": {}}
    done = {"conditions": [{"type": "Succeeded", "status": "True"}], "replicaStatuses": {}}
    fake_k8s.script_status("pytorchjobs", "a", [running, done])
    api.create_namespaced_custom_object(*JOBS, job_body("a"))
    stream = watch.Watch().stream(api.list_namespaced_custom_object, *JOBS, timeout_seconds=2)
    seen = [e["raw_object"].get("status") for e in itertools.islice(stream, 3)]
    assert seen == [None, running, done]
    assert fake_k8s.errors == []


def test_pods_are_objects_with_selectors_watch_and_status(fake_k8s: FakeK8s) -> None:
    core = k8s.CoreV1Api(fake_k8s.api_client())
    fake_k8s.add_pod("default", "p0", {"app": "x"}, phase="Running")
    fake_k8s.add_pod("default", "p1", {"app": "y"})
    assert [
        p.metadata.name
        for p in core.list_namespaced_pod("default", label_selector="app in (x)").items
    ] == ["p0"]
    stream = watch.Watch().stream(
        core.list_namespaced_pod, "default", label_selector="app=x", timeout_seconds=2
    )
    first = next(iter(stream))
    assert first["type"] == "ADDED" and first["object"].status.phase == "Running"
    later(0.1, lambda: fake_k8s.set_pod_phase("default", "p0", "Failed", exit_code=137))
    event = next(iter(stream))
    assert event["type"] == "MODIFIED"
    terminated = event["object"].status.container_statuses[0].state.terminated
    assert (event["object"].status.phase, terminated.exit_code, terminated.reason) == (
        "Failed",
        137,
        "Error",
    )
    pods = core.list_namespaced_pod("default", field_selector="status.phase=Pending").items
    assert [p.metadata.name for p in pods] == ["p1"]


def test_log_follow_streams_until_the_pod_terminates(fake_k8s: FakeK8s) -> None:
    core = k8s.CoreV1Api(fake_k8s.api_client())
    fake_k8s.add_pod("default", "p", {}, phase="Pending")
    with pytest.raises(ApiException) as info:  # as the kubelet answers before the container runs
        core.read_namespaced_pod_log("p", "default")
    assert info.value.status == 400 and "is waiting to start: ContainerCreating" in info.value.body
    fake_k8s.set_pod_phase("default", "p", "Running")
    fake_k8s.append_log("default", "p", "step=1\nstep=2\n")

    def finish() -> None:
        for i in (3, 4):
            time.sleep(0.05)
            fake_k8s.append_log("default", "p", f"step={i}\n")
        fake_k8s.set_pod_phase("default", "p", "Succeeded", exit_code=0)

    later(0.3, finish)
    lines = list(watch.Watch().stream(core.read_namespaced_pod_log, "p", "default", tail_lines=1))
    assert lines == ["step=2", "step=3", "step=4"]
    whole = core.read_namespaced_pod_log("p", "default", _preload_content=False).data.decode()
    assert whole == "step=1\nstep=2\nstep=3\nstep=4\n"

    fake_k8s.add_pod("default", "q", {}, phase="Running")
    later(0.2, lambda: fake_k8s.delete_object("pods", "q"))
    assert list(watch.Watch().stream(core.read_namespaced_pod_log, "q", "default")) == []


def test_delete_cascades_to_what_the_object_owns(fake_k8s: FakeK8s) -> None:
    api = k8s.CustomObjectsApi(fake_k8s.api_client())
    core = k8s.CoreV1Api(fake_k8s.api_client())
    owners = {}
    for name in ("bg", "orphan", "fg"):
        owners[name] = api.create_namespaced_custom_object(*JOBS, job_body(name))
        fake_k8s.add_pod("default", f"{name}-0", {"job": name}, owner=owners[name], phase="Running")
    child = fake_k8s.get_object("pods", "bg-0")
    assert child is not None
    fake_k8s.add_pod("default", "grandchild", {"job": "bg"}, owner=child, phase="Running")
    rv = api.list_namespaced_custom_object(*JOBS)["metadata"]["resourceVersion"]

    api.delete_namespaced_custom_object(
        *JOBS, "bg", body=k8s.V1DeleteOptions(propagation_policy="Background")
    )
    api.delete_namespaced_custom_object(
        *JOBS, "orphan", body=k8s.V1DeleteOptions(propagation_policy="Orphan")
    )
    api.delete_namespaced_custom_object(*JOBS, "fg", propagation_policy="Foreground")

    pods = {p.metadata.name: p for p in core.list_namespaced_pod("default").items}
    assert set(pods) == {"orphan-0"}
    assert not pods["orphan-0"].metadata.owner_references
    events = watch.Watch().stream(
        core.list_namespaced_pod, "default", resource_version=rv, timeout_seconds=1
    )
    assert drain(events, 9) == [
        ("DELETED", "bg-0"),
        ("DELETED", "grandchild"),
        ("MODIFIED", "orphan-0"),
        ("MODIFIED", "fg-0"),  # foreground: deletionTimestamp and its finalizer first
        ("DELETED", "fg-0"),
    ]
    assert ("pods", "default", "grandchild") in fake_k8s.deleted


def test_rbac_refuses_what_the_role_does_not_grant(fake_k8s: FakeK8s, tmp_path: Path) -> None:
    role = tmp_path / "rbac.yaml"
    role.write_text(
        """
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: r}
rules:
  - apiGroups: ["kubeflow.org"]
    resources: ["pytorchjobs"]
    verbs: ["create", "get"]
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["list"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: r}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: r}
subjects: [{kind: ServiceAccount, name: kubellm-pipeline, namespace: kubellm}]
"""
    )
    with FakeK8s(rbac=role) as fake:
        api = k8s.CustomObjectsApi(fake.api_client())
        core = k8s.CoreV1Api(fake.api_client())
        api.create_namespaced_custom_object(
            "kubeflow.org", "v1", "team", "pytorchjobs", job_body("a")
        )
        api.get_namespaced_custom_object("kubeflow.org", "v1", "team", "pytorchjobs", "a")
        fake.add_pod("team", "a-0", {}, phase="Running")
        core.list_namespaced_pod("team")
        refused = [
            (
                lambda: api.delete_namespaced_custom_object(
                    "kubeflow.org", "v1", "team", "pytorchjobs", "a"
                ),
                f'pytorchjobs.kubeflow.org "a" is forbidden: User "{SA}" cannot delete '
                'resource "pytorchjobs" in API group "kubeflow.org" in the namespace "team"',
            ),
            (
                lambda: api.list_namespaced_custom_object(
                    "kubeflow.org", "v1", "team", "pytorchjobs", watch=True, _preload_content=False
                ),
                f'pytorchjobs.kubeflow.org is forbidden: User "{SA}" cannot watch '
                'resource "pytorchjobs" in API group "kubeflow.org" in the namespace "team"',
            ),
            (
                lambda: core.read_namespaced_pod_log("a-0", "team"),
                f'pods "a-0" is forbidden: User "{SA}" cannot get '
                'resource "pods/log" in API group "" in the namespace "team"',
            ),
            (
                lambda: api.list_cluster_custom_object("kubeflow.org", "v1", "pytorchjobs"),
                f'pytorchjobs.kubeflow.org is forbidden: User "{SA}" cannot list '
                'resource "pytorchjobs" in API group "kubeflow.org" at the cluster scope',
            ),
        ]
        for call, message in refused:
            with pytest.raises(ApiException) as info:
                call()
            assert info.value.status == 403
            status = json.loads(info.value.body)
            assert (status["reason"], status["message"]) == ("Forbidden", message)
        assert [d.attributes.verb for d in fake.forbidden] == ["delete", "watch", "get", "list"]
        assert fake.get_object("pytorchjobs", "a", "team") is not None
        fake.delete_object("pytorchjobs", "a", "team")  # test controls bypass RBAC


def test_test_controls_validate_and_call_back(fake_k8s: FakeK8s) -> None:
    deleted: list[str] = []
    fake_k8s.on_delete("pods", lambda fake, obj: deleted.append(obj["metadata"]["name"]))
    job = fake_k8s.create_object("pytorchjobs", job_body("a"))
    fake_k8s.add_pod("default", "a-0", {}, owner=job)
    with pytest.raises(ApiError) as info:
        fake_k8s.create_object("pytorchjobs", {**job_body("b"), "spec": {}})
    assert info.value.code == 422
    assert [o["metadata"]["name"] for o in fake_k8s.list_objects("pytorchjobs")] == ["a"]
    fake_k8s.delete_object("pytorchjobs", "a")
    assert deleted == ["a-0"]
    assert fake_k8s.list_objects("pods") == []
