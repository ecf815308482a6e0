"""The prepare_data stage: build the Dataset artifact and log its counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubellm.data.prepare import prepare
from kubellm.stages.configs import prepare_params
from kubellm.stages.context import StageContext, StageResult, markdown_table
from kubellm.tracking import TAG_FINGERPRINT


@dataclass
class Result(StageResult):
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return str(self.manifest.get("source_fingerprint", ""))


def run(ctx: StageContext, out_dir: str | Path) -> Result:
    params = prepare_params(ctx.cfg)
    with ctx.stage("prepare_data") as run_id:
        manifest = prepare(params, out_dir)
        rec, tokens = manifest["records"], manifest["tokens"]
        metrics = {
            "records_read": rec["read"],
            "records_kept": rec["kept"],
            "records_train": rec["train"],
            "records_val": rec["val"],
            "tokens_train": tokens["train"],
            "tokens_val": tokens["val"],
            **{f"dropped_{k}": v for k, v in rec["dropped"].items()},
        }
        ctx.tracker.log(
            run_id,
            metrics=metrics,
            params=vars(params),
            tags={TAG_FINGERPRINT: manifest["source_fingerprint"]},
        )
    dropped = [(f"dropped: {k}", v) for k, v in sorted(rec["dropped"].items())]
    return ctx.finish(
        "prepare_data",
        Result(
            metrics={k: float(v) for k, v in metrics.items()},
            report=markdown_table(
                "Prepared data",
                [
                    ("records read / kept", f"{rec['read']} / {rec['kept']}"),
                    ("records train / val", f"{rec['train']} / {rec['val']}"),
                    ("tokens train / val", f"{tokens['train']} / {tokens['val']}"),
                    *dropped,
                    ("fingerprint", manifest["source_fingerprint"]),
                ],
            ),
            headline=f"{rec['kept']}/{rec['read']} records kept, "
            f"{tokens['train']} train tokens, fingerprint {manifest['source_fingerprint'][:12]}",
            manifest=manifest,
        ),
    )
