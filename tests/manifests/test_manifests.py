"""The kustomize manifests: they render, validate against Kubernetes' own schemas, and keep
the security posture we promise (non-root, no escalation, least-privilege RBAC, no secret
read beyond the one the KFP launcher needs, by name).

Rendering needs `kubectl` (its built-in kustomize); without it those tests skip, saying so.
Schema validation uses `kubernetes-validate` (strict: unknown fields fail, as with
`kubectl apply --validate=strict`) at a pinned Kubernetes version. Every rendering also
passes checkov (`checkov_check.py`, run from its own venv `.venv-checkov`, which `make
checkov` creates), and the pods we ship meet the Pod Security level each overlay enforces
(`psa.py`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from fakes.k8s_rbac import Attributes, Role
from fakes.kfp_runtime import PIPELINES_ENABLED, RUNTIME_GETS

from .checkov_check import checkov_available, checkov_failures
from .psa import psa_violations

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
KUBERNETES_VERSION = "1.30.0"
NAMESPACE = "kubellm"
PART_OF = ("app.kubernetes.io/part-of", "kubellm")

# What `kubectl kustomize` renders on its own; components/ are parts of them (kind: Component).
KUSTOMIZATIONS = sorted(
    p.parent.relative_to(MANIFESTS).as_posix()
    for p in MANIFESTS.rglob("kustomization.yaml")
    if not p.parent.relative_to(MANIFESTS).as_posix().startswith(("components/", "cluster/"))
)
# Cluster-scoped objects an administrator applies once, outside the namespace (no Role,
# no workload): checked on their own below.
CLUSTER_KUSTOMIZATIONS = ["cluster/trainer-v2"]
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

# Exactly what the pipeline's Role grants: (apiGroup, resource) -> verbs; a missing or an
# extra verb fails. The fake API server (tests/fakes/fake_k8s.py) enforces the Role in
# manifests/base/rbac.yaml on every request the launchers send, so a verb kubellm's code
# uses but this table (and the Role) lacks fails those tests too.
CLIENT_VERBS: dict[tuple[str, str], frozenset[str]] = {
    ("kubeflow.org", "pytorchjobs"): frozenset({"create", "get", "list", "watch", "delete"}),
    ("trainer.kubeflow.org", "trainjobs"): frozenset({"create", "get", "list", "watch", "delete"}),
    ("kubeflow.org", "experiments"): frozenset({"create", "get", "list", "watch", "delete"}),
    ("kubeflow.org", "trials"): frozenset({"list"}),
    ("serving.kserve.io", "inferenceservices"): frozenset(
        {"create", "get", "list", "watch", "update", "delete"}
    ),
    ("", "pods"): frozenset({"get", "list", "watch"}),
    ("", "pods/log"): frozenset({"get"}),
    # Argo Workflows' executor in every step pod (not kubellm's code).
    ("argoproj.io", "workflowtaskresults"): frozenset({"create", "patch"}),
}

# What the KFP v2 runtime in every step pod reads as the run's ServiceAccount, the driver
# and the launcher (tests/fakes/kfp_runtime.py makes these requests through the fake API
# server): `get` on exactly these objects, by resourceNames. KFP's own Role for the run's
# ServiceAccount grants them more broadly (UPSTREAM_RUNNER_ROLE); ours names the objects.
KFP_RUNTIME: dict[tuple[str, str], dict[str, frozenset[str]]] = {
    key: {"get": frozenset({name})} for key, name in RUNTIME_GETS.items()
}
# kubeflow/pipelines manifests/kustomize/base/pipeline/pipeline-runner-role.yaml at 2.17.0
UPSTREAM_RUNNER_ROLE = REPO / "tests" / "fixtures" / "kfp" / "pipeline-runner-role.yaml"
# Resources the Role may grant only on named objects, and only these verbs.
BY_NAME_ONLY: dict[str, frozenset[str]] = {
    "secrets": frozenset({"get"}),
    "configmaps": frozenset({"get"}),
}

# Resources of the core API group ("") the Role may name.
CORE_RESOURCES = frozenset({"pods", "pods/log", "configmaps", "secrets"})
# Resources of APIs whose schemas are not vendored, each with the upstream source that
# says the resource exists and what needs it.
DOCUMENTED_RESOURCES: dict[tuple[str, str], str] = {
    ("argoproj.io", "workflowtaskresults"): (
        "Argo Workflows >= 3.4: the executor's minimum RBAC, "
        "https://github.com/argoproj/argo-workflows/blob/main/docs/workflow-rbac.md"
    ),
}
CRDS_DIR = Path(os.environ.get("KUBELLM_CRDS_DIR") or REPO / "tests" / "fixtures" / "crds")
KATIB_SWAGGER = "katib_v1beta1_swagger.json"
KATIB_EXPERIMENT_CRD = "kubeflow.org_experiments.yaml"

# The Pod Security level each kustomization enforces on the namespace.
ENFORCE_LEVELS = {
    "base": "baseline",
    "overlays/single-node": "baseline",
    "overlays/rdma": "privileged",
    "overlays/restricted-egress": "baseline",
}
KATIB_INJECTION_LABEL = "katib.kubeflow.org/metrics-collector-injection"

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
            if res in BY_NAME_ONLY:
                if not rule.get("resourceNames"):
                    problems.append(f"{res} not restricted by resourceNames")
                if set(rule.get("verbs") or ()) - BY_NAME_ONLY[res]:
                    problems.append(f"{res}: verbs beyond {sorted(BY_NAME_ONLY[res])}")
        for verb in rule.get("verbs") or []:
            if verb in ("bind", "escalate", "impersonate"):
                problems.append(f"privilege-granting verb {verb}")
        if rule.get("nonResourceURLs"):
            problems.append("nonResourceURLs in a Role")
    return problems


@functools.cache
def served_custom_resources() -> dict[tuple[str, str], frozenset[str]]:
    """(group, plural) -> subresources, of every custom resource in the vendored schemas.

    A CRD names its group and plural (spec.group, spec.names.plural). Katib's swagger
    names no group: its top-level kinds (those with apiVersion, kind, metadata and spec)
    are served in the group of Katib's Experiment CRD, vendored from the same commit, with
    the lower-case plural Katib's CRDs use (Trial -> trials).
    """
    served: dict[tuple[str, str], frozenset[str]] = {}
    # libyaml's loader when present: the CRDs are megabytes of YAML.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for path in sorted(CRDS_DIR.glob("*.yaml")):
        for doc in yaml.load_all(path.read_text(encoding="utf-8"), Loader=loader):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            subresources = {
                sub for v in spec.get("versions") or [] for sub in v.get("subresources") or {}
            }
            served[(spec["group"], spec["names"]["plural"])] = frozenset(subresources)
    katib_crd = yaml.safe_load((CRDS_DIR / KATIB_EXPERIMENT_CRD).read_text(encoding="utf-8"))
    katib_group = katib_crd["spec"]["group"]
    swagger = json.loads((CRDS_DIR / KATIB_SWAGGER).read_text(encoding="utf-8"))
    for key, schema in swagger["components"]["schemas"].items():
        version, _, kind = key.lstrip(".").partition(".")
        props = set((schema.get("properties") or {}).keys())
        if version == "v1beta1" and {"apiVersion", "kind", "metadata", "spec"} <= props:
            # The swagger says nothing of subresources: grant none on these.
            served.setdefault((katib_group, kind.lower() + "s"), frozenset())
    return served


def unknown_resources(role: dict[str, Any]) -> list[str]:
    """(apiGroup, resource) pairs in a Role that no API we know of serves."""
    served = served_custom_resources()
    problems = []
    for rule in role.get("rules") or []:
        for group in rule.get("apiGroups") or []:
            for res in rule.get("resources") or []:
                plural, _, sub = res.partition("/")
                if group == "":
                    known = res in CORE_RESOURCES
                elif (group, res) in DOCUMENTED_RESOURCES:
                    known = True
                else:
                    known = (group, plural) in served and (
                        not sub or sub in served[(group, plural)]
                    )
                if not known:
                    problems.append(f"no API serves {res!r} in group {group!r}")
    return problems


def granted_verbs(role: dict[str, Any]) -> dict[tuple[str, str], frozenset[str]]:
    """(apiGroup, resource) -> verbs, of the rules on every object (no resourceNames)."""
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role.get("rules") or []:
        if rule.get("resourceNames"):
            continue
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                granted.setdefault((group, res), set()).update(rule["verbs"])
    return {k: frozenset(v) for k, v in granted.items()}


def granted_by_name(role: dict[str, Any]) -> dict[tuple[str, str], dict[str, frozenset[str]]]:
    """(apiGroup, resource) -> verb -> names, of the rules restricted by resourceNames."""
    granted: dict[tuple[str, str], dict[str, set[str]]] = {}
    for rule in role.get("rules") or []:
        for group in rule["apiGroups"] if rule.get("resourceNames") else ():
            for res in rule["resources"]:
                for verb in rule["verbs"]:
                    names = granted.setdefault((group, res), {}).setdefault(verb, set())
                    names.update(rule["resourceNames"])
    return {k: {verb: frozenset(n) for verb, n in v.items()} for k, v in granted.items()}


# --------------------------------------------------------------------------- every shipped file


def test_the_expected_manifests_are_shipped() -> None:
    assert set(KUSTOMIZATIONS) == set(ENFORCE_LEVELS)
    assert "README.md" in {p.name for p in MANIFESTS.iterdir()}
    for overlay in ("rdma", "single-node", "restricted-egress"):
        assert (MANIFESTS / "overlays" / overlay / "README.md").is_file(), overlay


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

    role = named(objects, "Role", "kubellm-pipeline")
    assert not unknown_resources(role), "\n".join(unknown_resources(role))
    granted = granted_verbs(role)
    missing = {k: v - granted.get(k, frozenset()) for k, v in CLIENT_VERBS.items()}
    extra = {k: v - CLIENT_VERBS.get(k, frozenset()) for k, v in granted.items()}
    lacking = {k: sorted(v) for k, v in missing.items() if v}
    beyond = {k: sorted(v) for k, v in extra.items() if v}
    assert not lacking, f"the Role lacks {lacking}"
    assert not beyond, f"the Role grants more than CLIENT_VERBS: {beyond}"
    assert granted == CLIENT_VERBS
    # the KFP runtime's reads: exactly these objects, nothing else by name
    assert granted_by_name(role) == KFP_RUNTIME, "the Role's grants by resourceNames"

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


def test_the_kfp_runtime_grants_are_ones_kfps_own_runner_role_makes() -> None:
    """Each object the KFP runtime reads is one KFP's pipeline-runner Role lets the run's
    ServiceAccount read (evaluated as RBAC does, fakes/k8s_rbac.py): our table comes from
    the runtime's needs, which upstream's Role confirms, not from kubellm's client."""
    upstream = Role(UPSTREAM_RUNNER_ROLE)
    assert KFP_RUNTIME, "no KFP runtime grants"
    for (group, resource), verbs in KFP_RUNTIME.items():
        for verb, names in verbs.items():
            for name in names:
                attrs = Attributes(verb, group, resource, "", NAMESPACE, name)
                assert upstream.allows(attrs), f"pipeline-runner does not grant {attrs}"


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        ({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}, "resourceNames"),
        (
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": ["x"],
                "verbs": ["list"],
            },
            "verbs beyond",
        ),
        ({"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}, "resourceNames"),
    ],
)
def test_secrets_and_configmaps_only_by_name_and_only_get(
    rule: dict[str, Any], problem: str
) -> None:
    assert any(problem in p for p in rbac_problems({"rules": [rule]}))
    named_get = {**rule, "resourceNames": ["x"], "verbs": ["get"]}
    assert rbac_problems({"rules": [named_get]}) == []


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
        PvcCase("kubellm-workspace", "ReadWriteMany", "500Gi"),
        PvcCase("mlflow-data", "ReadWriteOnce", "20Gi"),
    ],
    ids=lambda c: c.name,
)
def test_volumes(case: PvcCase) -> None:
    pvc = named(render("base"), "PersistentVolumeClaim", case.name)
    assert pvc["spec"]["accessModes"] == [case.access_mode]
    assert pvc["spec"]["resources"]["requests"]["storage"] == case.size


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_workspace_size_is_a_parameter_and_the_parameters_stay_local(
    kustomization: str,
) -> None:
    """params.yaml's workspaceSize reaches the PVC (single-node merges its own 200Gi), and
    the local-config ConfigMap that carries it is never part of what is applied."""
    objects = render(kustomization)
    params = yaml.safe_load((MANIFESTS / "base" / "params.yaml").read_text())["data"]
    size = "200Gi" if kustomization == "overlays/single-node" else params["workspaceSize"]
    pvc = named(objects, "PersistentVolumeClaim", "kubellm-workspace")
    assert pvc["spec"]["resources"]["requests"]["storage"] == size
    assert not [o for o in objects if o["metadata"]["name"] == "kubellm-params"]


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

    # sh -c '... exec mlflow server "$@"' mlflow <args>: the script sets the auth app's
    # secret key, then the arguments go to `mlflow server` (test_mlflow_runs_with_auth).
    command = container["command"]
    assert command[:2] == ["sh", "-c"] and command[2].endswith('exec mlflow server "$@"')
    argv = ["mlflow", "server", *container["args"]]
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


@needs_kubectl
def test_mlflow_runs_with_auth_from_the_pipelines_secret() -> None:
    """The server runs MLflow's basic-auth app; its admin is the user the pipeline's pods
    log in as: the same Secret and keys as podspec.MLFLOW_SECRET_ENV (which
    pipelines/llm_train.py and the job pods load). tests/tracking/test_mlflow_auth.py runs
    this command for real."""
    import configparser

    from kubellm.backends.kubernetes.podspec import MLFLOW_SECRET, MLFLOW_SECRET_ENV

    objects = render("base")
    pod = named(objects, "Deployment", "mlflow")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "--app-name=basic-auth" in container["args"]
    assert 'exec mlflow server "$@"' in container["command"][2]
    assert "MLFLOW_FLASK_SERVER_SECRET_KEY" in container["command"][2]
    env = {e["name"]: e for e in container["env"]}
    for server_env, client_env in (
        ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_TRACKING_USERNAME"),
        ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_TRACKING_PASSWORD"),
    ):
        ref = env[server_env]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": MLFLOW_SECRET, "key": MLFLOW_SECRET_ENV[client_env]}, ref
        assert not ref.get("optional"), f"{server_env}: the server must not start without it"

    # the auth config: a mounted ConfigMap, its database on the data volume (a restart
    # keeps the users), READ for users nobody granted more
    path = Path(env["MLFLOW_AUTH_CONFIG_PATH"]["value"])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_map = volumes[mounts[str(path.parent)]]["configMap"]["name"]
    ini = configparser.ConfigParser()
    ini.read_string(named(objects, "ConfigMap", config_map)["data"][path.name])
    assert ini["mlflow"]["default_permission"] == "READ"
    db = ini["mlflow"]["database_uri"]
    assert db.startswith("sqlite:////mlflow/"), db
    assert "persistentVolumeClaim" in volumes[mounts["/mlflow"]]
    assert "admin_password" not in ini["mlflow"], "the password comes from the Secret"
    # the probes stay unauthenticated: /health is one of the auth app's open prefixes
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    # the plain image lacks Flask-WTF, which the auth app imports
    assert container["image"].endswith("-full"), container["image"]


# --------------------------------------------------------------------------- namespace, overlays


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_namespace_labels(kustomization: str) -> None:
    labels = named(render(kustomization), "Namespace", NAMESPACE)["metadata"]["labels"]
    # Without it Katib injects no metrics collector and every trial ends MetricsUnavailable.
    assert labels.get(KATIB_INJECTION_LABEL) == "enabled"
    # Without it KFP's profile controller creates neither kfp-launcher nor the artifact
    # Secret, and every step's launcher fails (fakes/kfp_runtime.py profile_controller_sync).
    assert labels.get(PIPELINES_ENABLED) == "true"
    assert labels["pod-security.kubernetes.io/enforce"] == ENFORCE_LEVELS[kustomization]
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    assert labels["pod-security.kubernetes.io/audit"] == "restricted"


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_shipped_pods_meet_restricted(kustomization: str) -> None:
    """What we ship meets "restricted" everywhere, so it is admitted at any enforce level
    and the namespace's restricted warn/audit stays quiet for it."""
    specs = list(pod_specs(render(kustomization)))
    problems = [f"{who}: {p}" for who, spec in specs for p in psa_violations(spec, "restricted")]
    assert not problems, "\n".join(problems)


# A training container as the rdma overlay's README asks for: IPC_LOCK and nothing else.
RDMA_TRAINING_POD: dict[str, Any] = {
    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [
        {
            "name": "pytorch",
            "image": "ghcr.io/kubellm/trainer:0.1.0",
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
            },
        }
    ],
}


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_rdma_training_pods_are_admitted_only_by_the_rdma_overlay(kustomization: str) -> None:
    labels = named(render(kustomization), "Namespace", NAMESPACE)["metadata"]["labels"]
    admitted = not psa_violations(RDMA_TRAINING_POD, labels["pod-security.kubernetes.io/enforce"])
    assert admitted == (kustomization == "overlays/rdma")


@needs_kubectl
@pytest.mark.parametrize("overlay", ["overlays/rdma", "overlays/single-node"])
def test_overlays_keep_every_base_object(overlay: str) -> None:
    base = {ident(o) for o in render("base")}
    assert base == {ident(o) for o in render(overlay)}, f"{overlay} adds or drops objects"


@needs_kubectl
def test_rdma_overlay_changes_only_the_enforce_level() -> None:
    """NCCL settings come from the pipeline (`fabric`, `nccl_env`), not a ConfigMap."""
    base, rdma = render("base"), render("overlays/rdma")
    assert not [o for o in rdma if o["metadata"]["name"] == "kubellm-nccl-env"]
    assert not (MANIFESTS / "overlays" / "rdma" / "nccl-env.yaml").exists()
    changed = [ident(o) for o, b in zip(rdma, base, strict=True) if o != b]
    assert changed == [f"Namespace/{NAMESPACE}"], changed


@needs_kubectl
def test_single_node_overlay() -> None:
    objects = render("overlays/single-node")
    workspace = named(objects, "PersistentVolumeClaim", "kubellm-workspace")
    assert workspace["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert workspace["spec"]["resources"] == {"requests": {"storage": "200Gi"}}  # its params
    # The enforce level is restated (same as the base), so only the PVC differs.
    changed = [ident(o) for o, b in zip(objects, render("base"), strict=True) if o != b]
    assert changed == [f"PersistentVolumeClaim/{NAMESPACE}/kubellm-workspace"]


@pytest.mark.parametrize(
    "words",
    [
        "fabric",
        "rdma_resource",
        "rdma/rdma_shared_device_a",
        "nvidia.com/hostdev",
        "rdma_count",
        "network_annotation",
        "k8s.v1.cni.cncf.io/networks",
        "nccl_env",
        "min_busbw_gbps",
        "NCCL_IB_GID_INDEX=3",
        "NCCL_DEBUG_SUBSYS=INIT,NET",
        "What the cluster must provide",
    ],
)
def test_rdma_readme_documents_the_pipeline_parameters(words: str) -> None:
    text = (MANIFESTS / "overlays" / "rdma" / "README.md").read_text(encoding="utf-8")
    assert words in text


# --------------------------------------------------------------------------- checkov


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_checkov_passes(kustomization: str) -> None:
    assert checkov_available(), "checkov is missing: run `make checkov` (make test does)"
    text = yaml.safe_dump_all(render(kustomization), sort_keys=False)
    failures = checkov_failures(text, kustomization)
    assert not failures, "\n".join(failures)


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_checkov_skip_is_justified(kustomization: str) -> None:
    for obj in render(kustomization):
        for key, value in (obj["metadata"].get("annotations") or {}).items():
            if key.startswith("checkov.io/skip"):
                check_id, sep, reason = value.partition("=")
                assert re.fullmatch(r"CKV2?_K8S_\d+", check_id), f"{ident(obj)}: {value}"
                assert sep and len(reason.split()) >= 3, f"{ident(obj)}: {key} has no reason"
                assert "=" not in reason, f"{ident(obj)}: checkov splits {key} on '='"


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


@pytest.mark.parametrize(
    ("group", "resource"),
    [
        ("katib.kubeflow.org", "experiments"),  # Katib's label prefix, not its API group
        ("katib.kubeflow.org", "trials"),
        ("kubeflow.org", "pytorchjob"),  # the kind's singular, not the plural
        ("kubeflow.org", "tfjobs"),  # a real resource, but no vendored schema serves it
        ("serving.kubeflow.org", "inferenceservices"),  # KFServing's old group
        ("", "services"),
        ("argoproj.io", "workflows"),
        ("kubeflow.org", "experiments/scale"),  # a subresource the CRD does not declare
    ],
)
def test_unknown_resources_are_rejected(group: str, resource: str) -> None:
    rule = {"apiGroups": [group], "resources": [resource], "verbs": ["get"]}
    assert unknown_resources({"rules": [rule]}), (group, resource)


def test_every_expected_resource_is_served() -> None:
    """CLIENT_VERBS itself names only what the vendored schemas (or Argo's doc) serve."""
    served = served_custom_resources()
    assert ("kubeflow.org", "trials") in served, "Trial from Katib's swagger"
    assert ("kubeflow.org", "experiments") in served
    rules = [
        {"apiGroups": [g], "resources": [r], "verbs": sorted(v)}
        for (g, r), v in CLIENT_VERBS.items()
    ]
    assert unknown_resources({"rules": rules}) == []
    assert granted_verbs({"rules": rules}) == CLIENT_VERBS


@pytest.mark.parametrize(
    "change",
    ["drop a verb", "add a verb", "add a resource"],
)
def test_a_changed_role_differs_from_the_table(change: str) -> None:
    rules = [
        {"apiGroups": [g], "resources": [r], "verbs": sorted(v)}
        for (g, r), v in CLIENT_VERBS.items()
    ]
    if change == "drop a verb":
        rules[0]["verbs"] = rules[0]["verbs"][1:]
    elif change == "add a verb":
        rules[0]["verbs"] = [*rules[0]["verbs"], "deletecollection"]
    else:
        rules.append({"apiGroups": [""], "resources": ["pods/log"], "verbs": ["list"]})
    assert granted_verbs({"rules": rules}) != CLIENT_VERBS


@needs_kubectl
def test_the_trainer_v2_runtime_is_cluster_scoped_and_what_the_builder_makes() -> None:
    """manifests/cluster/trainer-v2 renders the one ClusterTrainingRuntime the TrainJobs name,
    without a namespace (kustomize would add one under an overlay's `namespace:`), strictly
    valid against the vendored Trainer v2.3.0 CRD, and equal to the builder's output."""
    from fakes.k8s_schemas import crd_check, crds_dir
    from kubellm.backends.kubernetes.trainjob import RUNTIME_NAME, training_runtime_manifest
    from kubellm.config import PipelineConfig

    (kustomization,) = CLUSTER_KUSTOMIZATIONS
    (obj,) = render(kustomization)
    assert (obj["kind"], obj["metadata"]["name"]) == ("ClusterTrainingRuntime", RUNTIME_NAME)
    assert "namespace" not in obj["metadata"]
    check = crd_check(crds_dir() / "trainer.kubeflow.org_clustertrainingruntimes.yaml", "v1alpha1")
    assert check(obj) == []
    built = training_runtime_manifest(image=PipelineConfig().trainer_image)
    labels = obj["metadata"].pop("labels")
    assert labels == {**built["metadata"].pop("labels"), PART_OF[0]: PART_OF[1]}
    assert obj == built
