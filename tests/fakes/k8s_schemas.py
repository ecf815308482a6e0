"""Validation of custom-resource bodies against the upstream schemas in tests/fixtures/crds.

A FAKE's helper, for tests only: the real API server validates with the CRD's structural
schema and `kubectl --validate=strict` rejects unknown fields; the controllers' admission
webhooks add a few semantic checks. This module does the schema part with jsonschema
(Draft 7) plus a strict unknown-field walk, and the handful of webhook checks a wrong body
of ours would hit first. Errors are strings that start with the field path.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft7Validator

# The upstream schemas, vendored with their provenance (README.md there; `make update-crds`).
VENDORED_CRDS = Path(__file__).resolve().parents[1] / "fixtures" / "crds"
PYTORCHJOB_CRD = "kubeflow.org_pytorchjobs.yaml"
INFERENCESERVICE_CRD = "serving.kserve.io_inferenceservices.yaml"
# ServingRuntime; a ClusterServingRuntime has the same spec (the sim's KServe installs one).
SERVINGRUNTIME_CRD = "serving.kserve.io_servingruntimes.yaml"
KATIB_SWAGGER = "katib_v1beta1_swagger.json"
TRAINJOB_CRD = "trainer.kubeflow.org_trainjobs.yaml"
CLUSTERTRAININGRUNTIME_CRD = "trainer.kubeflow.org_clustertrainingruntimes.yaml"
JOBSET_CRD = "jobset.x-k8s.io_jobsets.yaml"
REQUIRED_FILES = (PYTORCHJOB_CRD, INFERENCESERVICE_CRD, KATIB_SWAGGER)

# ObjectMeta fields a client may send; CRD schemas leave `metadata` to the API server.
_OBJECT_META = {
    "name",
    "generateName",
    "namespace",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "resourceVersion",
    "uid",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# DNS-1035 label: Katib's experiment names and the PyTorchJob webhook's job names.
_KATIB_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_PLACEHOLDER = re.compile(r"\$\{trialParameters\.([^}]*)\}")
# KServe's inference_service_validation.go IsvcNameFmt.
_ISVC_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# PredictorSpec's implementations (predictor.go GetImplementations): the framework specs, the
# model spec, and custom containers.
_PREDICTOR_IMPLEMENTATIONS = (
    "xgboost",
    "pytorch",
    "triton",
    "sklearn",
    "tensorflow",
    "onnx",
    "pmml",
    "lightgbm",
    "paddle",
    "huggingface",
    "model",
)

Validator = Callable[[dict[str, Any]], list[str]]


def crds_dir() -> Path:
    """KUBELLM_CRDS_DIR, else the vendored copies in tests/fixtures/crds."""
    return Path(os.environ.get("KUBELLM_CRDS_DIR") or VENDORED_CRDS)


def missing_files(directory: Path) -> list[str]:
    return [f for f in REQUIRED_FILES if not (directory / f).is_file()]


def missing_reason(directory: Path) -> str:
    """Why the schema-validating fake cannot start: names the missing files and their source."""
    override = os.environ.get("KUBELLM_CRDS_DIR")
    where = f"KUBELLM_CRDS_DIR={override}" if override else "the vendored copy"
    return (
        f"upstream API schemas missing from {directory} ({where}): "
        f"{', '.join(missing_files(directory))}. The repository vendors them in "
        f"{VENDORED_CRDS} (README.md there names each upstream repository, path and commit; "
        "`make update-crds` re-fetches them); a test that validates against nothing is no test"
    )


# ---------------------------------------------------------------- schema machinery


def _strip_extensions(node: Any) -> Any:
    """The schema without x-kubernetes-* keys, which are not JSON Schema."""
    if isinstance(node, dict):
        return {
            k: _strip_extensions(v)
            for k, v in node.items()
            if not str(k).startswith("x-kubernetes-")
        }
    if isinstance(node, list):
        return [_strip_extensions(v) for v in node]
    return node


def _deref(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            raise ValueError(f"unsupported $ref {ref}")
        node: Any = root
        for part in ref[2:].split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        schema = node
    return schema


def _merged(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """One schema with $ref followed and allOf folded in (what the strict walk needs)."""
    schema = _deref(schema, root)
    if "allOf" not in schema:
        return schema
    out = {k: v for k, v in schema.items() if k != "allOf"}
    props = dict(out.get("properties") or {})
    for part in schema["allOf"]:
        sub = _merged(part, root)
        props.update(sub.get("properties") or {})
        for key in ("additionalProperties", "items", "x-kubernetes-preserve-unknown-fields"):
            if key in sub and key not in out:
                out[key] = sub[key]
    if props:
        out["properties"] = props
    return out


def unknown_fields(
    instance: Any, schema: dict[str, Any], root: dict[str, Any], path: str
) -> list[str]:
    """Fields the schema does not name, as `kubectl --validate=strict` reports them.

    An object schema with `properties` names its fields; `additionalProperties` (a schema or
    true) and `x-kubernetes-preserve-unknown-fields` allow others. An object schema with
    neither properties nor additionalProperties is opaque (e.g. `metadata` in a CRD).
    """
    schema = _merged(schema, root)
    out: list[str] = []
    if isinstance(instance, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
        for key, value in instance.items():
            sub = f"{path}.{key}" if path else str(key)
            if key in props:
                out += unknown_fields(value, props[key], root, sub)
            elif isinstance(extra, dict):
                out += unknown_fields(value, extra, root, sub)
            elif extra is False or (props and extra is not True and not preserve):
                out.append(f"{sub}: unknown field")
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(instance):
            out += unknown_fields(value, schema["items"], root, f"{path}[{i}]")
    return out


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


class SchemaCheck:
    """Draft 7 validation plus the strict unknown-field walk, for one schema."""

    def __init__(self, schema: dict[str, Any], root: dict[str, Any] | None = None) -> None:
        self.schema = schema
        self.root = root if root is not None else schema
        holder = {"components": _strip_extensions(self.root.get("components", {}))}
        stripped = _strip_extensions(schema)
        self._draft7 = Draft7Validator({**holder, "allOf": [stripped]})

    def __call__(self, body: dict[str, Any], prefix: str = "") -> list[str]:
        errors = []
        for err in sorted(self._draft7.iter_errors(body), key=lambda e: list(map(str, e.path))):
            where = _path(err.absolute_path)
            where = f"{prefix}.{where}" if prefix and where else (prefix or where or "<root>")
            errors.append(f"{where}: {err.message}")
        errors += unknown_fields(body, self.schema, self.root, prefix)
        return errors


@functools.cache
def _load_yaml(path: Path) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with path.open() as f:
        out: dict[str, Any] = yaml.load(f, Loader=loader)
    return out


@functools.cache
def crd_check(path: Path, version: str) -> SchemaCheck:
    crd = _load_yaml(path)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return SchemaCheck(v["schema"]["openAPIV3Schema"])
    raise KeyError(f"{path.name} has no version {version}")


@functools.cache
def swagger_check(path: Path, name: str) -> SchemaCheck:
    doc = json.loads(path.read_text())
    return SchemaCheck(doc["components"]["schemas"][name], root=doc)


# ---------------------------------------------------------------- per-kind validators


def metadata_errors(body: dict[str, Any]) -> list[str]:
    meta = body.get("metadata")
    if not isinstance(meta, dict):
        return ["metadata: Required value"]
    errors = [f"metadata.{k}: unknown field" for k in meta if k not in _OBJECT_META]
    name = meta.get("name")
    if not name:
        errors.append("metadata.name: Required value")
    elif len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        errors.append(f"metadata.name: Invalid value {name!r}: not a DNS-1123 subdomain")
    return errors


def pytorchjob_semantics(body: dict[str, Any], prefix: str = "") -> list[str]:
    """What the Training Operator's validating webhook rejects first."""
    p = f"{prefix}." if prefix else ""
    errors = []
    name = (body.get("metadata") or {}).get("name")
    # pkg/webhooks/pytorch: validation.IsDNS1035Label(job name) (Katib names trial jobs).
    if name is not None and (len(name) > 63 or not _KATIB_NAME.match(name)):
        errors.append(f"{p}metadata.name: {name!r} is not a DNS-1035 label (PyTorchJob webhook)")
    spec = body.get("spec") or {}
    specs = spec.get("pytorchReplicaSpecs") or {}
    # pkg/webhooks/pytorch validateSpec: an elasticPolicy needs a Worker spec, and its
    # deprecated nProcPerNode must not come with spec.nprocPerNode (the deprecation warning
    # itself is not simulated).
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in specs:
            errors.append(
                f"{p}spec.pytorchReplicaSpecs[Worker]: Required value: must be configured if "
                "elastic policy is used"
            )
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            errors.append(
                f"{p}spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with "
                "spec.nprocPerNode"
            )
    for rtype, rspec in specs.items():
        where = f"{p}spec.pytorchReplicaSpecs.{rtype}"
        if rtype not in ("Master", "Worker"):
            errors.append(f"{where}: unsupported replica type (Master, Worker)")
        if rtype == "Master" and rspec.get("replicas", 1) != 1:
            errors.append(f"{where}.replicas: must be 1")
        if rspec.get("restartPolicy") not in (None, "Always", "OnFailure", "Never", "ExitCode"):
            errors.append(f"{where}.restartPolicy: unsupported value {rspec.get('restartPolicy')}")
        containers = ((rspec.get("template") or {}).get("spec") or {}).get("containers") or []
        if not any(c.get("name") == "pytorch" for c in containers):
            errors.append(f"{where}.template.spec.containers: no container named pytorch")
    return errors


def katib_semantics(body: dict[str, Any]) -> list[str]:
    """What Katib's experiment webhook rejects first (names, placeholders, ranges)."""
    spec = body.get("spec") or {}
    errors = []
    name = (body.get("metadata") or {}).get("name") or ""
    if not _KATIB_NAME.match(name):
        errors.append(f"metadata.name: {name!r} must start with a letter (Katib)")
    # pkg/webhook/v1beta1/experiment/validator: "Name must be consisted of lower case
    # alphanumeric characters or '-', start with an alphabetic character, and end with an
    # alphanumeric character, and ... no more than 40 characters".
    if len(name) > 40:
        errors.append(f"metadata.name: {name!r} is longer than 40 characters (Katib)")
    counts = {
        k: spec.get(k) for k in ("maxTrialCount", "parallelTrialCount", "maxFailedTrialCount")
    }
    if isinstance(counts["maxTrialCount"], int):
        if counts["maxTrialCount"] <= 0:
            errors.append("spec.maxTrialCount: must be greater than 0")
        for key in ("parallelTrialCount", "maxFailedTrialCount"):
            if isinstance(counts[key], int) and counts[key] > counts["maxTrialCount"]:
                errors.append(f"spec.{key}: should be less than or equal to spec.maxTrialCount")
    objective = spec.get("objective") or {}
    if objective.get("type") not in ("minimize", "maximize"):
        errors.append(
            f"spec.objective.type: must be minimize or maximize, got {objective.get('type')}"
        )
    if not objective.get("objectiveMetricName"):
        errors.append("spec.objective.objectiveMetricName: Required value")
    if not (spec.get("algorithm") or {}).get("algorithmName"):
        errors.append("spec.algorithm.algorithmName: Required value")
    params = {}
    for i, p in enumerate(spec.get("parameters") or []):
        where = f"spec.parameters[{i}]"
        params[p.get("name")] = p
        ptype, fs = p.get("parameterType"), p.get("feasibleSpace") or {}
        if ptype not in ("double", "int", "discrete", "categorical"):
            errors.append(f"{where}.parameterType: unsupported value {ptype}")
        if fs.get("distribution", "") not in ("", "uniform", "logUniform", "normal", "logNormal"):
            errors.append(f"{where}.feasibleSpace.distribution: unsupported {fs['distribution']}")
        if ptype in ("double", "int"):
            cast = int if ptype == "int" else float
            try:
                low, high = cast(fs.get("min")), cast(fs.get("max"))
            except (TypeError, ValueError):
                errors.append(f"{where}.feasibleSpace: min/max must parse as {ptype}: {fs}")
                continue
            if not low < high:
                errors.append(f"{where}.feasibleSpace: min {low} must be below max {high}")
    template = spec.get("trialTemplate") or {}
    if not template.get("successCondition") or not template.get("failureCondition"):
        errors.append("spec.trialTemplate: successCondition and failureCondition must be specified")
    declared = {}
    for i, tp in enumerate(template.get("trialParameters") or []):
        if tp.get("name") in declared or "{" in tp.get("name", "{") or "}" in tp.get("name", ""):
            errors.append(f"spec.trialTemplate.trialParameters[{i}].name: missing or duplicated")
        declared[tp.get("name")] = tp
        if tp.get("reference") not in params:
            errors.append(
                f"spec.trialTemplate.trialParameters[{i}].reference: "
                f"{tp.get('reference')!r} is not a parameter"
            )
    trial_spec = template.get("trialSpec")
    if not isinstance(trial_spec, dict):
        return [*errors, "spec.trialTemplate.trialSpec: Required value"]
    trial_meta = trial_spec.get("metadata") or {}
    if trial_meta.get("name") or trial_meta.get("namespace"):
        errors.append(
            "spec.trialTemplate.trialSpec.metadata: name and namespace must be omitted (Katib)"
        )
    used = set(_PLACEHOLDER.findall(json.dumps(trial_spec)))
    for name in sorted(used - declared.keys()):
        errors.append(f"spec.trialTemplate.trialSpec: ${{trialParameters.{name}}} is not declared")
    for name in sorted(declared.keys() - used):
        errors.append(f"spec.trialTemplate.trialParameters: {name} is not used in trialSpec")
    primary = template.get("primaryContainerName")
    containers = [
        c.get("name")
        for r in ((trial_spec.get("spec") or {}).get("pytorchReplicaSpecs") or {}).values()
        for c in ((r.get("template") or {}).get("spec") or {}).get("containers") or []
    ]
    if primary not in containers:
        errors.append(f"spec.trialTemplate.primaryContainerName: {primary!r} not in trialSpec")
    return errors


def inferenceservice_semantics(body: dict[str, Any]) -> list[str]:
    """What KServe's validating webhook rejects (pkg/apis/serving/v1beta1/
    inference_service_validation.go validateInferenceService) for a predictor: the name
    format, exactly one implementation, no `name` in a standard predictor, the replica
    bounds and the custom predictor's protocol. A canaryTrafficPercent outside 0..100 is
    not the webhook's: Knative refuses it later (the sim's KServe reports it)."""
    errors = []
    name = (body.get("metadata") or {}).get("name") or ""
    if name and not _ISVC_NAME.match(name):
        errors.append(
            f"metadata.name: the InferenceService {name!r} is invalid: a InferenceService name "
            "must consist of lower case alphanumeric characters or '-', and must start with "
            f"alphabetical character (regex used for validation is '{_ISVC_NAME.pattern[1:-1]}')"
        )
    predictor = (body.get("spec") or {}).get("predictor")
    if not isinstance(predictor, dict):
        return errors  # the schema names a missing predictor
    found = [k for k in _PREDICTOR_IMPLEMENTATIONS if predictor.get(k) is not None]
    if predictor.get("containers"):
        found.append("containers")
    if len(found) != 1:
        # component.go validateExactlyOneImplementation / ExactlyOneErrorFor
        errors.append(
            "spec.predictor: exactly one of ["
            + ", ".join(_PREDICTOR_IMPLEMENTATIONS)
            + ", containers] must be specified in PredictorSpec"
            + (f" (found {', '.join(found)})" if found else "")
        )
    for impl in _PREDICTOR_IMPLEMENTATIONS:  # validatePredictor
        if isinstance(predictor.get(impl), dict) and predictor[impl].get("name"):
            errors.append(
                f"spec.predictor.{impl}.name: the 'name' field is not allowed in standard predictor"
            )
    low, high = predictor.get("minReplicas", 1), predictor.get("maxReplicas", 0)
    if isinstance(low, int) and isinstance(high, int):  # component.go validateReplicas
        if low < 0:
            errors.append("spec.predictor.minReplicas: 'MinReplicas' cannot be less than 0")
        if high < 0:
            errors.append("spec.predictor.maxReplicas: 'MaxReplicas' cannot be less than 0")
        if low > high and high != 0:
            errors.append(
                "spec.predictor.minReplicas: 'MinReplicas' cannot be greater than MaxReplicas"
            )
    concurrency = predictor.get("containerConcurrency")
    if isinstance(concurrency, int) and concurrency < 0:
        errors.append("spec.predictor.containerConcurrency: parallelism cannot be less than 0")
    for container in (predictor.get("containers") or [])[:1]:  # CustomPredictor.Validate
        for env in container.get("env") or []:
            if env.get("name") == "PROTOCOL" and env.get("value") not in ("v1", "v2"):
                errors.append(
                    f"spec.predictor.containers[0].env: invalid protocol {env.get('value')}. "
                    "Must be one of [v1, v2]"
                )
    return errors


def servingruntime_errors(directory: Path, body: dict[str, Any]) -> list[str]:
    """A ServingRuntime or ClusterServingRuntime against the vendored ServingRuntime CRD."""
    check = crd_check(directory / SERVINGRUNTIME_CRD, "v1alpha1")
    errors = metadata_errors(body) + check(body)
    if body.get("apiVersion") != "serving.kserve.io/v1alpha1":
        errors.append("apiVersion: expected serving.kserve.io/v1alpha1")
    return errors


_POD_SPEC_CHECKS: dict[int, SchemaCheck] = {}


def _pod_spec_check(schema: dict[str, Any]) -> SchemaCheck:
    if id(schema) not in _POD_SPEC_CHECKS:
        _POD_SPEC_CHECKS[id(schema)] = SchemaCheck(schema)
    return _POD_SPEC_CHECKS[id(schema)]


def validators(directory: Path) -> dict[str, Validator]:
    """plural -> body validator; each loads its schema on first use."""

    def pytorchjob(body: dict[str, Any]) -> list[str]:
        check = crd_check(directory / PYTORCHJOB_CRD, "v1")
        return metadata_errors(body) + check(body) + pytorchjob_semantics(body)

    def inferenceservice(body: dict[str, Any]) -> list[str]:
        check = crd_check(directory / INFERENCESERVICE_CRD, "v1beta1")
        return metadata_errors(body) + check(body) + inferenceservice_semantics(body)

    def experiment(body: dict[str, Any]) -> list[str]:
        # The Experiment CRD preserves unknown fields; Katib's OpenAPI spec is the real schema.
        check = swagger_check(directory / KATIB_SWAGGER, "v1beta1.Experiment")
        errors = metadata_errors(body) + check(body) + katib_semantics(body)
        trial = ((body.get("spec") or {}).get("trialTemplate") or {}).get("trialSpec")
        if isinstance(trial, dict):
            where = "spec.trialTemplate.trialSpec"
            if (trial.get("apiVersion"), trial.get("kind")) != ("kubeflow.org/v1", "PyTorchJob"):
                errors.append(f"{where}: expected a kubeflow.org/v1 PyTorchJob")
            else:
                job_check = crd_check(directory / PYTORCHJOB_CRD, "v1")
                errors += job_check(trial, where) + pytorchjob_semantics(trial, where)
        return errors

    def pod(body: dict[str, Any]) -> list[str]:
        # No Pod schema is vendored; the PodSpec inside the PyTorchJob CRD is the real one.
        template = crd_check(directory / PYTORCHJOB_CRD, "v1").schema["properties"]["spec"]
        spec = template["properties"]["pytorchReplicaSpecs"]["additionalProperties"]
        pod_spec = spec["properties"]["template"]["properties"]["spec"]
        errors = metadata_errors(body)
        errors += [e for e in _pod_spec_check(pod_spec)(body.get("spec") or {}, "spec")]
        unknown = set(body) - {"apiVersion", "kind", "metadata", "spec", "status"}
        return errors + [f"{k}: unknown field" for k in sorted(unknown)]

    def trainjob(body: dict[str, Any]) -> list[str]:
        return metadata_errors(body) + crd_check(directory / TRAINJOB_CRD, "v1alpha1")(body)

    def clustertrainingruntime(body: dict[str, Any]) -> list[str]:
        check = crd_check(directory / CLUSTERTRAININGRUNTIME_CRD, "v1alpha1")
        return metadata_errors(body) + check(body)

    def jobset(body: dict[str, Any]) -> list[str]:
        return metadata_errors(body) + crd_check(directory / JOBSET_CRD, "v1alpha2")(body)

    def job(body: dict[str, Any]) -> list[str]:
        # No batch/v1 Job schema is vendored; the JobTemplateSpec inside the JobSet CRD is the
        # real one (its metadata is opaque, like every CRD's).
        root = crd_check(directory / JOBSET_CRD, "v1alpha2").schema["properties"]["spec"]
        template = root["properties"]["replicatedJobs"]["items"]["properties"]["template"]
        errors = metadata_errors(body)
        errors += _pod_spec_check(template["properties"]["spec"])(body.get("spec") or {}, "spec")
        unknown = set(body) - {"apiVersion", "kind", "metadata", "spec", "status"}
        return errors + [f"{k}: unknown field" for k in sorted(unknown)]

    def trial(body: dict[str, Any]) -> list[str]:
        # Katib creates Trials (nobody else may); its OpenAPI spec names them ".v1beta1.Trial".
        check = swagger_check(directory / KATIB_SWAGGER, ".v1beta1.Trial")
        return metadata_errors(body) + check(body)

    return {
        "pods": pod,
        "trials": trial,
        "pytorchjobs": pytorchjob,
        "inferenceservices": inferenceservice,
        "experiments": experiment,
        "trainjobs": trainjob,
        "clustertrainingruntimes": clustertrainingruntime,
        "jobsets": jobset,
        "jobs": job,
    }
