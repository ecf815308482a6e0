"""The KFP runtime's own requests (fakes/kfp_runtime.py) against the Role in
manifests/base/rbac.yaml, enforced by the fake API server.

KFP runs the driver and the launcher of every step as the run's ServiceAccount: the root
driver reads ConfigMap kfp-launcher and tolerates only NotFound, and each launcher reads the
artifact store's Secret before the step starts. A Role without those grants fails a real
run at its first step, which kfp.local alone never shows.
"""

# No `from __future__ import annotations`: KFP reads the components' annotations as types.
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kfp import compiler, dsl

from fakes.fake_k8s import FakeK8s
from fakes.k8s_rbac import REPO_RBAC
from fakes.k8s_schemas import crds_dir
from fakes.kfp_runtime import (
    ARTIFACT_SECRET,
    LAUNCHER_CONFIGMAP,
    PIPELINES_ENABLED,
    KfpRuntimeError,
    KubeApi,
    final_status,
    install_profile_objects,
    launcher,
    namespace_labels,
    profile_controller_sync,
    root_driver,
    run_pipeline,
)
from kubellm.stages import summarize

NAMESPACE = "kubellm"
USER = "system:serviceaccount:kubellm:kubellm-pipeline"
KFP_RUNTIME_RESOURCES = ("configmaps", "secrets")


def role_without(tmp_path: Path, resources: tuple[str, ...]) -> Path:
    """The repo's rbac.yaml less its rules on `resources`: with both of
    KFP_RUNTIME_RESOURCES, the Role as it was before the KFP runtime's grants."""
    docs = [d for d in yaml.safe_load_all(REPO_RBAC.read_text()) if d]
    for doc in docs:
        if doc.get("kind") == "Role":
            doc["rules"] = [
                r for r in doc["rules"] if not set(r.get("resources") or ()) & set(resources)
            ]
    path = tmp_path / "rbac.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


@dataclass(frozen=True)
class Case:
    name: str
    dropped: tuple[str, ...]  # Role rules left out (by resource)
    profile: bool  # KFP's profile controller synced the namespace (its label is set)
    secret: dict[str, str] | None = None  # replaces the profile's Secret data
    launcher_config: dict[str, str] | None = None  # replaces the profile's kfp-launcher data
    error: str = ""  # what the driver or launcher fails with ("" = both succeed)
    forbidden: list[str] = field(default_factory=list)  # the fake's refusals, by path


CASES = [
    Case(
        "the Role before the KFP runtime's grants: the root driver is refused",
        KFP_RUNTIME_RESOURCES,
        profile=True,
        error=(
            "driver.RootDAG(pipelineName=kubellm-llm-train, runID=run-1, runtimeConfig) failed: "
            f'configmaps "kfp-launcher" is forbidden: User "{USER}" cannot get resource '
            f'"configmaps" in API group "" in the namespace "{NAMESPACE}"'
        ),
        forbidden=[f"/api/v1/namespaces/{NAMESPACE}/configmaps/kfp-launcher"],
    ),
    Case(
        "the ConfigMap grant alone: the launcher is refused the Secret",
        ("secrets",),
        profile=True,
        error=(
            'failed to execute component: Failed to open bucket "mlpipeline": failed to '
            "retrieve credentials for bucket mlpipeline: failed to get Bucket credentials "
            f'from secret name="{ARTIFACT_SECRET}" namespace="{NAMESPACE}": secrets '
            f'"{ARTIFACT_SECRET}" is forbidden: User "{USER}" cannot get resource "secrets" '
            f'in API group "" in the namespace "{NAMESPACE}"'
        ),
        forbidden=[f"/api/v1/namespaces/{NAMESPACE}/secrets/{ARTIFACT_SECRET}"],
    ),
    Case("the repo's Role in a namespace KFP's profile controller synced", (), profile=True),
    Case(
        "no profile sync: kfp-launcher NotFound is tolerated, the missing Secret is not",
        (),
        profile=False,
        error=f'namespace="{NAMESPACE}": secrets "{ARTIFACT_SECRET}" not found',
    ),
    Case(
        "an s3 root without providers: credentials from the environment, no Secret read",
        (),
        profile=False,
        launcher_config={"defaultPipelineRoot": "s3://artifacts/kubellm"},
    ),
    Case(
        "a Secret without the keys",
        (),
        profile=True,
        secret={"user": "x"},
        error="could not find specified keys 'accesskey' or 'secretkey'",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_driver_and_launcher_under_the_role(tmp_path: Path, case: Case) -> None:
    with FakeK8s(crds_dir(), rbac=role_without(tmp_path, case.dropped)) as fake:
        if case.profile:
            install_profile_objects(fake, NAMESPACE, {"pipelines.kubeflow.org/enabled": "true"})
        if case.secret is not None:
            fake.secrets[(NAMESPACE, ARTIFACT_SECRET)] = case.secret
        if case.launcher_config is not None:
            fake.config_maps[(NAMESPACE, LAUNCHER_CONFIGMAP)] = case.launcher_config
        api = KubeApi(fake.write_kubeconfig(tmp_path / "kubeconfig", NAMESPACE))
        warnings: list[str] = []
        try:
            run = root_driver(api, "kubellm-llm-train", run_id="run-1")
            launcher(api, run, "step-pod", warnings.append)
        except KfpRuntimeError as e:
            error = str(e)
        else:
            error = ""
        assert error.endswith(case.error) if case.error else error == "", error
        assert [d.path for d in fake.forbidden] == case.forbidden
        gets = [r.path for r in fake.requests if r.method == "GET"]
        assert gets[0] == f"/api/v1/namespaces/{NAMESPACE}/configmaps/{LAUNCHER_CONFIGMAP}"
        if not error:
            secret_read = [f"/api/v1/namespaces/{NAMESPACE}/secrets/{ARTIFACT_SECRET}"]
            assert gets == [
                f"/api/v1/namespaces/{NAMESPACE}/configmaps/{LAUNCHER_CONFIGMAP}",
                *(secret_read if case.launcher_config is None else []),
                f"/api/v1/namespaces/{NAMESPACE}/pods/step-pod",  # its retry index: tolerated
            ]
            default_root = f"minio://mlpipeline/private-artifacts/{NAMESPACE}/v2/artifacts"
            assert run.pipeline_root == (case.launcher_config or {}).get(
                "defaultPipelineRoot", default_root
            )
            assert warnings and "defaulting to 0" in warnings[0]  # the pod is not in the fake


def test_the_shipped_namespace_gets_the_objects_the_runtime_reads(tmp_path: Path) -> None:
    """manifests/base/namespace.yaml's label is what makes KFP's profile controller create
    kfp-launcher and the artifact Secret; with the shipped Role, nothing is refused."""
    with FakeK8s(crds_dir()) as fake:
        install_profile_objects(fake, NAMESPACE, namespace_labels())
        api = KubeApi(fake.write_kubeconfig(tmp_path / "kubeconfig", NAMESPACE))
        run = root_driver(api, "kubellm-llm-train")
        launcher(api, run, "step-pod", lambda _: None)
        assert fake.forbidden == []
        assert (NAMESPACE, ARTIFACT_SECRET) in fake.secrets
    # sync.py: a namespace without the label gets nothing
    assert profile_controller_sync(NAMESPACE, {}) == ({}, {})
    assert profile_controller_sync(NAMESPACE, {PIPELINES_ENABLED: "false"}) == ({}, {})


def test_the_exit_handler_gets_the_backends_state_and_summarize_reads_it_as_success() -> None:
    run = type("Run", (), {"run_name": "kubellm-llm-train-abcde"})()
    local = {"state": "SUCCEEDED", "pipeline_task_name": "exit-handler-1", "error": {}}
    status = final_status(local, run)  # type: ignore[arg-type]
    assert status == {
        "state": "COMPLETE",
        "pipelineJobResourceName": "kubellm-llm-train-abcde",
        "pipelineTaskName": "exit-handler-1",
        "error": {},
    }
    assert summarize.outcome(status["state"]) == "SUCCEEDED"
    failed = final_status({**local, "state": "FAILED", "error": {"code": 1}}, run)  # type: ignore[arg-type]
    assert (failed["state"], failed["error"]) == ("FAILED", {})


# ------------------------------------------------------------------ through kfp.local


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def _step() -> str:
    return "ran"


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def _exit(status: dsl.PipelineTaskFinalStatus, seen: dsl.Output[dsl.Artifact]):
    import json

    with open(seen.path, "w") as f:
        json.dump({"state": status.state, "error": status.error_message}, f)


@dsl.pipeline(name="kfp-runtime-test")
def _pipeline():
    handler = _exit()
    with dsl.ExitHandler(handler, name="body"):
        _step()


@pytest.fixture(scope="module")
def pipeline_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kfp-runtime") / "pipeline.yaml"
    compiler.Compiler().compile(_pipeline, str(path))
    return path


def _run(
    tmp_path: Path, pipeline_yaml: Path, rbac: Path, labels: dict[str, str] | None = None
) -> tuple[int, list[str], Any]:
    lines: list[str] = []
    with FakeK8s(crds_dir(), rbac=rbac) as fake:
        install_profile_objects(fake, NAMESPACE, namespace_labels() if labels is None else labels)
        kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig", NAMESPACE)
        code = run_pipeline(
            pipeline_yaml, tmp_path / "root", {}, kubeconfig=kubeconfig, out=lines.append
        )
    return code, lines, fake


def test_kfp_local_runs_each_task_behind_the_launcher_and_hands_the_backends_status(
    tmp_path: Path, pipeline_yaml: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the tasks run `python3 -m kfp.dsl.executor_main`: this environment's python
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    code, lines, fake = _run(tmp_path, pipeline_yaml, REPO_RBAC)
    assert code == 0 and fake.forbidden == [], lines
    gets = [r.path.rsplit("/", 2)[-2:] for r in fake.requests if r.method == "GET"]
    assert gets.count(["configmaps", LAUNCHER_CONFIGMAP]) == 1  # the root driver, once
    assert gets.count(["secrets", ARTIFACT_SECRET]) == 2  # a launcher per task
    [seen] = (tmp_path / "root").glob("kfp-runtime-test-*/*exit*/seen")
    assert json.loads(seen.read_text()) == {"state": "COMPLETE", "error": None}


def test_with_the_role_before_the_grants_no_task_starts(
    tmp_path: Path, pipeline_yaml: Path
) -> None:
    code, lines, _ = _run(tmp_path, pipeline_yaml, role_without(tmp_path, KFP_RUNTIME_RESOURCES))
    assert code == 1
    assert 'failed: configmaps "kfp-launcher" is forbidden' in lines[-1], lines
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())


def test_a_refused_launcher_fails_its_task_before_the_task_runs(
    tmp_path: Path, pipeline_yaml: Path
) -> None:
    """A namespace KFP's profile controller never synced has no artifact Secret: every
    launcher fails, so no task's command runs, the exit handler's included."""
    code, lines, fake = _run(tmp_path, pipeline_yaml, REPO_RBAC, labels={})
    assert code == 0 and fake.forbidden == []
    refused = [line for line in lines if f'secrets "{ARTIFACT_SECRET}" not found' in line]
    assert [line.split(":")[1].strip() for line in refused] == ["step", "exit"], lines
    assert not list((tmp_path / "root").rglob("executor_output.json"))


def test_the_fake_serves_the_sims_configmaps_and_secrets_read_only(tmp_path: Path) -> None:
    """GET and list from SimCluster.config_maps / .secrets (the same dicts), Secret data
    base64 as the API server sends []byte; writes are not served."""
    import base64

    from kubernetes import client as k8s

    from fakes.sim_cluster import SimCluster

    sim = SimCluster(tmp_path, rbac=None)
    assert sim.secrets is sim.fake.secrets and sim.config_maps is sim.fake.config_maps
    sim.secrets[(NAMESPACE, ARTIFACT_SECRET)] = {"accesskey": "k"}
    sim.config_maps[(NAMESPACE, LAUNCHER_CONFIGMAP)] = {"defaultPipelineRoot": "minio://b/p"}
    with sim.fake:
        core = k8s.CoreV1Api(sim.api_client())
        secret = core.read_namespaced_secret(ARTIFACT_SECRET, NAMESPACE)
        assert base64.b64decode(secret.data["accesskey"]) == b"k"
        maps = core.list_namespaced_config_map(NAMESPACE).items
        assert [(m.metadata.name, m.data) for m in maps] == [
            (LAUNCHER_CONFIGMAP, {"defaultPipelineRoot": "minio://b/p"})
        ]
        assert core.list_namespaced_config_map("other").items == []
        with pytest.raises(k8s.ApiException) as missing:
            core.read_namespaced_config_map("absent", NAMESPACE)
        assert missing.value.status == 404
        assert json.loads(missing.value.body)["message"] == 'configmaps "absent" not found'
        with pytest.raises(k8s.ApiException) as write:
            core.create_namespaced_secret(NAMESPACE, {"metadata": {"name": "x"}})
        assert write.value.status == 405
