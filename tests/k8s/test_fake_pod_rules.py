"""Pod rules of fakes/fake_k8s.py that no other test pins (rows in
tests/fakes/UPSTREAM.md): the log's container selection and tail, and the pod field labels."""

from __future__ import annotations

import json

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from fakes.fake_k8s import FakeK8s

TWO = {"containers": [{"name": "pytorch", "image": "x"}, {"name": "sidecar", "image": "x"}]}


def test_a_pod_with_several_containers_needs_a_container_name_for_its_log(
    fake_k8s: FakeK8s,
) -> None:
    """strategy.go validateContainer: no default container when there are several."""
    core = k8s.CoreV1Api(fake_k8s.api_client())
    fake_k8s.add_pod("default", "p", {}, phase="Running", spec=TWO)
    fake_k8s.append_log("default", "p", "hello\n")
    with pytest.raises(ApiException) as info:
        core.read_namespaced_pod_log("p", "default")
    assert info.value.status == 400
    assert "a container name must be specified for pod p, choose one of: [pytorch sidecar]" in (
        info.value.body
    )
    assert core.read_namespaced_pod_log("p", "default", container="pytorch") == "hello\n"


def test_pod_field_selectors_take_the_pod_labels_and_refuse_others(fake_k8s: FakeK8s) -> None:
    """conversion.go's Pod field label conversion: spec.nodeName & co; others are 400."""
    core = k8s.CoreV1Api(fake_k8s.api_client())
    on_node = {"nodeName": "n1", "containers": [{"name": "main", "image": "x"}]}
    fake_k8s.add_pod("default", "a", {}, phase="Running", spec=on_node)
    fake_k8s.add_pod("default", "b", {}, phase="Running")
    pods = core.list_namespaced_pod("default", field_selector="spec.nodeName=n1").items
    assert [p.metadata.name for p in pods] == ["a"]
    pods = core.list_namespaced_pod("default", field_selector="spec.nodeName!=n1").items
    assert [p.metadata.name for p in pods] == ["b"]
    with pytest.raises(ApiException) as info:
        core.list_namespaced_pod("default", field_selector="spec.containers=main")
    assert info.value.status == 400 and "field label not supported" in info.value.body


def test_tail_lines_count_complete_lines_as_the_kubelets_log_reader_does(
    fake_k8s: FakeK8s,
) -> None:
    """cri-client logs: findTailLineStartIndex (a last line without "\\n" is not counted)
    and ReadLogs' limited mode (at most tailLines lines); ValidatePodLogOptions refuses a
    negative tailLines."""
    core = k8s.CoreV1Api(fake_k8s.api_client())
    fake_k8s.add_pod("default", "p", {}, phase="Running")
    fake_k8s.append_log("default", "p", "a\nb\nc")  # "c" is still being written

    def tail(n: int) -> str:
        data = core.read_namespaced_pod_log("p", "default", tail_lines=n, _preload_content=False)
        return str(data.data.decode())

    assert tail(1) == "b\n"  # the last complete line; the partial one is past the limit
    assert tail(2) == "a\nb\n"
    assert tail(5) == "a\nb\nc"  # fewer lines than asked: all of it
    assert tail(0) == ""
    with pytest.raises(ApiException) as info:
        tail(-1)
    assert info.value.status == 422
    assert json.loads(info.value.body)["message"] == (
        'PodLogOptions "p" is invalid: tailLines: Invalid value: -1: must be greater than or '
        "equal to 0"
    )


def test_the_sim_refuses_a_container_without_a_command() -> None:
    # sim-only: containerd falls back to the image's ENTRYPOINT (spec_opts.go WithProcessArgs);
    # the sim has no images, so a container must say what it runs
    from fakes.kubelet import Kubelet

    with pytest.raises(FileNotFoundError, match="no image ENTRYPOINT"):
        Kubelet._argv(None, {"name": "c", "args": ["x"]}, {}, {})  # type: ignore[arg-type]


def test_routing_answers_and_unparsable_watch_parameters() -> None:
    # get.go: ListOptions that do not decode are 400; crd handler: unserved version 404,
    # a verb it does not serve 405
    with FakeK8s(rbac=None) as fake:
        pods = "/api/v1/namespaces/d/pods"
        for query in ("timeoutSeconds=x", "resourceVersion=x"):
            code, _ = fake.handle("GET", f"{pods}?watch=true&{query}", None)
            assert code == 400, query
        assert fake.handle("GET", "/apis/kubeflow.org/v9/namespaces/d/pytorchjobs", None)[0] == 404
        assert fake.handle("GET", f"{pods}/p/exec", None)[0] == 404
        assert fake.handle("PUT", pods, {})[0] == 405
