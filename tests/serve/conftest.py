"""Fixtures for the serving tests: one tiny model directory for the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
