"""Kubernetes Pod Security Standards, the checks that matter for kubellm's pods.

`psa_violations(pod_spec, level)` says what in a pod spec the Pod Security admission
controller would reject in a namespace whose `pod-security.kubernetes.io/enforce` label is
`level` ("privileged", "baseline" or "restricted"). It follows the published standard,
https://kubernetes.io/docs/concepts/security/pod-security-standards/ , and the controls
of its reference implementation (k8s.io/pod-security-admission, `policy/check_*.go`) for
the current policy version. Use it on the pod templates kubellm generates (PyTorchJob
replicas, Katib trial templates, InferenceService predictors) against the enforce level of
the overlay they will run under.

Controls implemented (each message starts with the control's name):

baseline
  - host namespaces: spec.hostNetwork / hostPID / hostIPC must be unset or false
  - privileged containers: securityContext.privileged must be unset or false
  - capabilities: capabilities.add only from the default set BASELINE_CAPABILITIES
  - hostPath volumes: none
  - host ports: containers[*].ports[*].hostPort unset or 0
  - seccomp: the type may not be Unconfined (pod or container)
  - /proc mount type: securityContext.procMount unset or Default
  - hostProcess (Windows): windowsOptions.hostProcess unset or false
restricted (everything in baseline, plus)
  - volume types: only configMap, csi, downwardAPI, emptyDir, ephemeral,
    persistentVolumeClaim, projected, secret
  - privilege escalation: allowPrivilegeEscalation must be false on every container
  - running as non-root: runAsNonRoot true on the pod or on every container, and false
    nowhere
  - running as non-root user: runAsUser, where set, is not 0
  - seccomp: RuntimeDefault or Localhost, on the pod or on every container
  - capabilities: drop must include ALL; add only NET_BIND_SERVICE

Not implemented, because nothing kubellm generates sets them: AppArmor annotations and
fields, SELinux options, sysctls. A spec that sets those is not judged here.

All container kinds count: containers, initContainers and ephemeralContainers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

LEVELS = ("privileged", "baseline", "restricted")

# The container runtime's default capabilities, which baseline lets a container add back.
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# Volume sources restricted allows: the core types, and persistent volumes the cluster
# administrator set up (PVCs, ephemeral PVC templates, CSI).
RESTRICTED_VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
_CONTAINER_KINDS = ("initContainers", "containers", "ephemeralContainers")


def _containers(pod: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in _CONTAINER_KINDS:
        for c in pod.get(kind) or []:
            yield f"{kind}[{c.get('name', '?')}]", c


def _sc(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("securityContext") or {}


def _baseline(pod: dict[str, Any]) -> list[str]:
    out: list[str] = []
    pod_sc = _sc(pod)
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            out.append(f"host namespaces: spec.{flag} is true")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("hostProcess: spec.securityContext.windowsOptions.hostProcess is true")
    if (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append("seccomp: spec.securityContext.seccompProfile.type is Unconfined")
    for vol in pod.get("volumes") or []:
        if "hostPath" in vol:
            out.append(f"hostPath volumes: volume {vol.get('name')!r} is a hostPath")
    for who, c in _containers(pod):
        sc = _sc(c)
        if sc.get("privileged"):
            out.append(f"privileged containers: {who} is privileged")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            extra = sorted(added - BASELINE_CAPABILITIES)
            out.append(f"capabilities: {who} adds {extra}, outside baseline's default set")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"host ports: {who} uses hostPort {port['hostPort']}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"seccomp: {who} seccompProfile.type is Unconfined")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"/proc mount type: {who} procMount is {sc['procMount']}")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"hostProcess: {who} windowsOptions.hostProcess is true")
    return out


def _restricted(pod: dict[str, Any]) -> list[str]:
    out: list[str] = []
    pod_sc = _sc(pod)
    for vol in pod.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if kinds - RESTRICTED_VOLUME_TYPES:
            out.append(
                f"volume types: volume {vol.get('name')!r} is {sorted(kinds)}, "
                f"not one of {sorted(RESTRICTED_VOLUME_TYPES)}"
            )
    pod_non_root = pod_sc.get("runAsNonRoot")
    if pod_non_root is False:
        out.append("running as non-root: spec.securityContext.runAsNonRoot is false")
    if pod_sc.get("runAsUser") == 0:
        out.append("running as non-root user: spec.securityContext.runAsUser is 0")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    for who, c in _containers(pod):
        sc = _sc(c)
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"privilege escalation: {who} allowPrivilegeEscalation is not false")
        non_root = sc.get("runAsNonRoot")
        if non_root is False:
            out.append(f"running as non-root: {who} runAsNonRoot is false")
        elif non_root is None and pod_non_root is not True:
            out.append(f"running as non-root: {who} nor the pod sets runAsNonRoot true")
        if sc.get("runAsUser") == 0:
            out.append(f"running as non-root user: {who} runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"seccomp: {who} nor the pod sets seccompProfile RuntimeDefault/Localhost")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"capabilities: {who} does not drop ALL")
        added = set(caps.get("add") or [])
        if added - RESTRICTED_CAPABILITIES:
            extra = sorted(added - RESTRICTED_CAPABILITIES)
            out.append(f"capabilities: {who} adds {extra}; restricted allows NET_BIND_SERVICE")
    return out


def psa_violations(pod_spec: dict[str, Any], level: str) -> list[str]:
    """What in `pod_spec` (a PodSpec: containers, volumes, securityContext, ...) breaks
    the Pod Security Standard `level`; empty when the pod would be admitted."""
    if level not in LEVELS:
        raise ValueError(f"unknown Pod Security level {level!r}; one of {LEVELS}")
    if level == "privileged":
        return []
    out = _baseline(pod_spec)
    if level == "restricted":
        out += [v for v in _restricted(pod_spec) if v not in out]
    return out
