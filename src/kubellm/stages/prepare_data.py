"""The prepare_data stage: build the Dataset artifact, log its counts, and say whether the
data differs from what the current champion was trained on (a recurring run with nothing
new stops here instead of retraining on the same data)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kubellm.data.artifact import tokenizer_dir
from kubellm.data.prepare import PrepareParams, prepare
from kubellm.stages.configs import prepare_params
from kubellm.stages.context import StageContext, StageResult, markdown_table
from kubellm.tracking import TAG_FINGERPRINT

CHANGED = "changed"
UNCHANGED = "unchanged"
TAG_SOURCE_FINGERPRINT = "kubellm.source_fingerprint"
TAG_UNCHANGED = "kubellm.data_unchanged"
# How the run goes, not what it makes: not part of the data's identity.
_NOT_DATA = ("progress_s", "batch_records")


@dataclass
class Result(StageResult):
    manifest: dict[str, Any] = field(default_factory=dict)
    data_fingerprint: str = ""
    data_state: str = CHANGED  # the DAG's condition: CHANGED trains, UNCHANGED stops here

    @property
    def fingerprint(self) -> str:
        return str(self.manifest.get("source_fingerprint", ""))


def data_fingerprint(params: PrepareParams, manifest: dict[str, Any], out_dir: Path) -> str:
    """What the dataset is made of: the source records (their fingerprint), the preparation
    parameters and the tokenizer's files. Equal fingerprints, equal datasets."""
    h = hashlib.sha256()
    h.update(manifest["source_fingerprint"].encode())
    settings = {k: v for k, v in asdict(params).items() if k not in _NOT_DATA}
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    tok = tokenizer_dir(out_dir)
    for f in sorted(p for p in tok.rglob("*") if p.is_file()):
        h.update(f.relative_to(tok).as_posix().encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def unchanged_since(ctx: StageContext, fingerprint: str) -> str:
    """'champion vN' when the champion was trained on data with this fingerprint, else ''."""
    mv = ctx.tracker.champion(ctx.cfg.model_name)
    if mv is None:
        return ""
    same = (mv.tags or {}).get(TAG_FINGERPRINT) == fingerprint
    return f"champion v{mv.version}" if same else ""


def run(ctx: StageContext, out_dir: str | Path) -> Result:
    params = prepare_params(ctx.cfg)
    with ctx.stage("prepare_data") as run_id:
        manifest = prepare(params, out_dir)
        fingerprint = data_fingerprint(params, manifest, Path(out_dir))
        since = unchanged_since(ctx, fingerprint)
        state = UNCHANGED if since and not ctx.cfg.force else CHANGED
        verdict = (
            f"data unchanged since {since}: training skipped (force=true retrains)"
            if state == UNCHANGED
            else (f"data unchanged since {since}; force=true: retraining" if since else "")
        )
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
            tags={
                TAG_FINGERPRINT: fingerprint,
                TAG_SOURCE_FINGERPRINT: manifest["source_fingerprint"],
                **({TAG_UNCHANGED: verdict} if verdict else {}),
            },
        )
    if verdict:  # on the pipeline run too: what the MLflow UI shows first
        ctx.tracker.log(ctx.parent_run_id, tags={TAG_UNCHANGED: verdict})
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
                    ("data fingerprint", fingerprint),
                    ("source fingerprint", manifest["source_fingerprint"]),
                ],
                verdict,
            ),
            headline=f"{rec['kept']}/{rec['read']} records kept, "
            f"{tokens['train']} train tokens, fingerprint {fingerprint[:12]}"
            + (f"; {verdict}" if verdict else ""),
            manifest=manifest,
            data_fingerprint=fingerprint,
            data_state=state,
        ),
    )
