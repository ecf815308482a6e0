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

so `mlflow.transformers.load_model("models:/NAME@champion")` returns a text-generation
pipeline and `mlflow.pyfunc.load_model(...).predict([prompt])` generates text: its input
example is a prompt of the data the model was trained on, its default `max_new_tokens` the
longest held-out completion's (PredictDefaults, from the evaluate stage). The version is
registered from the LoggedModel (source `models:/<model_id>`, MLflow 3's link from a
version to its model page), which carries the evaluation's metrics, each with the
evaluation dataset (`link_evaluation`); its files stay at the LoggedModel's artifact
location (`storage_uri`). Serving
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
import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import LoggedModel, LoggedModelInput, LoggedModelOutput, Metric
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
# What pyfunc predict uses unless the caller passes params: the pipeline's greedy decoding
# (max_new_tokens comes from the data: PredictDefaults).
GREEDY: dict[str, Any] = {"do_sample": False, "return_full_text": False}
# The bounds of a data-derived default max_new_tokens (a caller's params may ask for more).
MAX_DEFAULT_NEW_TOKENS = 512
# MLflow's tag on a LoggedModel listing the versions registered from it (what
# mlflow.register_model writes; the model page links them).
TAG_MODEL_VERSIONS = "mlflow.modelVersions"
REQUIREMENTS = ("transformers", "torch", "safetensors", "tokenizers")


def pinned_requirements(packages: tuple[str, ...] = REQUIREMENTS) -> list[str]:
    """`name==version` of each installed package (the public version: a local label such as
    +cpu names a wheel index, not a release)."""
    from packaging.version import Version

    return [f"{p}=={Version(importlib.metadata.version(p)).public}" for p in packages]


@dataclass(frozen=True)
class PredictDefaults:
    """What pyfunc predict is shown and does by default, from the data the model was
    trained on: `input_example` one of its held-out prompts, `max_new_tokens` the budget
    the evaluate stage gave the longest held-out completion (bounded to 1..512);
    `origin` says where they were read (an MLmodel metadata entry)."""

    input_example: str
    max_new_tokens: int
    origin: str = ""

    def __post_init__(self) -> None:
        bounded = min(max(int(self.max_new_tokens), 1), MAX_DEFAULT_NEW_TOKENS)
        object.__setattr__(self, "max_new_tokens", bounded)

    def model_config(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_new_tokens, **GREEDY}


def signature(max_new_tokens: int) -> Any:
    """Prompts in, completions out; generation options as params."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec(DataType.string)]),
        outputs=Schema([ColSpec(DataType.string)]),
        params=ParamSchema([ParamSpec("max_new_tokens", DataType.long, max_new_tokens)]),
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
    defaults: PredictDefaults,
    card_text: str,
    tags: dict[str, str] | None = None,
) -> LoggedModel:
    """Log the Hugging Face directory `model_dir` as an MLflow transformers model (a
    LoggedModel, output of run `run_id`; its params the predict defaults); no remote code."""
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
                signature=signature(defaults.max_new_tokens),
                input_example=defaults.input_example,
                pip_requirements=pinned_requirements(),
                model_card=ModelCard(card_text),
                model_config=defaults.model_config(),
                metadata={"kubellm.predict_defaults_from": defaults.origin or "defaults"},
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
        client.log_model_params(
            logged.model_id, {"max_new_tokens": str(defaults.max_new_tokens), "task": TASK}
        )
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
    """A new version of `name` (created if missing) registered from the LoggedModel, as
    `mlflow.register_model("models:/<model_id>")` does it: source `models:/<model_id>` (the
    registry keeps the LoggedModel's artifact location as the version's storage, which
    `storage_uri` and downloads read), and the LoggedModel's `mlflow.modelVersions` tag
    lists the version.

    MLflow's SQL registry resolves a `models:/` source through the process's global
    tracking URI (sqlalchemy_store.create_model_version: `MlflowClient().get_logged_model`);
    it is pointed at this client's store for that one call. A tracking server resolves it
    on its side (and tags the LoggedModel itself). MLflow's open-source stores keep no
    model_id column: ModelVersion.model_id reads None there; the source names the model
    (and the kubellm.logged_model tag)."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    try:
        client.create_registered_model(name, description=description)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    with _use_tracking_uri(client.tracking_uri):
        mv = client.create_model_version(
            name,
            f"models:/{logged.model_id}",
            run_id=run_id,
            tags={**tags, TAG_LOGGED_MODEL: logged.model_id},
            model_id=logged.model_id,
        )
    # a tracking server lists it itself (handlers: set_model_versions_tags); a local store not
    listed = json.loads(client.get_logged_model(logged.model_id).tags.get(TAG_MODEL_VERSIONS, "[]"))
    if not any((v["name"], str(v["version"])) == (name, str(mv.version)) for v in listed):
        listed.append({"name": name, "version": str(mv.version)})
        client.set_logged_model_tags(logged.model_id, {TAG_MODEL_VERSIONS: json.dumps(listed)})
    return mv


def link_evaluation(
    client: MlflowClient,
    model_id: str,
    evaluation: Any,
    dataset: tuple[str, str] | None,
) -> list[Metric]:
    """The evaluate stage's figures (run `evaluation`, an mlflow Run) on the LoggedModel,
    each with the evaluation dataset (name, digest): the metrics of MLflow 3's model page.
    The champion's figures that run also holds (`champion_*`) are not this model's.

    They are logged to the evaluate run again with the model id, at their own timestamp
    and step, so the run's history keeps one point each (MLflow drops an identical metric)
    and each model metric names the run that measured it; that run also gets the model
    as an input (the model it evaluated)."""
    run_id = str(evaluation.info.run_id)
    name, digest = dataset if dataset else (None, None)
    linked = []
    for key in sorted(k for k in evaluation.data.metrics if not k.startswith("champion_")):
        for m in client.get_metric_history(run_id, key)[-1:]:
            linked.append(Metric(key, m.value, m.timestamp, m.step, model_id, name, digest))
    if linked:
        client.log_batch(run_id, metrics=linked)
    client.log_inputs(run_id, models=[LoggedModelInput(model_id)])
    return linked


def storage_uri(client: MlflowClient, mv: Any) -> str:
    """Where version `mv`'s files are: the source itself, unless it is a `models:/` URI
    (then the registry's storage location for it: the LoggedModel's artifact location, an
    s3://, gs://, mlflow-artifacts:/ or file:// URI)."""
    source = str(mv.source)
    if not source.startswith("models:/"):
        return source
    return str(client.get_model_version_download_uri(mv.name, str(mv.version)))


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
                artifact_uri=storage_uri(client, mv),
                dst_path=str(staging),
                tracking_uri=client.tracking_uri,
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
