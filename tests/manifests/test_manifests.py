"""The kustomize manifests: they render, validate against Kubernetes' own schemas, and keep
the security posture we promise (non-root, no escalation, least-privilege RBAC, no secrets).

Rendering needs `kubectl` (its built-in kustomize); without it those tests skip, saying so.
Schema validation uses `kubernetes-validate` (strict: unknown fields fail, as with
`kubectl apply --validate=strict`) at a pinned Kubernetes version.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
KUBERNETES_VERSION = "1.30.0"
NAMESPACE = "kubellm"
PART_OF = ("app.kubernetes.io/part-of", "kubellm")

KUSTOMIZATIONS = sorted(
    p.parent.relative_to(MANIFESTS).as_posix() for p in MANIFESTS.rglob("kustomization.yaml")
)
YAML_FILES = sorted(
    p.relative_to(MANIFESTS).as_posix()
    for p in MANIFESTS.rglob("*")
    if p.suffix in (".yaml", ".yml")
)

KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed: cannot render the kustomizations"
)

# Kinds whose objects carry a pod template (or are pods), and where the pod spec sits.
POD_SPEC_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": ("spec",),
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}

# Objects a namespaced Role cannot meaningfully grant, and that we must never touch.
CLUSTER_SCOPED_RESOURCES = {
    "namespaces",
    "nodes",
    "persistentvolumes",
    "storageclasses",
    "customresourcedefinitions",
    "clusterroles",
    "clusterrolebindings",
    "mutatingwebhookconfigurations",
    "validatingwebhookconfigurations",
    "priorityclasses",
    "runtimeclasses",
    "certificatesigningrequests",
    "apiservices",
}
CLUSTER_SCOPED_KINDS = {
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
}

# Exactly what the pipeline's Role grants: (apiGroup, resource) -> verbs.
EXPECTED_PIPELINE_RULES: dict[tuple[str, str], set[str]] = {
    ("kubeflow.org", "pytorchjobs"): {"create", "get", "list", "watch", "delete"},
    ("katib.kubeflow.org", "experiments"): {"create", "get", "list", "watch", "delete"},
    ("katib.kubeflow.org", "trials"): {"get", "list"},
    ("serving.kserve.io", "inferenceservices"): {
        "create",
        "get",
        "list",
        "watch",
        "delete",
        "patch",
    },
    ("", "pods"): {"get", "list"},
    ("", "pods/log"): {"get"},
}


# --------------------------------------------------------------------------- helpers


@functools.cache
def _render(kustomization: str) -> tuple[dict[str, Any], ...]:
    assert KUBECTL is not None
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(MANIFESTS / kustomization)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{proc.stderr}"
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d is not None]
    assert docs, f"{kustomization} renders to nothing"
    return tuple(docs)


def render(kustomization: str) -> list[dict[str, Any]]:
    return list(_render(kustomization))


def ident(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata", {})
    ns = meta.get("namespace")
    return f"{obj.get('kind')}/{ns + '/' if ns else ''}{meta.get('name')}"


def dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        path = POD_SPEC_PATHS.get(obj.get("kind", ""))
        if path is not None:
            spec = dig(obj, path)
            assert isinstance(spec, dict), f"{ident(obj)} has no pod spec at {'.'.join(path)}"
            yield ident(obj), spec


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def container_problems(pod: dict[str, Any]) -> list[str]:
    """What in a pod spec breaks our container security and resource rules."""
    problems: list[str] = []
    pod_sc = pod.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            problems.append(f"pod sets {flag}")
    for vol in pod.get("volumes") or []:
        if "hostPath" in vol:
            problems.append(f"volume {vol.get('name')} is a hostPath")
    containers = (pod.get("initContainers") or []) + (pod.get("containers") or [])
    if not containers:
        problems.append("pod has no containers")
    for c in containers:
        name = c.get("name")
        sc = c.get("securityContext") or {}
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            problems.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append(f"{name}: runAsUser is 0")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if (sc.get("capabilities") or {}).get("add"):
            problems.append(f"{name}: adds capabilities {sc['capabilities']['add']}")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: no RuntimeDefault/Localhost seccompProfile")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: readOnlyRootFilesystem is not true")
        resources = c.get("resources") or {}
        for section in ("requests", "limits"):
            for res in ("cpu", "memory"):
                if res not in (resources.get(section) or {}):
                    problems.append(f"{name}: no {section}.{res}")
        image = c.get("image", "")
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        if "@sha256:" not in image and (not tag or tag == "latest"):
            problems.append(f"{name}: image {image!r} is not pinned by tag or digest")
    return problems


def rbac_problems(role: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    for rule in role.get("rules") or []:
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            if any("*" in v for v in rule.get(field) or []):
                problems.append(f"wildcard in {field}: {rule}")
        for res in rule.get("resources") or []:
            if res.split("/")[0] in CLUSTER_SCOPED_RESOURCES:
                problems.append(f"cluster-scoped resource {res}")
            if res in ("secrets",):
                problems.append("access to secrets")
        for verb in rule.get("verbs") or []:
            if verb in ("bind", "escalate", "impersonate"):
                problems.append(f"privilege-granting verb {verb}")
        if rule.get("nonResourceURLs"):
            problems.append("nonResourceURLs in a Role")
    return problems


# --------------------------------------------------------------------------- every shipped file


def test_the_expected_manifests_are_shipped() -> None:
    assert {"base", "overlays/rdma"} <= set(KUSTOMIZATIONS)
    assert "README.md" in {p.name for p in MANIFESTS.iterdir()}
    assert (MANIFESTS / "overlays" / "rdma" / "README.md").is_file()


@pytest.mark.parametrize("relpath", YAML_FILES)
def test_every_yaml_file_loads(relpath: str) -> None:
    """torchtune's test_configs idea: a broken file anywhere under manifests/ fails here."""
    with open(MANIFESTS / relpath, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    assert docs, f"{relpath} holds no YAML document"
    for doc in docs:
        assert isinstance(doc, dict), f"{relpath}: a document is a {type(doc).__name__}"
        assert doc.get("apiVersion") and doc.get("kind"), f"{relpath}: no apiVersion/kind"
        if doc["kind"] == "Secret":
            assert not doc.get("data") and not doc.get("stringData"), (
                f"{relpath}: a Secret with data is committed; the cluster operator creates it"
            )


def test_yaml_is_lint_clean() -> None:
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    config = YamlLintConfig(
        "extends: default\n"
        "rules:\n"
        "  document-start: disable\n"
        "  line-length: {max: 100}\n"
        "  indentation: {spaces: 2}\n"
    )
    problems = []
    for relpath in YAML_FILES:
        text = (MANIFESTS / relpath).read_text(encoding="utf-8")
        problems += [f"{relpath}:{p.line}: {p.desc} ({p.rule})" for p in linter.run(text, config)]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- rendered objects


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_into_one_namespace_with_common_labels(kustomization: str) -> None:
    objects = render(kustomization)
    idents = [ident(o) for o in objects]
    assert len(idents) == len(set(idents)), f"duplicate objects: {idents}"
    for obj in objects:
        meta = obj["metadata"]
        assert meta.get("name"), f"an object without a name in {kustomization}"
        if obj["kind"] == "Namespace":
            assert meta["name"] == NAMESPACE
        else:
            assert meta.get("namespace") == NAMESPACE, f"{ident(obj)} is not in {NAMESPACE}"
        assert (meta.get("labels") or {}).get(PART_OF[0]) == PART_OF[1], (
            f"{ident(obj)} lacks the label {PART_OF[0]}={PART_OF[1]}"
        )


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_builtin_objects_validate_strictly(kustomization: str) -> None:
    import kubernetes_validate

    errors: list[str] = []
    validated = 0
    for obj in render(kustomization):
        group = obj["apiVersion"].rpartition("/")[0]
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            validated += 1
        except kubernetes_validate.ValidationError as e:
            where = e.json_path
            errors.append(f"{ident(obj)}: {where}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            # Only custom resources may lack a Kubernetes schema; those are checked against
            # the vendored upstream CRDs (tests/fixtures/crds) where the project ships them.
            if "." not in group or group.endswith(".k8s.io"):
                errors.append(f"{ident(obj)}: {e.message}")
    assert not errors, "\n".join(errors)
    assert validated, f"nothing in {kustomization} was validated"


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_workloads_run_unprivileged_with_resources(kustomization: str) -> None:
    specs = list(pod_specs(render(kustomization)))
    assert specs, f"{kustomization} ships no workload to check"
    problems = [f"{who}: {p}" for who, spec in specs for p in container_problems(spec)]
    assert not problems, "\n".join(problems)


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_rbac_is_namespaced_and_least_privilege(kustomization: str) -> None:
    objects = render(kustomization)
    cluster_scoped = [ident(o) for o in objects if o["kind"] in CLUSTER_SCOPED_KINDS]
    assert not cluster_scoped, f"cluster-scoped objects: {cluster_scoped}"

    roles = by_kind(objects, "Role")
    assert roles, "no Role"
    problems = [f"{ident(r)}: {p}" for r in roles for p in rbac_problems(r)]
    assert not problems, "\n".join(problems)

    granted: dict[tuple[str, str], set[str]] = {}
    for rule in named(objects, "Role", "kubellm-pipeline")["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                granted.setdefault((group, res), set()).update(rule["verbs"])
    assert granted == EXPECTED_PIPELINE_RULES

    binding = named(objects, "RoleBinding", "kubellm-pipeline")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "kubellm-pipeline",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kubellm-pipeline", "namespace": NAMESPACE}
    ]
    named(objects, "ServiceAccount", "kubellm-pipeline")


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_no_secret_with_data(kustomization: str) -> None:
    leaked = [
        ident(o)
        for o in by_kind(render(kustomization), "Secret")
        if o.get("data") or o.get("stringData")
    ]
    assert not leaked, f"Secrets with data must not be committed: {leaked}"


# --------------------------------------------------------------------------- base contents


@dataclass(frozen=True)
class PvcCase:
    name: str
    access_mode: str
    size: str


@needs_kubectl
@pytest.mark.parametrize(
    "case",
    [
        PvcCase("kubellm-workspace", "ReadWriteMany", "50Gi"),
        PvcCase("mlflow-data", "ReadWriteOnce", "20Gi"),
    ],
    ids=lambda c: c.name,
)
def test_volumes(case: PvcCase) -> None:
    pvc = named(render("base"), "PersistentVolumeClaim", case.name)
    assert pvc["spec"]["accessModes"] == [case.access_mode]
    assert pvc["spec"]["resources"]["requests"]["storage"] == case.size


@needs_kubectl
def test_config_points_at_the_mlflow_service() -> None:
    objects = render("base")
    config = named(objects, "ConfigMap", "kubellm-config")
    assert config["data"]["MLFLOW_TRACKING_URI"] == "http://mlflow.kubellm:5000"

    service = named(objects, "Service", "mlflow")
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(5000, "http")]

    deployment = named(objects, "Deployment", "mlflow")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    assert selector.items() <= pod_labels.items(), "Service selects no MLflow pod"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


@needs_kubectl
def test_mlflow_server() -> None:
    deployment = named(render("base"), "Deployment", "mlflow")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate", "two sqlite writers during a rollout"
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]

    image, _, tag = container["image"].rpartition(":")
    assert image == "ghcr.io/mlflow/mlflow"
    assert tag.startswith("v3."), f"MLflow image {tag!r} is not a pinned 3.x tag"

    argv = container["command"] + container["args"]
    assert argv[:2] == ["mlflow", "server"]
    for flag in (
        "--host=0.0.0.0",
        "--port=5000",
        "--backend-store-uri=sqlite:////mlflow/mlflow.db",
        "--artifacts-destination=/mlflow/artifacts",
        "--serve-artifacts",
    ):
        assert flag in argv
    allowed = next(a for a in argv if a.startswith("--allowed-hosts="))
    # The Host header clients send for MLFLOW_TRACKING_URI must pass MLflow's check.
    assert "mlflow.kubellm:5000" in allowed.partition("=")[2].split(",")

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 5000}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe

    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/mlflow"]]["persistentVolumeClaim"]["claimName"] == "mlflow-data"
    assert "emptyDir" in volumes[mounts["/tmp"]], "a read-only root needs a writable /tmp"
    assert pod["automountServiceAccountToken"] is False


# --------------------------------------------------------------------------- rdma overlay


@needs_kubectl
def test_rdma_overlay_adds_nccl_settings_to_the_base() -> None:
    base = {ident(o) for o in render("base")}
    rdma = render("overlays/rdma")
    assert base <= {ident(o) for o in rdma}, "the rdma overlay dropped base objects"

    env = named(rdma, "ConfigMap", "kubellm-nccl-env")["data"]
    for key in (
        "NCCL_IB_DISABLE",
        "NCCL_NET_GDR_LEVEL",
        "NCCL_IB_HCA",
        "NCCL_SOCKET_IFNAME",
        "NCCL_DEBUG",
    ):
        assert isinstance(env.get(key), str) and env[key], f"{key} missing or empty"
    assert env["NCCL_IB_DISABLE"] == "0", "the RDMA overlay must not disable InfiniBand"
    assert env["NCCL_DEBUG"] == "INFO"

    # IPC_LOCK (needed by RDMA training pods) is outside Pod Security "baseline".
    labels = named(rdma, "Namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


# --------------------------------------------------------------------------- the checks themselves


@dataclass(frozen=True)
class BadPod:
    what: str
    container: dict[str, Any]
    expect: str


_GOOD = {
    "name": "c",
    "image": "example.org/app:1.0",
    "securityContext": {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    },
    "resources": {
        "requests": {"cpu": "1", "memory": "1Gi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    },
}


def _with(**changes: Any) -> dict[str, Any]:
    c = {**_GOOD, "securityContext": dict(_GOOD["securityContext"])}
    for key, value in changes.items():
        if key in c["securityContext"] or key in ("privileged", "runAsUser"):
            c["securityContext"][key] = value
        else:
            c[key] = value
    return c


@pytest.mark.parametrize(
    "case",
    [
        BadPod("root", _with(runAsNonRoot=False), "runAsNonRoot"),
        BadPod("uid 0", _with(runAsUser=0), "runAsUser is 0"),
        BadPod("escalation", _with(allowPrivilegeEscalation=True), "allowPrivilegeEscalation"),
        BadPod("privileged", _with(privileged=True), "privileged"),
        BadPod("caps kept", _with(capabilities={"drop": ["NET_RAW"]}), "drop ALL"),
        BadPod("caps added", _with(capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]}), "adds"),
        BadPod("no seccomp", _with(seccompProfile={"type": "Unconfined"}), "seccompProfile"),
        BadPod("writable root", _with(readOnlyRootFilesystem=False), "readOnlyRootFilesystem"),
        BadPod("no limits", _with(resources={"requests": {"cpu": "1"}}), "no limits.memory"),
        BadPod("latest", _with(image="example.org/app:latest"), "not pinned"),
        BadPod("untagged", _with(image="example.org:5000/app"), "not pinned"),
    ],
    ids=lambda c: c.what,
)
def test_container_check_rejects(case: BadPod) -> None:
    assert container_problems({"containers": [_GOOD]}) == []
    problems = container_problems({"containers": [case.container]})
    assert any(case.expect in p for p in problems), problems


@pytest.mark.parametrize(
    "rule",
    [
        {"apiGroups": ["*"], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["*"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles"], "verbs": ["bind"]},
    ],
)
def test_rbac_check_rejects(rule: dict[str, Any]) -> None:
    assert rbac_problems({"rules": [rule]})
