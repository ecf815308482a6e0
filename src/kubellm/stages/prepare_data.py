"""The prepare_data stage: the data_spec (data parameters and source file versions, made by
preflight) to the Dataset artifact.

It takes nothing run-specific, so two runs on the same data have the same KFP cache key and
a cluster reuses the dataset instead of preparing it again. What needs the run (its MLflow
lineage, the comparison with the champion) is the next stage, record_data, which never
caches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubellm.data.prepare import prepare
from kubellm.process import end_kfp_step_fast
from kubellm.stages.configs import spec_params
from kubellm.stages.context import StageResult, markdown_table

CHANGED = "changed"
UNCHANGED = "unchanged"


@dataclass
class Result(StageResult):
    manifest: dict[str, Any] = field(default_factory=dict)
    data_fingerprint: str = ""
    # the training recipe (kubellm.recipe), set by record_data: prepare_data knows only data
    recipe_fingerprint: str = ""
    data_state: str = CHANGED  # the DAG's condition: CHANGED trains, UNCHANGED stops here

    @property
    def fingerprint(self) -> str:
        return str(self.manifest.get("source_fingerprint", ""))


def metrics_of(manifest: dict[str, Any]) -> dict[str, float]:
    rec, tokens = manifest["records"], manifest["tokens"]
    return {
        "records_read": rec["read"],
        "records_kept": rec["kept"],
        "records_train": rec["train"],
        "records_val": rec["val"],
        "tokens_train": tokens["train"],
        "tokens_val": tokens["val"],
        **{f"dropped_{k}": v for k, v in rec["dropped"].items()},
    }


def report_of(
    manifest: dict[str, Any], verdict: str = "", recipe: str = "", recipe_about: str = ""
) -> str:
    rec, tokens = manifest["records"], manifest["tokens"]
    recipe_rows = [("recipe fingerprint", recipe), ("recipe", recipe_about)] if recipe else []
    dropped = [(f"dropped: {k}", v) for k, v in sorted(rec["dropped"].items())]
    return markdown_table(
        "Prepared data",
        [
            ("records read / kept", f"{rec['read']} / {rec['kept']}"),
            ("records train / val", f"{rec['train']} / {rec['val']}"),
            ("tokens train / val", f"{tokens['train']} / {tokens['val']}"),
            *dropped,
            ("data fingerprint", manifest["data_fingerprint"]),
            ("source fingerprint", manifest["source_fingerprint"]),
            *recipe_rows,
        ],
        verdict,
    )


def headline_of(manifest: dict[str, Any]) -> str:
    rec, tokens = manifest["records"], manifest["tokens"]
    return (
        f"{rec['kept']}/{rec['read']} records kept, {tokens['train']} train tokens, "
        f"fingerprint {manifest['data_fingerprint'][:12]}"
    )


def run(spec: str, out_dir: str | Path) -> Result:
    """The Dataset artifact from a data_spec (configs.data_spec); no tracking, no run id."""
    print("kubellm: prepare_data started", flush=True)
    t0 = time.monotonic()
    manifest = prepare(spec_params(spec), out_dir)
    result = Result(
        metrics={k: float(v) for k, v in metrics_of(manifest).items()},
        report=report_of(manifest),
        headline=headline_of(manifest),
        manifest=manifest,
        data_fingerprint=manifest["data_fingerprint"],
    )
    seconds = time.monotonic() - t0
    print(f"kubellm: prepare_data done in {seconds:.1f}s: {result.headline}", flush=True)
    end_kfp_step_fast()  # as StageContext.finish does
    return result
