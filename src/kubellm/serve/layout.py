"""Where the weights and the tokenizer are in a model directory the server is given.

Two layouts load: a Hugging Face directory (config.json, safetensors and tokenizer files side
by side: the training stage's Model artifact) and an MLflow `transformers` model directory (a
registered version as MLflow stores it: `MLmodel`, the weights in `model/`, the tokenizer in
`components/tokenizer/`). KServe's storage initializer copies a registered version's
artifact to /mnt/models as is, so the server must read the MLflow layout too.

Plain paths only: no MLflow import, so the serving image needs nothing but the layout.
"""

from __future__ import annotations

from pathlib import Path

MLMODEL = "MLmodel"
WEIGHTS_DIR = "model"  # mlflow.transformers' model_binary
TOKENIZER_DIR = "components/tokenizer"


def is_mlflow_model(root: str | Path) -> bool:
    """An MLflow transformers model directory (as opposed to a Hugging Face one)."""
    root = Path(root)
    return (root / MLMODEL).is_file() and (root / WEIGHTS_DIR / "config.json").is_file()


def model_paths(root: str | Path) -> tuple[Path, Path]:
    """(weights directory, tokenizer directory) of either layout."""
    root = Path(root)
    if not is_mlflow_model(root):
        return root, root
    tokenizer = root / TOKENIZER_DIR
    weights = root / WEIGHTS_DIR
    return weights, tokenizer if tokenizer.is_dir() else weights
