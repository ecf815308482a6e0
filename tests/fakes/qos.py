"""Pod QoS class as the API server computes it (`status.qosClass`), for the fake API server.

A FAKE's helper, for tests only. The API server sets `status.qosClass` once, when a pod is
created (kubernetes/kubernetes pkg/registry/core/pod/strategy.go `PrepareForCreate`:
`QOSClass: qos.GetPodQOS(pod)`, L92 at 008b3652), and keeps it on every later status write
(`podStatusStrategy.PrepareForUpdate`: "the Pod QoS is immutable and populated at creation
time by the kube-apiserver"; an update without it gets the old one back). The kubelet's
evictions and CPU manager read that class.

`pod_qos` is upstream's `ComputePodQOS` (pkg/apis/core/helper/qos/qos.go; the copy cited is
kubernetes/kubectl pkg/util/qos/qos.go@v0.32.0, L84-L136, the staging mirror of Kubernetes
v1.32.0, which its comment says is kept identical):

- only cpu and memory count (GPUs, RDMA devices and other extended resources never do);
  quantities of zero are ignored;
- every container counts, init containers included (ephemeral ones cannot have resources);
- BestEffort: no container requests or limits cpu or memory;
- Guaranteed: every container (init containers too) has a limit for both cpu and memory, and
  the pod's summed requests equal its summed limits for each (a request left out is the
  limit: the API server's defaulting, pkg/apis/core/v1/defaults.go SetDefaults_Pod, copies
  limits into missing requests before PrepareForCreate runs, so the fake does the same; read
  through the search index, not at a tag);
- Burstable: anything else.

Simplified: pod-level `spec.resources` (the PodLevelResources feature, alpha in 1.32) is
not modelled; a pod that sets it is refused with a ValueError rather than misclassified.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

GUARANTEED = "Guaranteed"
BURSTABLE = "Burstable"
BEST_EFFORT = "BestEffort"
QOS_RESOURCES = ("cpu", "memory")  # supportedQoSComputeResources


def _amounts(resources: dict[str, Any] | None) -> dict[str, Decimal]:
    """The non-zero cpu and memory quantities of a requests or limits map."""
    out = {}
    for name, value in (resources or {}).items():
        if name in QOS_RESOURCES and (amount := parse_quantity(value)) > 0:
            out[name] = amount
    return out


def pod_qos(pod: dict[str, Any]) -> str:
    """`ComputePodQOS` of a pod body (its `spec`); see the module docstring."""
    spec = pod.get("spec") or {}
    if spec.get("resources"):
        raise ValueError("pod-level spec.resources is not modelled by tests/fakes/qos.py")
    requests: dict[str, Decimal] = {}
    limits: dict[str, Decimal] = {}
    guaranteed = True
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        res = container.get("resources") or {}
        own_limits = _amounts(res.get("limits"))
        # SetDefaults_Pod: a container's missing request defaults to its limit.
        own_requests = {**own_limits, **_amounts(res.get("requests"))}
        for name, amount in own_requests.items():
            requests[name] = requests.get(name, Decimal(0)) + amount
        for name, amount in own_limits.items():
            limits[name] = limits.get(name, Decimal(0)) + amount
        if not set(QOS_RESOURCES) <= own_limits.keys():
            guaranteed = False
    if not requests and not limits:
        return BEST_EFFORT
    if guaranteed and any(limits.get(name) != amount for name, amount in requests.items()):
        guaranteed = False
    if guaranteed and len(requests) == len(limits):
        return GUARANTEED
    return BURSTABLE
