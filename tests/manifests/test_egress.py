"""overlays/restricted-egress: what its egress NetworkPolicies let the training pods and the
pipeline's step pods reach, decided by a small evaluator of NetworkPolicy egress rules
(`allows`), with the semantics of the Kubernetes API reference (networking.k8s.io/v1
NetworkPolicySpec, NetworkPolicyEgressRule, NetworkPolicyPeer, IPBlock, NetworkPolicyPort):

- a pod is isolated for egress when some policy of its namespace selects it and lists
  Egress in policyTypes; an isolated pod may reach a destination only when some egress
  rule of such a policy allows it; policies add up, none denies;
- a rule with no `to` allows every destination, with no `ports` every port; a port
  matches its protocol (TCP when unset) and the range port..endPort;
- a peer with only podSelector matches pods of the policy's namespace; with
  namespaceSelector, pods of the namespaces it selects (both fields: both must match);
- an ipBlock matches an address inside `cidr` and outside every `except` entry.

Named ports and pod IPs matched by an ipBlock (left to the network plugin) are not modelled.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubellm.backends.kubernetes.podspec import COMPONENT_LABEL

from .test_manifests import KUBECTL, MANIFESTS, NAMESPACE, by_kind, ident, needs_kubectl, render

OVERLAY = "overlays/restricted-egress"
# kubeflow/pipelines backend/src/v2/compiler/argocompiler/argo.go: Argo puts the Workflow's
# spec.podMetadata labels on every pod of a KFP v2 run.
KFP_STEP_LABELS = {"pipelines.kubeflow.org/v2_component": "true"}
TRAINING_LABELS = dict(COMPONENT_LABEL)
METADATA = "169.254.169.254"
NS_NAME = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Dest:
    """Where a packet goes: an address (outside the pod network) or a pod with its labels and
    its namespace's labels."""

    port: int
    protocol: str = "TCP"
    ip: str | None = None
    pod_labels: dict[str, str] | None = None
    namespace_labels: dict[str, str] = field(default_factory=dict)

    @property
    def namespace(self) -> str | None:
        return self.namespace_labels.get(NS_NAME)


def pod_in(namespace: str, port: int, protocol: str = "TCP", **labels: str) -> Dest:
    return Dest(port, protocol, pod_labels=labels, namespace_labels={NS_NAME: namespace})


def address(ip: str, port: int, protocol: str = "TCP") -> Dest:
    return Dest(port, protocol, ip=ip)


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions, ANDed; {} selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], dest: Dest, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        if dest.ip is None:
            return False
        ip = ipaddress.ip_address(dest.ip)
        block = peer["ipBlock"]
        if ip not in ipaddress.ip_network(block["cidr"], strict=False):
            return False
        return not any(
            ip in ipaddress.ip_network(e, strict=False) for e in block.get("except") or []
        )
    if dest.pod_labels is None:  # an address that is no pod: only an ipBlock matches it
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], dest.namespace_labels):
            return False
    elif dest.namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector"), dest.pod_labels)


def _port_matches(port: dict[str, Any], dest: Dest) -> bool:
    if port.get("protocol", "TCP") != dest.protocol:
        return False
    if "port" not in port:
        return True
    number = port["port"]
    if not isinstance(number, int):
        return False  # a named port: not modelled, never matches an address
    return number <= dest.port <= port.get("endPort", number)


def egress_policies(objects: list[dict[str, Any]], pod_labels: dict[str, str]) -> list[dict]:
    return [
        p
        for p in by_kind(objects, "NetworkPolicy")
        if "Egress" in (p["spec"].get("policyTypes") or [])
        and selects(p["spec"].get("podSelector"), pod_labels)
    ]


def allows(objects: list[dict[str, Any]], pod_labels: dict[str, str], dest: Dest) -> bool:
    """Whether a pod of the namespace with `pod_labels` may send to `dest`."""
    policies = egress_policies(objects, pod_labels)
    if not policies:
        return True  # not isolated for egress
    for policy in policies:
        ns = policy["metadata"].get("namespace", NAMESPACE)
        for rule in policy["spec"].get("egress") or []:
            peers, ports = rule.get("to"), rule.get("ports")
            if peers and not any(_peer_matches(p, dest, ns) for p in peers):
                continue
            if ports and not any(_port_matches(p, dest) for p in ports):
                continue
            return True
    return False


# --------------------------------------------------------------------------- the evaluator


def _policy(*rules: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "kind": "NetworkPolicy",
            "metadata": {"name": "p", "namespace": NAMESPACE},
            "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": list(rules)},
        }
    ]


@pytest.mark.parametrize(
    ("rules", "dest", "allowed"),
    [
        ((), address("8.8.8.8", 443), False),  # isolated, no rule: nothing
        (({},), address("8.8.8.8", 1), True),  # an empty rule: everything
        (
            ({"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}}]},),
            address(METADATA, 80),
            False,
        ),
        (
            ({"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}}]},),
            address("8.8.8.8", 80),
            True,
        ),
        (
            ({"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "ports": [{"port": 443}]},),
            address("10.1.2.3", 443, "UDP"),
            False,
        ),  # the protocol defaults to TCP
        (({"ports": [{"port": 8000, "endPort": 8100}]},), address("1.1.1.1", 8050), True),
        (({"ports": [{"port": 8000, "endPort": 8100}]},), address("1.1.1.1", 8101), False),
        (({"to": [{"podSelector": {}}]},), address("10.0.0.5", 80), False),  # not a pod
        (({"to": [{"podSelector": {}}]},), pod_in(NAMESPACE, 80), True),
        (({"to": [{"podSelector": {}}]},), pod_in("other", 80), False),  # own namespace only
        (
            ({"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"a": "b"}}}]},),
            pod_in("other", 80, a="c"),
            False,
        ),  # both selectors must match
        (
            (
                {
                    "to": [
                        {
                            "namespaceSelector": {
                                "matchExpressions": [
                                    {"key": NS_NAME, "operator": "In", "values": ["kube-system"]}
                                ]
                            }
                        }
                    ]
                },
            ),
            pod_in("kube-system", 53, "UDP"),
            True,
        ),
    ],
)
def test_the_evaluator(rules: tuple[dict[str, Any], ...], dest: Dest, allowed: bool) -> None:
    assert allows(_policy(*rules), {}, dest) is allowed


def test_an_unselected_pod_is_not_isolated() -> None:
    objects = _policy()
    objects[0]["spec"]["podSelector"] = {"matchLabels": {"x": "y"}}
    assert allows(objects, {"x": "y"}, address(METADATA, 80)) is False
    assert allows(objects, {}, address(METADATA, 80)) is True


# --------------------------------------------------------------------------- the overlay

SELECTED = {"training pods": TRAINING_LABELS, "pipeline step pods": KFP_STEP_LABELS}


@needs_kubectl
@pytest.mark.parametrize("who", SELECTED)
def test_egress_policies_select_training_and_step_pods(who: str) -> None:
    policies = egress_policies(render(OVERLAY), SELECTED[who])
    assert policies, f"no egress NetworkPolicy selects the {who}"
    # the base has none: egress there is open, as manifests/README.md says
    assert egress_policies(render("base"), SELECTED[who]) == []
    # the MLflow server and model servers are not selected (KServe's ingress and the
    # storage initializer reach out from them)
    assert egress_policies(render(OVERLAY), {"app.kubernetes.io/name": "mlflow"}) == []


@needs_kubectl
@pytest.mark.parametrize("who", SELECTED)
@pytest.mark.parametrize("protocol", ["UDP", "TCP"])
def test_dns_to_kube_dns_is_allowed(who: str, protocol: str) -> None:
    objects = render(OVERLAY)
    dns = pod_in("kube-system", 53, protocol, **{"k8s-app": "kube-dns"})
    assert allows(objects, SELECTED[who], dns)
    # only kube-system's DNS pods, only port 53
    assert not allows(
        objects, SELECTED[who], pod_in("default", 53, protocol, **{"k8s-app": "kube-dns"})
    )
    assert not allows(objects, SELECTED[who], pod_in("kube-system", 53, protocol, app="other"))
    assert not allows(
        objects, SELECTED[who], pod_in("kube-system", 54, protocol, **{"k8s-app": "kube-dns"})
    )
    assert not allows(objects, SELECTED[who], address("8.8.8.8", 53, protocol))


@needs_kubectl
@pytest.mark.parametrize("who", SELECTED)
def test_the_metadata_endpoint_and_the_internet_are_denied(who: str) -> None:
    objects = render(OVERLAY)
    for port in (80, 443, 8080):
        for protocol in ("TCP", "UDP"):
            assert not allows(objects, SELECTED[who], address(METADATA, port, protocol))
    assert not allows(objects, SELECTED[who], address("1.1.1.1", 443))
    # what it needs is allowed: MLflow, the namespace's other pods (ranks, model servers)
    mlflow = pod_in(NAMESPACE, 5000, **{"app.kubernetes.io/name": "mlflow"})
    assert allows(objects, SELECTED[who], mlflow)
    assert allows(objects, SELECTED[who], pod_in(NAMESPACE, 29500, **TRAINING_LABELS))


@needs_kubectl
def test_only_step_pods_reach_the_api_server_and_kubeflow_pipelines() -> None:
    objects = render(OVERLAY)
    params = _params(MANIFESTS / OVERLAY / "kustomization.yaml")
    api = str(ipaddress.ip_network(params["apiServerCIDR"])[0])
    kubeflow = params["kubeflowNamespace"]
    for port in (443, 6443):
        assert allows(objects, KFP_STEP_LABELS, address(api, port))
        assert not allows(objects, TRAINING_LABELS, address(api, port))
    assert allows(objects, KFP_STEP_LABELS, pod_in(kubeflow, 8887, app="ml-pipeline"))
    assert not allows(objects, KFP_STEP_LABELS, pod_in(kubeflow, 3306, app="mysql"))
    assert not allows(objects, TRAINING_LABELS, pod_in(kubeflow, 8887, app="ml-pipeline"))
    # Katib's metrics collector in trial pods
    assert allows(objects, TRAINING_LABELS, pod_in(kubeflow, 6789, app="katib-db-manager"))


# --------------------------------------------------------------------------- parameters


def _params(kustomization: Path) -> dict[str, str]:
    doc = yaml.safe_load(kustomization.read_text(encoding="utf-8"))
    (gen,) = [g for g in doc["configMapGenerator"] if g["name"] == "kubellm-params"]
    return dict(lit.split("=", 1) for lit in gen["literals"])


def _render_with(tmp_path: Path, **values: str) -> list[dict[str, Any]]:
    """The overlay rendered from a copy of manifests/ whose overlay sets `values`."""
    assert KUBECTL is not None
    copy = tmp_path / "manifests"
    shutil.copytree(MANIFESTS, copy)
    path = copy / OVERLAY / "kustomization.yaml"
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    (gen,) = [g for g in doc["configMapGenerator"] if g["name"] == "kubellm-params"]
    params = {**dict(lit.split("=", 1) for lit in gen["literals"]), **values}
    gen["literals"] = [f"{k}={v}" for k, v in params.items()]
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(copy / OVERLAY)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@needs_kubectl
def test_the_parameters_reach_the_rules(tmp_path: Path) -> None:
    defaults = _params(MANIFESTS / OVERLAY / "kustomization.yaml")
    changed = {
        "apiServerCIDR": "10.96.0.1/32",
        "dataStoreCIDR": "203.0.113.0/24",
        "kubeflowNamespace": "kfp",
        "servingGatewayNamespace": "kourier-system",
    }
    assert set(changed) == set(defaults) - {"workspaceSize"}, "a parameter is not tested"
    objects = _render_with(tmp_path, **changed)
    step, training = KFP_STEP_LABELS, TRAINING_LABELS

    assert allows(objects, step, address("10.96.0.1", 6443))
    assert not allows(objects, training, address("10.96.0.1", 6443))
    for who in (step, training):
        assert allows(objects, who, address("203.0.113.7", 443))
        assert not allows(objects, who, address("203.0.113.7", 80)), "443 only"
    # the defaults no longer apply anywhere
    for cidr in (defaults["apiServerCIDR"], defaults["dataStoreCIDR"]):
        ip = str(ipaddress.ip_network(cidr)[0])
        for who in (step, training):
            assert not allows(objects, who, address(ip, 443)), cidr
    assert allows(objects, step, pod_in("kfp", 8888, app="ml-pipeline"))
    assert not allows(objects, step, pod_in("kubeflow", 8888, app="ml-pipeline"))
    assert allows(objects, training, pod_in("kfp", 6789, app="katib-db-manager"))
    assert allows(objects, step, pod_in("kourier-system", 8081, app="3scale-kourier-gateway"))
    assert not allows(objects, step, pod_in("istio-system", 8081, app="knative-local-gateway"))
    assert not allows(objects, step, address(METADATA, 80))


@needs_kubectl
def test_a_broad_data_store_cidr_still_keeps_the_metadata_endpoints_port_80_closed(
    tmp_path: Path,
) -> None:
    """The data-store rule is 443 only: with 0.0.0.0/0 (which README.md warns against) the
    metadata endpoint's HTTP port (80, where AWS, GCP and Azure serve it) stays closed."""
    objects = _render_with(tmp_path, dataStoreCIDR="0.0.0.0/0")
    for who in SELECTED.values():
        assert not allows(objects, who, address(METADATA, 80))
        assert allows(objects, who, address(METADATA, 443))  # why README.md warns


@needs_kubectl
def test_the_overlay_adds_the_two_policies_and_changes_nothing_else() -> None:
    base = {ident(o): o for o in render("base")}
    overlay = {ident(o): o for o in render(OVERLAY)}
    added = sorted(set(overlay) - set(base))
    assert added == [
        f"NetworkPolicy/{NAMESPACE}/kubellm-pipeline-egress",
        f"NetworkPolicy/{NAMESPACE}/kubellm-training-egress",
    ]
    assert not set(base) - set(overlay)
    assert [k for k in base if base[k] != overlay[k]] == []
