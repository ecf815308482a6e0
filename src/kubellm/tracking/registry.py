"""The model registry: each registered version is one MLflow `transformers` model, and this
module is the way to it and back to files.

A version's artifact (logged once, by the register stage, under its MLflow run):

    MLmodel                 flavors transformers (task text-generation) and python_function,
                            signature, input example, model id, run id
    requirements.txt        pinned from the versions installed where it was logged
    model/                  config.json, generation_config.json, model.safetensors and a
                            copy of the tokenizer files: a Hugging Face directory on its own
                            (what KServe's Hugging Face runtime is given)
    components/tokenizer/   the tokenizer files

so `mlflow.transformers.load_model("models:/NAME/VERSION")` returns a text-generation
pipeline and `mlflow.pyfunc.load_model(...).predict(["12+7="])` generates text. Serving
reads the same artifact: `kubellm serve` loads this layout as is (kubellm.serve.layout),
and `download_hf_dir` assembles a plain Hugging Face directory from it (evaluate's champion,
the local server, a PVC copy for KServe).

Why not `mlflow.transformers.log_model`: its `Model.log` resolves the tracking server from the
process's global MLflow state (and, with a model id source, the sqlite registry does too),
while every kubellm stage carries its own client and run id. The steps here are the same
ones Model.log takes (a LoggedModel, the flavor's `save_model`, the artifacts, the run's
model output), each through the explicit client. Nothing reaches the Hugging Face Hub: the
model card is given and hub calls are switched off while saving; requirements are pinned,
not inferred (no pip subprocess).
"""

from __future__ import annotations

import importlib.metadata
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlflow.entities import LoggedModel, LoggedModelOutput
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from kubellm.config import ConfigError
from kubellm.redact import redact
from kubellm.serve.layout import TOKENIZER_DIR, WEIGHTS_DIR

TASK = "text-generation"
ARTIFACT_NAME = "model"
# The model version names the LoggedModel it was registered from.
TAG_LOGGED_MODEL = "kubellm.logged_model"
TAG_GATE = "kubellm.gate"  # the evaluate stage's decision (kubellm.evaluate.gate), copied
TAG_GATE_REASON = "kubellm.gate_reason"
# Storage KServe's storage initializer fetches itself; anything else is copied for it.
OBJECT_STORES = ("s3://", "gs://")
# What pyfunc predict uses unless the caller passes params: the pipeline's greedy decoding.
PREDICT_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 8,
    "do_sample": False,
    "return_full_text": False,
}
REQUIREMENTS = ("transformers", "torch", "safetensors", "tokenizers")


def pinned_requirements(packages: tuple[str, ...] = REQUIREMENTS) -> list[str]:
    """`name==version` of each installed package (the public version: a local label such as
    +cpu names a wheel index, not a release)."""
    from packaging.version import Version

    return [f"{p}=={Version(importlib.metadata.version(p)).public}" for p in packages]


def signature() -> Any:
    """Prompts in, completions out; generation options as params."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec(DataType.string)]),
        outputs=Schema([ColSpec(DataType.string)]),
        params=ParamSchema([ParamSpec("max_new_tokens", DataType.long, 8)]),
    )


@contextmanager
def _hub_offline() -> Iterator[None]:
    """No Hugging Face Hub calls while saving: mlflow.transformers looks up a license and a
    model card on the Hub for the model's name_or_path (retrying for about a minute where
    there is no network, or fetching a stranger's card where there is)."""
    import huggingface_hub.constants as hub

    before = hub.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = before


def log_transformers_model(
    client: MlflowClient,
    experiment_id: str,
    run_id: str,
    model_dir: str | Path,
    input_example: str,
    card_text: str,
    tags: dict[str, str] | None = None,
) -> LoggedModel:
    """Log the Hugging Face directory `model_dir` as an MLflow transformers model (a
    LoggedModel, output of run `run_id`); no remote code."""
    import mlflow.transformers
    from huggingface_hub import ModelCard
    from mlflow.models import Model

    from kubellm.serve.generate import load_model

    path = Path(model_dir).resolve()  # an absolute name_or_path is never taken for a Hub repo
    model, tokenizer = load_model(path, trust_remote_code=False)
    logged = client.create_logged_model(
        experiment_id,
        name=ARTIFACT_NAME,
        source_run_id=run_id,
        tags=tags,
        model_type="causal-lm",
    )
    try:
        with tempfile.TemporaryDirectory(prefix="mlflow-model-") as tmp, _hub_offline():
            local = Path(tmp) / ARTIFACT_NAME
            mlflow.transformers.save_model(
                {"model": model, "tokenizer": tokenizer},
                str(local),
                task=TASK,
                signature=signature(),
                input_example=input_example,
                pip_requirements=pinned_requirements(),
                model_card=ModelCard(card_text),
                model_config=dict(PREDICT_DEFAULTS),
                mlflow_model=Model(
                    artifact_path=logged.artifact_location,
                    model_uuid=logged.model_id,
                    run_id=run_id,
                    model_id=logged.model_id,
                ),
            )
            # with the Hub off, mlflow writes a LICENSE.txt that sends readers to
            # huggingface.co/<this machine's path>; the model card says what the license is
            (local / "LICENSE.txt").unlink(missing_ok=True)
            # model/ becomes a complete Hugging Face directory: KServe's Hugging Face runtime
            # loads weights and tokenizer from one folder (the storage URI), not MLflow's
            # layout; mlflow.transformers still reads its tokenizer from components/.
            if (local / TOKENIZER_DIR).is_dir():
                shutil.copytree(local / TOKENIZER_DIR, local / WEIGHTS_DIR, dirs_exist_ok=True)
            client.log_model_artifacts(logged.model_id, str(local))
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
    except BaseException:
        client.finalize_logged_model(logged.model_id, "FAILED")
        raise
    return client.finalize_logged_model(logged.model_id, "READY")


def register_version(
    client: MlflowClient,
    name: str,
    logged: LoggedModel,
    run_id: str,
    tags: dict[str, str],
    description: str = "kubellm causal LM",
) -> ModelVersion:
    """A new version of `name` (created if missing) whose source is the LoggedModel's
    artifact: a storage URI (s3://, mlflow-artifacts:/, file://) that KServe or a download
    reads without asking the registry again."""
    try:
        client.create_registered_model(name, description=description)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    return client.create_model_version(
        name,
        logged.artifact_location,
        run_id=run_id,
        tags={**tags, TAG_LOGGED_MODEL: logged.model_id},
        model_id=logged.model_id,
    )


def get_version(client: MlflowClient, name: str, version: str) -> ModelVersion:
    """Version `version` (a number or an alias) of `name`; ConfigError naming what is missing."""
    try:
        client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise ConfigError(
            f"no registered model {name!r} in {redact(client.tracking_uri)}; "
            "check the name and --tracking-uri"
        ) from None
    try:
        if version.isdigit():
            return client.get_model_version(name, version)
        return client.get_model_version_by_alias(name, version)
    except MlflowException as err:
        if err.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        known = sorted(
            (str(mv.version) for mv in client.search_model_versions(f"name = '{name}'")), key=int
        )
        kind = "version" if version.isdigit() else "alias"
        raise ConfigError(
            f"registered model {name!r} has no {kind} {version!r} "
            f"(versions: {', '.join(known) or 'none'})"
        ) from None


def is_object_store(uri: str) -> bool:
    return uri.startswith(OBJECT_STORES)


def download_hf_dir(client: MlflowClient, mv: ModelVersion, dest: str | Path) -> Path:
    """Version `mv` as a Hugging Face directory at `dest` (replaced): the weights and the
    tokenizer side by side, as `from_pretrained`, evaluate and the model server load them.

    A version registered before models were logged as MLflow models (its source a plain
    Hugging Face directory) comes down as it is.
    """
    import mlflow.artifacts

    from kubellm.serve.layout import is_mlflow_model

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        local = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=str(mv.source), dst_path=str(staging), tracking_uri=client.tracking_uri
            )
        )
        if dest.exists():
            shutil.rmtree(dest)
        if is_mlflow_model(local):
            shutil.copytree(local / WEIGHTS_DIR, dest)
            if (local / TOKENIZER_DIR).is_dir():
                shutil.copytree(local / TOKENIZER_DIR, dest, dirs_exist_ok=True)
        else:
            shutil.copytree(local, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not (dest / "config.json").is_file():
        raise FileNotFoundError(
            f"{mv.name} version {mv.version} ({mv.source}) holds no model: config.json is missing"
        )
    return dest
