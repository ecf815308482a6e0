"""stages.deploy.serve_request: the pipeline's serving parameters reach the InferenceService
(issue 20, point 6), and the dtype it serves in is the one evaluate measured in.

Cheap and in-process: no server, no pipeline. The bodies are validated against KServe's
InferenceService CRD by the fake API server (tests/fakes), as tests/k8s does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fakes.fake_k8s import FakeK8s
from fakes.k8s_schemas import crds_dir
from kubellm.backends.kubernetes.inferenceservice import build_inferenceservice
from kubellm.config import CHECKPOINT_DTYPE, ModelConfig, pipeline_config
from kubellm.stages.deploy import serve_request

URI = "s3://models/kubellm-tiny/4/model"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeK8s]:
    with FakeK8s(crds_dir()) as f:
        yield f


def body(overrides: dict[str, Any], fake: FakeK8s) -> dict[str, Any]:
    cfg = pipeline_config(overrides)
    out = build_inferenceservice(serve_request(cfg, URI, "run-7", "4"))
    assert fake.validate("inferenceservices", out) == []
    return out


def test_defaults_serve_in_the_checkpoints_dtype_and_stay_in_the_cluster(fake: FakeK8s) -> None:
    """On a GPU, KServe's Hugging Face runtime left to itself would serve the float32
    checkpoint in half precision (vLLM's auto, the HF backend's float16) and the smoke test's
    token-for-token comparison with evaluate would fail; the default says float32. The
    default visibility is cluster-local: the canary's tag URL is never published."""
    out = body({"serving_gpus": 1}, fake)
    predictor = out["spec"]["predictor"]
    assert predictor["model"]["args"] == ["--model_name=kubellm-tiny", "--dtype=float32"]
    labels = out["metadata"]["labels"]
    assert labels["networking.knative.dev/visibility"] == "cluster-local"
    assert labels["networking.kserve.io/visibility"] == "cluster-local"
    for key in ("nodeSelector", "tolerations", "serviceAccountName"):
        assert key not in predictor, key


def test_every_serving_parameter_reaches_the_predictor(fake: FakeK8s) -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    out = body(
        {
            "serving_gpus": 2,
            "serving_dtype": "bfloat16",
            "serving_max_model_len": 64,
            "serving_node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "serving_tolerations": [toleration],
            "serving_service_account": "kserve-s3",
            "serving_cluster_local": False,
        },
        fake,
    )
    predictor = out["spec"]["predictor"]
    assert predictor["model"]["args"] == [
        "--model_name=kubellm-tiny",
        "--dtype=bfloat16",
        "--max_model_len=64",
    ]
    assert predictor["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert predictor["tolerations"] == [toleration]
    assert predictor["serviceAccountName"] == "kserve-s3"
    assert "networking.knative.dev/visibility" not in out["metadata"]["labels"]


def test_the_custom_runtime_gets_placement_but_no_runtime_flags(fake: FakeK8s) -> None:
    out = body(
        {
            "serving_runtime": "custom",
            "serving_node_selector": {"pool": "serving"},
            "serving_service_account": "kserve-s3",
        },
        fake,
    )
    predictor = out["spec"]["predictor"]
    (container,) = predictor["containers"]
    assert not any(a.startswith("--dtype") for a in container["args"])
    assert predictor["nodeSelector"] == {"pool": "serving"}
    assert predictor["serviceAccountName"] == "kserve-s3"


def test_an_exported_checkpoint_is_what_the_default_dtype_says(tmp_path: Path) -> None:
    """The default serving_dtype is the dtype evaluate measures in: the exported checkpoint's,
    which from_pretrained's default (`auto`: config.json's dtype) loads, for evaluate
    (kubellm.serve.generate.load_model) and `kubellm serve` alike. Training keeps float32
    weights (bf16 is autocast only) and exports them as they are."""
    from kubellm.data.synthetic import arithmetic_records
    from kubellm.data.tokenizer import train_bpe
    from kubellm.serve.generate import load_model
    from kubellm.train.model import export, new_llama

    tokenizer = train_bpe([r["text"] for r in arithmetic_records(200, seed=0)], vocab_size=300)
    shape = ModelConfig(
        hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_position_embeddings=32
    )
    export(new_llama(shape, tokenizer), tokenizer, str(tmp_path / "model"))

    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == CHECKPOINT_DTYPE == "float32"
    model, _ = load_model(tmp_path / "model")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
