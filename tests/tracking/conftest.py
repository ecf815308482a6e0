"""Fixtures for the tracking tests: real MLflow stores, sqlite and a real `mlflow server`.

Creating MLflow's sqlite schema takes seconds (its migrations), so it is made once per session
and each store here starts from its own copy of that empty, migrated database.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kubellm.backends import resolve
from kubellm.config import PipelineConfig
from serve.tiny_model import build_tiny_model
from tracking.mlflow_server import MlflowServer, running_mlflow_server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def migrated_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow sqlite database with the current schema."""
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    assert path.is_file()
    return path


@pytest.fixture
def local_cfg(tmp_path: Path, migrated_db: Path) -> PipelineConfig:
    """The local platform's config: MLflow on sqlite under runs_dir (this test's tmp_path)."""
    shutil.copyfile(migrated_db, tmp_path / "mlflow.db")
    cfg = resolve(PipelineConfig(platform="local", runs_dir=str(tmp_path)))
    assert cfg.mlflow_tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    return cfg


@pytest.fixture(scope="module")
def mlflow_server(
    tmp_path_factory: pytest.TempPathFactory, migrated_db: Path
) -> Iterator[MlflowServer]:
    """A real `mlflow server` on 127.0.0.1 (sqlite, proxied artifacts), stopped afterwards."""
    root = tmp_path_factory.mktemp("mlflow-server")
    shutil.copyfile(migrated_db, root / "m.db")
    with running_mlflow_server(root, root / "m.db") as server:
        yield server
