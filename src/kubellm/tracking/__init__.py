"""MLflow lineage: one parent run per pipeline run, one child run per stage.

Why explicit run ids instead of mlflow's active-run globals: each stage is its own process
(a KFP task, a pod), so the parent run id travels as a pipeline value, and every child run
is tagged with the KFP run id so the exit handler can find them all again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from kubellm.redact import redact

TAG_KFP_RUN = "kubellm.kfp_run_id"
TAG_STAGE = "kubellm.stage"
TAG_PARENT = "mlflow.parentRunId"
TAG_NAME = "mlflow.runName"
TAG_FINGERPRINT = "kubellm.data_fingerprint"
# The training recipe (kubellm.recipe): on the prepare_data stage run and model versions.
TAG_RECIPE_FINGERPRINT = "kubellm.recipe_fingerprint"
# The gate's settings and the champion a candidate is judged against (kubellm.recipe).
TAG_GATE_FINGERPRINT = "kubellm.gate_fingerprint"
# The evaluate stage run's gate decision ("promote" or "reject") and its reason.
TAG_GATE = "kubellm.gate"
TAG_GATE_REASON = "kubellm.gate_reason"
# Registry aliases: a new version is the challenger until the smoke test makes it champion.
CHALLENGER = "challenger"
CHAMPION = "champion"


HEALTH_TIMEOUT_S = 5.0
# mlflow.environment_variables.MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT (read at each print)
SUPPRESS_RUN_URL_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
# How MLflow marks what a dataset input was used for (mlflow.log_input's `context`).
TAG_DATA_CONTEXT = "mlflow.data.context"


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server does not answer; the message names its URI."""


class TrackingUnauthorized(TrackingUnavailable):
    """The tracking server wants credentials (HTTP 401); the message names where they come
    from. manifests/base runs MLflow's basic-auth app, whose 401 body alone does not say.
    A TrackingUnavailable, so that `kubellm` reports it in one line (cli._error_code)."""


def _unauthorized(uri: str, err: MlflowException) -> TrackingUnauthorized | None:
    if err.get_http_status_code() != 401:
        return None
    given = os.environ.get("MLFLOW_TRACKING_USERNAME") or os.environ.get("MLFLOW_TRACKING_TOKEN")
    why = "refuses the credentials in" if given else "needs credentials: set"
    return TrackingUnauthorized(
        f"MLflow tracking server {redact(uri)} {why} MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD (HTTP 401); on a cluster they come from the keys username "
        "and password of the Secret mlflow-credentials"
    )


def check_reachable(uri: str, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Fail in seconds, naming `uri`, when an HTTP tracking server does not answer.

    MLflow's client retries a refused connection for minutes (7 retries, exponential
    backoff: 246 s measured) before it gives up; a pipeline should say at once that its
    tracking server is down. `GET /health` (the tracking server's own endpoint) with a short
    timeout: any answer but a 5xx (a proxy whose backend is down) counts as up, an auth
    error included (the calls that follow carry the credentials). Other URIs (sqlite, file,
    databricks) are not checked here.
    """
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    url = uri.rstrip("/") + "/health"
    try:
        status = requests.get(url, timeout=(min(3.0, timeout_s), timeout_s)).status_code
    except requests.RequestException as err:
        reason = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}" if str(err) else ""
        shown = redact(uri)
        raise TrackingUnavailable(
            f"MLflow tracking server {shown} is unreachable ({reason or type(err).__name__}); "
            "check mlflow_tracking_uri (or the kubellm-config ConfigMap) and that the server runs"
        ) from None
    if status >= 500:
        raise TrackingUnavailable(
            f"MLflow tracking server {redact(uri)} answers {redact(url)} with HTTP {status}; "
            "check that it runs"
        )


def dataset_input(model_name: str, manifest: dict[str, Any], split: str = "") -> Any:
    """The prepared dataset as an MLflow dataset (mlflow.data): named after the model, its
    digest the data fingerprint's first 10 hex digits (MLflow's recommended length; the
    full one is a tag of the input), its source the data the user gave, its profile the
    split sizes. The prepare run and the training run log the same one, so MLflow links
    them by (name, digest).

    `split="val"`: its held-out split alone, what the evaluate stage measures on (named
    `<model>-data-val`, its digest over the data fingerprint and the val shards' sha256),
    the dataset of the metrics on the registered LoggedModel."""
    from mlflow.data.meta_dataset import MetaDataset

    source = str(manifest["params"]["source"])
    rec, tokens = manifest["records"], manifest["tokens"]
    if split:
        h = hashlib.sha256(str(manifest["data_fingerprint"]).encode())
        for shard in manifest.get("shards", []):  # [{"name": "val/part-0.parquet", ...}]
            if str(shard["name"]).startswith(f"{split}/"):
                h.update(f"{shard['name']}:{shard['sha256']}".encode())
        name, digest = f"{model_name}-data-{split}", h.hexdigest()[:10]
        profile: dict[str, Any] = {
            "records": rec[split],
            "tokens": tokens[split],
            "rows": manifest["rows"][split],
            "eval_examples": rec.get("eval_examples", 0),
            "seq_len": manifest["seq_len"],
        }
    else:
        name, digest = f"{model_name}-data", str(manifest["data_fingerprint"])[:10]
        profile = {
            "records": {k: rec[k] for k in ("read", "kept", "train", "val")},
            "dropped": rec["dropped"],
            "tokens": {"train": tokens["train"], "val": tokens["val"]},
            "seq_len": manifest["seq_len"],
            "rows": manifest["rows"],
        }

    class _Prepared(MetaDataset):
        @property
        def profile(self) -> dict[str, Any]:
            return profile

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(self.profile)}

    return _Prepared(_source_of(source), name=name, digest=digest)


def _source_of(source: str) -> Any:
    """MLflow's own source type for one URI or existing path (s3://, gs://, http(s), a local
    file or folder), else a generic one that keeps the string (synthetic data, a glob,
    several comma-separated parts)."""
    import warnings
    from pathlib import Path

    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    if "," not in source and ("://" in source or Path(source).exists()):
        try:
            with warnings.catch_warnings():  # "can be interpreted in multiple ways": all local
                warnings.simplefilter("ignore", UserWarning)
                return resolve_dataset_source(source)
        except MlflowException:
            pass
    return CodeDatasetSource({"kubellm.data_source": source})


def champion_of(client: MlflowClient, model_name: str) -> Any | None:
    """The registered model's `champion` version, or None (no model, no alias)."""
    try:
        return client.get_model_version_by_alias(model_name, CHAMPION)
    except MlflowException:
        return None


@dataclass(frozen=True)
class Tracker:
    """The MLflow store of one pipeline run."""

    client: MlflowClient
    experiment_id: str
    kfp_run_id: str

    @classmethod
    def open(
        cls,
        tracking_uri: str,
        experiment_name: str,
        kfp_run_id: str,
        artifact_location: str | None = None,
    ) -> Tracker:
        """The experiment's store; `artifact_location` is used only when creating it."""
        if redact(tracking_uri) != tracking_uri:
            # MLflow prints "View run ... at: <the tracking URI>/#/..." as a run ends: not
            # with a password in it (kubellm.redact)
            os.environ.setdefault(SUPPRESS_RUN_URL_ENV, "true")
        client = MlflowClient(tracking_uri=tracking_uri)
        try:
            exp = client.get_experiment_by_name(experiment_name)
        except MlflowException as err:
            raise (_unauthorized(tracking_uri, err) or err) from None
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            try:
                exp_id = client.create_experiment(
                    experiment_name, artifact_location=artifact_location
                )
            except MlflowException:  # created meanwhile by a parallel step
                found = client.get_experiment_by_name(experiment_name)
                assert found is not None
                exp_id = found.experiment_id
        return cls(client, exp_id, kfp_run_id)

    def start_parent(self, name: str, params: dict[str, Any]) -> str:
        run = self.client.create_run(
            self.experiment_id,
            run_name=name,
            tags={TAG_KFP_RUN: self.kfp_run_id, TAG_STAGE: "pipeline"},
        )
        self.log(run.info.run_id, params=params)
        return str(run.info.run_id)

    def find_parent(self) -> str | None:
        """The parent run of this KFP run (the newest, should there be several)."""
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{TAG_KFP_RUN}` = '{self.kfp_run_id}' "
            f"and tags.`{TAG_STAGE}` = 'pipeline'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return str(runs[0].info.run_id) if runs else None

    def kill_running_children(self, parent_run_id: str, why: str) -> list[str]:
        """Stage runs still RUNNING (their step was killed: OOM, a deleted pod, a timeout)
        marked KILLED with `why`; returns their stage names."""
        killed = []
        for run in self.children(parent_run_id):
            if run.info.status == "RUNNING":
                self.client.set_tag(run.info.run_id, "kubellm.error", why[:4000])
                self.client.set_terminated(run.info.run_id, "KILLED")
                killed.append(str(run.data.tags.get(TAG_STAGE, run.info.run_id)))
        return killed

    def champion(self, model_name: str) -> Any | None:
        """The registered model's `champion` version, or None (no model, no alias)."""
        return champion_of(self.client, model_name)

    def children(self, parent_run_id: str) -> list[Any]:
        return list(
            self.client.search_runs(
                [self.experiment_id],
                filter_string=f"tags.`{TAG_PARENT}` = '{parent_run_id}'",
                order_by=["attributes.start_time ASC"],
            )
        )

    @contextmanager
    def stage(self, parent_run_id: str, stage: str) -> Iterator[str]:
        """A child run for one stage; FAILED (and re-raised) when the stage raises."""
        run = self.client.create_run(
            self.experiment_id,
            run_name=stage,
            tags={TAG_PARENT: parent_run_id, TAG_KFP_RUN: self.kfp_run_id, TAG_STAGE: stage},
        )
        run_id = str(run.info.run_id)
        try:
            yield run_id
        except BaseException as err:
            self.client.set_tag(run_id, "kubellm.error", str(err)[:4000])
            self.client.set_terminated(run_id, "FAILED")
            raise
        self.client.set_terminated(run_id, "FINISHED")

    def log(
        self,
        run_id: str,
        metrics: dict[str, float] | None = None,
        params: dict[str, Any] | None = None,
        tags: dict[str, Any] | None = None,
        step: int = 0,
    ) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, step) for k, v in (metrics or {}).items()],
            params=[Param(k, redact(str(v))[:6000]) for k, v in (params or {}).items()],
            tags=[RunTag(k, redact(str(v))[:5000]) for k, v in (tags or {}).items()],
        )

    def log_dataset(
        self,
        run_id: str,
        model_name: str,
        manifest: dict[str, Any],
        context: str,
        split: str = "",
    ) -> tuple[str, str]:
        """The prepared dataset (`dataset_input`, or one `split` of it) as an input of the
        run, used for `context`; the full data fingerprint rides along as a tag of the
        input. Returns its (name, digest)."""
        from mlflow.entities import DatasetInput, InputTag

        tags = [
            InputTag(TAG_DATA_CONTEXT, context),
            InputTag(TAG_FINGERPRINT, str(manifest["data_fingerprint"])),
        ]
        entity = dataset_input(model_name, manifest, split)._to_mlflow_entity()
        self.client.log_inputs(run_id, [DatasetInput(entity, tags)])
        return str(entity.name), str(entity.digest)

    def finish_parent(self, parent_run_id: str, succeeded: bool) -> None:
        self.client.set_terminated(parent_run_id, "FINISHED" if succeeded else "FAILED")
