"""The server loads a registered MLflow transformers model directory as KServe's storage
initializer leaves it in /mnt/models (weights in model/, tokenizer in components/tokenizer/),
and a plain Hugging Face directory as before."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from kubellm.serve.generate import greedy_with_margins, load_model
from kubellm.serve.layout import is_mlflow_model, model_paths
from kubellm.serve.model import CausalLMModel
from serve.compare import assert_same_greedy

PROMPTS = ["12+7=", "3+4=", "100+1="]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def mlflow_layout(hf_dir: Path, root: Path) -> Path:
    """hf_dir split the way mlflow.transformers.save_model writes it."""
    (root / "model").mkdir(parents=True)
    (root / "components" / "tokenizer").mkdir(parents=True)
    for f in hf_dir.iterdir():
        dest = "components/tokenizer" if f.name in TOKENIZER_FILES else "model"
        shutil.copy(f, root / dest / f.name)
    (root / "MLmodel").write_text("flavors:\n  transformers:\n    model_binary: model\n")
    return root


def test_paths_of_each_layout(tiny_model_dir: Path, tmp_path: Path) -> None:
    root = mlflow_layout(tiny_model_dir, tmp_path / "mlflow")
    assert is_mlflow_model(root) and not is_mlflow_model(tiny_model_dir)
    assert model_paths(root) == (root / "model", root / "components" / "tokenizer")
    assert model_paths(tiny_model_dir) == (tiny_model_dir, tiny_model_dir)
    shutil.rmtree(root / "components")  # a tokenizer saved with the weights
    assert model_paths(root) == (root / "model", root / "model")


def test_mlflow_layout_serves_what_the_hugging_face_directory_does(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    root = mlflow_layout(tiny_model_dir, tmp_path / "mlflow")
    model, tokenizer = load_model(tiny_model_dir)
    expected = greedy_with_margins(model, tokenizer, PROMPTS, 6)
    assert len({a for a, _ in expected}) > 1, "the tiny model must tell prompts apart"
    served = CausalLMModel("tiny", root)
    assert served.load() and served.ready
    try:
        payload = {"instances": [{"prompt": p, "max_new_tokens": 6} for p in PROMPTS]}
        predictions = asyncio.run(served.predict(payload))["predictions"]
        assert_same_greedy(predictions, expected, "mlflow layout")
        assert served.tokenizer.chat_template  # the tokenizer component keeps its template
    finally:
        served.stop()


def test_a_directory_without_weights_says_so(tmp_path: Path) -> None:
    (tmp_path / "MLmodel").write_text("flavors: {}\n")
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        load_model(tmp_path)
