"""psa.psa_violations against the Pod Security Standards' own examples of each control.

Cases follow https://kubernetes.io/docs/concepts/security/pod-security-standards/ (and
the reference checks in k8s.io/pod-security-admission/policy): each names the control, a
pod that breaks it, and the lowest level that admits the pod.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from .psa import BASELINE_CAPABILITIES, LEVELS, psa_violations

# A pod that meets "restricted": what kubellm's pod_security()/container_security() build.
RESTRICTED_POD: dict[str, Any] = {
    "securityContext": {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    },
    "initContainers": [
        {
            "name": "init",
            "image": "busybox:1.36",
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            },
        }
    ],
    "containers": [
        {
            "name": "main",
            "image": "ghcr.io/kubellm/trainer:0.1.0",
            "ports": [{"containerPort": 29500}],
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            },
        }
    ],
    "volumes": [
        {"name": "workspace", "persistentVolumeClaim": {"claimName": "kubellm-workspace"}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
        {"name": "config", "configMap": {"name": "kubellm-config"}},
    ],
}


def _pod(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    pod = copy.deepcopy(RESTRICTED_POD)
    change(pod)
    return pod


def _main(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["containers"][0]


def _main_sc(pod: dict[str, Any]) -> dict[str, Any]:
    return _main(pod)["securityContext"]


@dataclass(frozen=True)
class Case:
    what: str
    change: Callable[[dict[str, Any]], None]
    admitted_from: str  # the lowest level that admits the pod
    mentions: str  # words the violation message contains


CASES = [
    # -- baseline controls: only "privileged" admits these
    Case("hostNetwork", lambda p: p.update(hostNetwork=True), "privileged", "host namespaces"),
    Case("hostPID", lambda p: p.update(hostPID=True), "privileged", "hostPID"),
    Case("hostIPC", lambda p: p.update(hostIPC=True), "privileged", "hostIPC"),
    Case(
        "privileged container",
        lambda p: _main_sc(p).update(privileged=True),
        "privileged",
        "privileged containers",
    ),
    Case(
        "privileged init container",
        lambda p: p["initContainers"][0]["securityContext"].update(privileged=True),
        "privileged",
        "initContainers[init]",
    ),
    Case(
        "IPC_LOCK (RDMA)",
        lambda p: _main_sc(p)["capabilities"].update(add=["IPC_LOCK"]),
        "privileged",
        "IPC_LOCK",
    ),
    Case(
        "SYS_ADMIN",
        lambda p: _main_sc(p)["capabilities"].update(add=["SYS_ADMIN"]),
        "privileged",
        "SYS_ADMIN",
    ),
    Case(
        "hostPath volume",
        lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/dev/infiniband"}}),
        "privileged",
        "hostPath",
    ),
    Case(
        "hostPort",
        lambda p: _main(p)["ports"][0].update(hostPort=29500),
        "privileged",
        "hostPort",
    ),
    Case(
        "pod seccomp Unconfined",
        lambda p: p["securityContext"].update(seccompProfile={"type": "Unconfined"}),
        "privileged",
        "Unconfined",
    ),
    Case(
        "container seccomp Unconfined",
        lambda p: _main_sc(p).update(seccompProfile={"type": "Unconfined"}),
        "privileged",
        "Unconfined",
    ),
    Case(
        "procMount Unmasked",
        lambda p: _main_sc(p).update(procMount="Unmasked"),
        "privileged",
        "procMount",
    ),
    Case(
        "Windows hostProcess",
        lambda p: _main_sc(p).update(windowsOptions={"hostProcess": True}),
        "privileged",
        "hostProcess",
    ),
    Case(
        "ephemeral container privileged",
        lambda p: p.update(
            ephemeralContainers=[
                {"name": "debug", "image": "busybox:1.36", "securityContext": {"privileged": True}}
            ]
        ),
        "privileged",
        "ephemeralContainers[debug]",
    ),
    # -- restricted controls: "baseline" admits these, "restricted" does not
    Case(
        "CHOWN (in baseline's default set)",
        lambda p: _main_sc(p)["capabilities"].update(add=["CHOWN"]),
        "baseline",
        "CHOWN",
    ),
    Case(
        "capabilities not dropped",
        lambda p: _main_sc(p).update(capabilities={}),
        "baseline",
        "drop ALL",
    ),
    Case(
        "privilege escalation allowed",
        lambda p: _main_sc(p).update(allowPrivilegeEscalation=True),
        "baseline",
        "allowPrivilegeEscalation",
    ),
    Case(
        "privilege escalation unset",
        lambda p: _main_sc(p).pop("allowPrivilegeEscalation"),
        "baseline",
        "allowPrivilegeEscalation",
    ),
    Case(
        "runAsNonRoot unset",
        lambda p: p["securityContext"].pop("runAsNonRoot"),
        "baseline",
        "runAsNonRoot",
    ),
    Case(
        "container runAsNonRoot false",
        lambda p: _main_sc(p).update(runAsNonRoot=False),
        "baseline",
        "runAsNonRoot is false",
    ),
    Case(
        "runAsUser 0",
        lambda p: _main_sc(p).update(runAsUser=0),
        "baseline",
        "runAsUser is 0",
    ),
    Case(
        "seccomp unset",
        lambda p: p["securityContext"].pop("seccompProfile"),
        "baseline",
        "seccompProfile",
    ),
    Case(
        "nfs volume",
        lambda p: p["volumes"].append({"name": "n", "nfs": {"server": "x", "path": "/"}}),
        "baseline",
        "volume types",
    ),
]


@pytest.mark.parametrize("level", LEVELS)
def test_a_restricted_pod_is_admitted_everywhere(level: str) -> None:
    assert psa_violations(RESTRICTED_POD, level) == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.what)
def test_each_control(case: Case) -> None:
    pod = _pod(case.change)
    lowest = LEVELS.index(case.admitted_from)
    for i, level in enumerate(LEVELS):
        found = psa_violations(pod, level)
        if i <= lowest:
            assert found == [], (level, found)
        else:
            assert found, f"{case.what} passes {level}"
            assert any(case.mentions in v for v in found), found


def test_every_default_capability_passes_baseline() -> None:
    pod = _pod(lambda p: _main_sc(p)["capabilities"].update(add=sorted(BASELINE_CAPABILITIES)))
    assert psa_violations(pod, "baseline") == []
    assert psa_violations(pod, "restricted")


def test_restricted_allows_net_bind_service_and_container_level_settings() -> None:
    def change(p: dict[str, Any]) -> None:
        # Pod-level runAsNonRoot and seccomp moved onto every container instead.
        p["securityContext"] = {}
        for c in p["initContainers"] + p["containers"]:
            c["securityContext"].update(
                runAsNonRoot=True, seccompProfile={"type": "Localhost", "localhostProfile": "x"}
            )
        _main_sc(p)["capabilities"]["add"] = ["NET_BIND_SERVICE"]

    assert psa_violations(_pod(change), "restricted") == []


def test_container_level_settings_must_cover_every_container() -> None:
    def change(p: dict[str, Any]) -> None:
        p["securityContext"] = {}
        _main_sc(p).update(runAsNonRoot=True, seccompProfile={"type": "RuntimeDefault"})

    found = psa_violations(_pod(change), "restricted")
    assert any("initContainers[init]" in v and "runAsNonRoot" in v for v in found), found
    assert any("initContainers[init]" in v and "seccomp" in v for v in found), found


def test_unknown_level() -> None:
    with pytest.raises(ValueError, match="unknown Pod Security level"):
        psa_violations(RESTRICTED_POD, "strict")
