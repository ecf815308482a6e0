"""Rules of the fake API server (and its RBAC, schema and work-queue helpers) that no other
test pins: each test here is named by a row of tests/fakes/UPSTREAM.md, and fails when the
fake stops doing what the upstream line that row cites does."""

from __future__ import annotations

import json
import re
import types
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from fakes.fake_k8s import FakeK8s
from fakes.k8s_rbac import Attributes, Rule, verb_of
from fakes.sim_base import Controller
from kubellm.backends.base import TrainJob, TuneRequest
from kubellm.backends.kubernetes.katib import build_experiment
from kubellm.backends.kubernetes.pytorchjob import pytorchjob_manifest
from kubellm.tune.search import SearchParam

JOBS = ("kubeflow.org", "v1", "default", "pytorchjobs")


def job(name: str = "j") -> dict[str, Any]:
    body = pytorchjob_manifest(TrainJob(name=name, image="img", train_args=[], nnodes=2))
    del body["metadata"]["namespace"]  # the URL's
    return body


def experiment(name: str = "e") -> dict[str, Any]:
    trial = TrainJob(name=name, image="img", train_args=["--lr", "x"], nnodes=1)
    space = [SearchParam("lr", 0.001, 0.1)]
    return build_experiment(TuneRequest(name=name, trial_job=trial, space=space, max_trials=2))


def test_create_is_what_the_registry_does() -> None:
    with FakeK8s(rbac=None) as fake:
        api = k8s.CustomObjectsApi(fake.api_client())
        core = k8s.CoreV1Api(fake.api_client())
        # names.SimpleNameGenerator: the prefix and 5 random characters
        body = job()
        del body["metadata"]["name"]
        body["metadata"]["generateName"] = "job-"
        made = api.create_namespaced_custom_object(*JOBS, body)
        assert re.fullmatch(r"job-[a-z0-9]{5}", made["metadata"]["name"])
        # the custom resource strategy: create cannot set status; generation starts at 1
        with_status = {**job("s"), "status": {"conditions": []}}
        made = api.create_namespaced_custom_object(*JOBS, with_status)
        assert "status" not in made and made["metadata"]["generation"] == 1
        # NewAlreadyExists
        with pytest.raises(ApiException) as info:
            api.create_namespaced_custom_object(*JOBS, job("s"))
        assert info.value.status == 409
        assert json.loads(info.value.body)["message"] == (
            'pytorchjobs.kubeflow.org "s" already exists'
        )
        # EnsureObjectNamespaceMatchesRequestNamespace
        elsewhere = job("o")
        elsewhere["metadata"]["namespace"] = "other"
        with pytest.raises(ApiException) as info:
            api.create_namespaced_custom_object(*JOBS, elsewhere)
        assert info.value.status == 400
        assert "does not match the namespace sent on the request" in info.value.body
        # ValidateObjectMetaAccessor(NameIsDNSSubdomain)
        bad_name = job()
        bad_name["metadata"]["name"] = "Not_DNS"
        with pytest.raises(ApiException) as info:
            api.create_namespaced_custom_object(*JOBS, bad_name)
        assert info.value.status == 422 and "DNS-1123 subdomain" in info.value.body
        # the pod strategy: a created pod is Pending, whatever status it was sent with
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "main", "image": "img"}]},
            "status": {"phase": "Running"},
        }
        assert core.create_namespaced_pod("default", pod).status.phase == "Pending"


def _patch(fake: FakeK8s, content_type: str, body: Any, path: str = "") -> int:
    return _patch_reply(fake, content_type, body, path)[0]


def _patch_reply(
    fake: FakeK8s, content_type: str, body: Any, path: str = ""
) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        fake.url + (path or "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/j"),
        data=json.dumps(body).encode(),
        method="PATCH",
        headers={"Content-Type": content_type},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_only_merge_patch_is_served() -> None:
    with FakeK8s(rbac=None) as fake:
        fake.create_object("pytorchjobs", job())
        labels = {"metadata": {"labels": {"a": "b"}}}
        assert _patch(fake, "application/merge-patch+json", labels) == 200
        assert (fake.get_object("pytorchjobs", "j") or {})["metadata"]["labels"]["a"] == "b"
        # PatchResource drops a "; charset=" parameter before it compares the media type
        assert _patch(fake, "application/merge-patch+json; charset=utf-8", labels) == 200
        # stricter than a CRD's handler (which also takes JSON patch): see UPSTREAM.md
        op = [{"op": "add", "path": "/metadata/labels/c", "value": "d"}]
        code, body = _patch_reply(fake, "application/json-patch+json", op)
        assert code == 415 and body["reason"] == "UnsupportedMediaType"
        assert "applies only application/merge-patch+json" in body["message"]


def test_strategic_merge_patch_is_refused_on_custom_resources() -> None:
    with FakeK8s(rbac=None) as fake:
        fake.create_object("pytorchjobs", job())
        labels = {"metadata": {"labels": {"a": "b"}}}
        code, body = _patch_reply(fake, "application/strategic-merge-patch+json", labels)
        assert (code, body["reason"], body["code"]) == (415, "UnsupportedMediaType", 415)
        assert body["message"] == (
            "the body of the request was in an unknown format - accepted media types include: "
            "application/json-patch+json, application/merge-patch+json, "
            "application/apply-patch+yaml"
        )
        assert "a" not in (fake.get_object("pytorchjobs", "j") or {})["metadata"]["labels"]
        # the media type is checked before the object is looked up: 415, not 404
        missing = "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/nope"
        assert _patch(fake, "application/strategic-merge-patch+json", labels, missing) == 415
    # RBAC (a filter) answers before the handler: a refused patch is 403, not 415
    with FakeK8s() as fake:
        fake.create_object("pytorchjobs", job())
        assert _patch(fake, "application/strategic-merge-patch+json", labels) == 403


def test_a_pods_strategic_merge_patch_is_served_upstream_but_not_applied_here() -> None:
    with FakeK8s(rbac=None) as fake:
        fake.add_pod("default", "p", {})
        labels = {"metadata": {"labels": {"a": "b"}}}
        pod = "/api/v1/namespaces/default/pods/p"
        # the built-in kinds' handler serves strategic merge patch; the fake refuses it
        code, body = _patch_reply(fake, "application/strategic-merge-patch+json", labels, pod)
        assert code == 415 and "applies only application/merge-patch+json" in body["message"]
        # a media type no handler serves gets upstream's list of the built-in kinds' types
        code, body = _patch_reply(fake, "application/json", labels, pod)
        assert code == 415 and body["message"].endswith(
            "application/json-patch+json, application/merge-patch+json, "
            "application/strategic-merge-patch+json, application/apply-patch+yaml"
        )
        assert _patch(fake, "application/merge-patch+json", labels, pod) == 200


def test_the_status_subresource_changes_only_the_status() -> None:
    with FakeK8s(rbac=None) as fake:
        api = k8s.CustomObjectsApi(fake.api_client())
        made = api.create_namespaced_custom_object(*JOBS, job())
        sent = json.loads(json.dumps(made))
        sent["spec"]["runPolicy"] = {"backoffLimit": 9}
        sent["status"] = {"conditions": [], "replicaStatuses": {}}
        after = api.replace_namespaced_custom_object_status(*JOBS, "j", sent)
        assert after["status"] == {"conditions": [], "replicaStatuses": {}}
        assert after["spec"] == made["spec"]
        assert after["metadata"]["generation"] == 1


@dataclass
class VerbCase:
    method: str
    named: bool
    query: dict[str, list[str]]
    verb: str


@pytest.mark.parametrize(
    "case",
    [
        VerbCase("POST", False, {}, "create"),
        VerbCase("GET", True, {}, "get"),
        VerbCase("GET", False, {}, "list"),
        VerbCase("GET", False, {"watch": ["true"]}, "watch"),
        VerbCase("GET", False, {"watch": ["1"]}, "watch"),
        VerbCase("GET", False, {"watch": ["false"]}, "list"),
        VerbCase("PUT", True, {}, "update"),
        VerbCase("PATCH", True, {}, "patch"),
        VerbCase("DELETE", True, {}, "delete"),
        VerbCase("DELETE", False, {}, "deletecollection"),
    ],
    ids=lambda c: f"{c.method}-{'named' if c.named else 'collection'}-{c.verb}",
)
def test_requestinfo_verbs(case: VerbCase) -> None:
    assert verb_of(case.method, case.named, case.query) == case.verb


def _attrs(verb: str, resource: str, sub: str = "", name: str = "", group: str = "") -> Attributes:
    return Attributes(verb, group, resource, sub, "ns", name)


def test_rbac_rule_matching() -> None:
    anything = Rule(("*",), ("*",), ("*",))
    assert anything.allows(_attrs("delete", "pods", "log", group="x"))
    statuses = Rule(("kubeflow.org",), ("*/status",), ("get",))
    assert statuses.allows(_attrs("get", "pytorchjobs", "status", group="kubeflow.org"))
    assert not statuses.allows(_attrs("get", "pytorchjobs", group="kubeflow.org"))
    assert not statuses.allows(_attrs("get", "pytorchjobs", "scale", group="kubeflow.org"))
    # a resource rule names the subresource: pods does not grant pods/log
    pods = Rule(("",), ("pods",), ("get",))
    assert pods.allows(_attrs("get", "pods", name="p"))
    assert not pods.allows(_attrs("get", "pods", "log", name="p"))
    # resourceNames: only those names; a request without a name never matches
    named = Rule(("",), ("configmaps",), ("get",), ("kfp-launcher",))
    assert named.allows(_attrs("get", "configmaps", name="kfp-launcher"))
    assert not named.allows(_attrs("get", "configmaps", name="other"))
    assert not named.allows(_attrs("list", "configmaps"))
    assert not pods.allows(_attrs("get", "pods", group="apps"))


WebhookMutation = Callable[[dict[str, Any]], None]


@dataclass
class WebhookCase:
    name: str
    plural: str
    mutate: WebhookMutation
    message: str


def _replica(name: str) -> WebhookMutation:
    def mutate(b: dict[str, Any]) -> None:
        specs = b["spec"]["pytorchReplicaSpecs"]
        specs[name] = specs.pop("Worker")

    return mutate


def _trial_params(b: dict[str, Any]) -> list[dict[str, Any]]:
    params: list[dict[str, Any]] = b["spec"]["trialTemplate"]["trialParameters"]
    return params


WEBHOOK_CASES = [
    WebhookCase(
        "job-name-dns-1035",
        "pytorchjobs",
        lambda b: b["metadata"].update(name="9job"),
        "DNS-1035",
    ),
    WebhookCase("job-replica-type", "pytorchjobs", _replica("Chief"), "unsupported replica type"),
    WebhookCase(
        "job-restart-policy",
        "pytorchjobs",
        lambda b: b["spec"]["pytorchReplicaSpecs"]["Master"].update(restartPolicy="Sometimes"),
        "Master.restartPolicy: unsupported value Sometimes",
    ),
    WebhookCase(
        "job-two-masters",
        "pytorchjobs",
        lambda b: b["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=2),
        "Master.replicas: must be 1",
    ),
    WebhookCase(
        "experiment-name-over-40",
        "experiments",
        lambda b: b["metadata"].update(name="e" * 41),
        "longer than 40 characters",
    ),
    WebhookCase(
        "experiment-name-letter-first",
        "experiments",
        lambda b: b["metadata"].update(name="1e"),
        "must start with a letter",
    ),
    WebhookCase(
        "experiment-max-trials-0",
        "experiments",
        lambda b: b["spec"].update(maxTrialCount=0),
        "maxTrialCount: must be greater than 0",
    ),
    WebhookCase(
        "experiment-objective-type",
        "experiments",
        lambda b: b["spec"]["objective"].update(type="lowest"),
        "must be minimize or maximize",
    ),
    WebhookCase(
        "experiment-no-algorithm",
        "experiments",
        lambda b: b["spec"]["algorithm"].update(algorithmName=""),
        "algorithmName: Required value",
    ),
    WebhookCase(
        "experiment-inverted-range",
        "experiments",
        lambda b: b["spec"]["parameters"][0]["feasibleSpace"].update(min="0.5", max="0.1"),
        "must be below max",
    ),
    WebhookCase(
        "experiment-no-failure-condition",
        "experiments",
        lambda b: b["spec"]["trialTemplate"].update(failureCondition=""),
        "successCondition and failureCondition must be specified",
    ),
    WebhookCase(
        "experiment-unused-trial-parameter",
        "experiments",
        lambda b: _trial_params(b).append({"name": "unused", "reference": "lr"}),
        "unused is not used in trialSpec",
    ),
]


@pytest.mark.parametrize("case", WEBHOOK_CASES, ids=lambda c: c.name)
def test_the_webhooks_refuse(case: WebhookCase, fake_k8s: FakeK8s) -> None:
    body = job() if case.plural == "pytorchjobs" else experiment()
    body["metadata"].setdefault("name", "j")
    assert fake_k8s.validate(case.plural, body) == []
    case.mutate(body)
    errors = fake_k8s.validate(case.plural, body)
    assert any(case.message in e for e in errors), errors


class _Queue(Controller):
    name = "queue"


def test_workqueue_dedups_add_and_keeps_every_add_after() -> None:
    queue = _Queue(types.SimpleNamespace(fake=None))  # type: ignore[arg-type]
    key = ("pods", "ns", "p")
    queue.enqueue(key)
    queue.enqueue(key)  # Add while the key waits: deduplicated (queue.go q.dirty.has)
    assert len(queue._heap) == 1
    queue.enqueue(key, after_s=60)
    queue.enqueue(key, after_s=120)  # AddAfter: every one scheduled (see UPSTREAM.md)
    assert len(queue._heap) == 3
    queue._heap.sort()
    queue._heap.pop(0)
    queue._immediate.discard(key)  # what _run does when it takes the key
    queue.enqueue(key)  # once taken, an Add queues it again
    assert len(queue._heap) == 3


def test_delete_options_are_validated_before_the_object_is_looked_up() -> None:
    """delete.go: ValidateDeleteOptions, 422 DeleteOptions.meta.k8s.io "" is invalid."""
    with FakeK8s(rbac=None) as fake:
        api = k8s.CustomObjectsApi(fake.api_client())
        fake.create_object("pytorchjobs", job())
        for name in ("j", "missing"):  # the options first: 422 even for a missing object
            with pytest.raises(ApiException) as info:
                api.delete_namespaced_custom_object(*JOBS, name, propagation_policy="Later")
            assert info.value.status == 422
            assert json.loads(info.value.body)["message"] == (
                'DeleteOptions.meta.k8s.io "" is invalid: propagationPolicy: Unsupported value: '
                '"Later": supported values: "Foreground", "Background", "Orphan", "nil"'
            )
        both = k8s.V1DeleteOptions(propagation_policy="Orphan", orphan_dependents=True)
        with pytest.raises(ApiException) as info:
            api.delete_namespaced_custom_object(*JOBS, "j", body=both)
        assert info.value.status == 422
        assert "orphanDependents and deletionPropagation cannot be both set" in str(
            json.loads(info.value.body)["message"]
        )
        assert fake.get_object("pytorchjobs", "j") is not None
        api.delete_namespaced_custom_object(*JOBS, "j", propagation_policy="Orphan")
        assert fake.get_object("pytorchjobs", "j") is None
