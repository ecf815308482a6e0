"""kubellm.recipe and record_data's verdict: a recurring run skips training only when the
data AND the training recipe are the champion's, or when the same data+recipe was already
rejected by the gate (same gate settings, same champion); force=true trains in both cases.

Real MLflow on sqlite, a real (tiny) prepared dataset and the real register stage's lineage
tags; the champion's model version is registered without weights (nothing here loads it),
and the earlier runs' evaluate stage runs carry the gate tags the evaluate stage writes
(tests/stages/test_prepare_data.py runs the real evaluate stage for the same path).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field

from kubellm.config import PipelineConfig
from kubellm.recipe import (
    DATA_FIELDS,
    GATE_FIELDS,
    NOT_RECIPE,
    OPERATIONAL_FIELDS,
    RECIPE_FIELDS,
    gate_fingerprint,
    recipe_fields,
    recipe_of,
)
from kubellm.stages import prepare_data, record_data, register
from kubellm.stages.configs import data_spec
from kubellm.stages.context import StageContext
from kubellm.stages.record_data import CHANGED, TAG_REJECTED_IN, TAG_UNCHANGED, UNCHANGED
from kubellm.tracking import (
    CHAMPION,
    TAG_FINGERPRINT,
    TAG_GATE,
    TAG_GATE_FINGERPRINT,
    TAG_GATE_REASON,
    TAG_RECIPE_FINGERPRINT,
    Tracker,
)

BASE = dict(platform="local", num_records=100, vocab_size=64, seq_len=16, train_steps=30)


def _cfg(**values: Any) -> PipelineConfig:
    return PipelineConfig.model_validate({**BASE, **values})


# -- the classification -----------------------------------------------------------------


def _unclassified(model: type[PipelineConfig]) -> set[str]:
    return set(model.model_fields) - RECIPE_FIELDS - NOT_RECIPE


def test_every_pipeline_parameter_is_classified_exactly_once() -> None:
    """A new PipelineConfig field fails here until kubellm/recipe.py says whether it is
    recipe, data, gate or operational (until then it counts as recipe: retrains)."""
    groups = [RECIPE_FIELDS, DATA_FIELDS, GATE_FIELDS, OPERATIONAL_FIELDS]
    for a, b in itertools.combinations(groups, 2):
        assert not a & b, a & b
    assert _unclassified(PipelineConfig) == set()
    assert not NOT_RECIPE - set(PipelineConfig.model_fields)  # no stale names either
    assert set(recipe_fields()) == RECIPE_FIELDS

    class Grown(PipelineConfig):
        label_smoothing: float = Field(0.0, description="a new training setting")

    assert _unclassified(Grown) == {"label_smoothing"}  # what the check above would catch
    grown = recipe_of(Grown.model_validate(BASE))
    assert grown.settings["label_smoothing"] == "0.0"  # unclassified: part of the recipe


def _other(value: Any) -> Any:
    return f"{value}-other"  # model_copy does not validate: any different value will do


def test_what_the_recipe_leaves_to_the_data_fingerprint_is_data() -> None:
    """A field left out of the recipe as data must reach prepare_data (its parameters are
    in the data fingerprint), or neither fingerprint would see it change."""
    from dataclasses import asdict

    from kubellm.stages.configs import prepare_params

    cfg = _cfg()
    base = asdict(prepare_params(cfg))
    for name in sorted(DATA_FIELDS):
        moved = asdict(prepare_params(cfg.model_copy(update={name: _other(getattr(cfg, name))})))
        assert moved != base, f"{name} is not a preparation parameter"


def test_each_recipe_setting_moves_the_fingerprint_and_nothing_else_does() -> None:
    cfg = _cfg()
    base = recipe_of(cfg).fingerprint
    for name in sorted(RECIPE_FIELDS):
        moved = recipe_of(cfg.model_copy(update={name: _other(getattr(cfg, name))}))
        assert moved.fingerprint != base, name
    for name in sorted(NOT_RECIPE):
        same = recipe_of(cfg.model_copy(update={name: _other(getattr(cfg, name))}))
        assert same.fingerprint == base, name
    assert recipe_of(cfg, kubellm_version="9.9.9").fingerprint != base


def test_local_eval_data_and_base_model_count_by_content(tmp_path: Path) -> None:
    """The same path with other contents is another recipe; a URI or hub name counts by
    name. A base model's weight files count by size and ends, its small files whole."""
    evals = tmp_path / "eval.jsonl"
    evals.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    first = recipe_of(_cfg(eval_data=str(evals)))
    assert (
        first.eval_data_digest
        and first.fingerprint == recipe_of(_cfg(eval_data=str(evals))).fingerprint
    )
    evals.write_text('{"prompt": "1+1=", "answer": "3"}\n')
    assert recipe_of(_cfg(eval_data=str(evals))).fingerprint != first.fingerprint
    uri = recipe_of(_cfg(eval_data="s3://bucket/eval.jsonl"))
    assert uri.eval_data_digest == "" and uri.settings["eval_data"] == "s3://bucket/eval.jsonl"

    model = tmp_path / "base"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    weights = model / "model.safetensors"
    weights.write_bytes(b"\0" * (17 * 2**20))  # over the whole-file size
    before = recipe_of(_cfg(base_model=str(model)))
    assert before.base_model_digest
    assert f"base_model {model} (content {before.base_model_digest[:8]})" in before.describe()
    with weights.open("r+b") as f:  # a new checkpoint: other bytes at the end
        f.seek(-1, 2)
        f.write(b"\1")
    after_weights = recipe_of(_cfg(base_model=str(model)))
    assert after_weights.fingerprint != before.fingerprint
    (model / "config.json").write_text('{"hidden_size": 16}')
    assert recipe_of(_cfg(base_model=str(model))).fingerprint != after_weights.fingerprint
    assert recipe_of(_cfg(base_model="org/some-model")).base_model_digest == ""


def test_what_the_recipe_says_it_covers() -> None:
    got = recipe_of(_cfg()).describe()
    n = len(RECIPE_FIELDS) - 2  # base_model and eval_data are named on their own
    assert got == f"{n} training settings, base_model none, eval_data none, kubellm 0.1.0"


def test_the_gate_fingerprint_is_the_gate_settings_and_the_champion() -> None:
    cfg = _cfg()
    base = gate_fingerprint(cfg, "3")
    assert gate_fingerprint(cfg.model_copy(update={"train_steps": 31}), "3") == base
    assert gate_fingerprint(cfg.model_copy(update={"gate_min_accuracy": 0.1}), "3") != base
    assert gate_fingerprint(cfg.model_copy(update={"gate_guards": {"eval_loss": 0.1}}), "3") != base
    assert gate_fingerprint(cfg, "4") != base and gate_fingerprint(cfg, "") != base
    assert gate_fingerprint(cfg.model_copy(update={"model_name": "other"}), "3") != base


# -- record_data's verdict, against real MLflow -----------------------------------------


@dataclass
class Store:
    root: Path
    tracker: Tracker
    dataset: Path
    runs: itertools.count[int]

    def pipeline_run(self, model_name: str, **values: Any) -> StageContext:
        """A new pipeline run (its own KFP run id and MLflow parent run)."""
        kfp_run = f"run-{next(self.runs)}"
        tracker = Tracker(self.tracker.client, self.tracker.experiment_id, kfp_run)
        parent = tracker.start_parent(kfp_run, {})
        where = {"mlflow_tracking_uri": self.uri, "runs_dir": str(self.root / "runs")}
        cfg = _cfg(model_name=model_name, **where, **values)
        return StageContext(cfg, tracker, parent, kfp_run)

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.root / 'mlflow.db'}"

    def record(self, ctx: StageContext) -> prepare_data.Result:
        return record_data.run(ctx, self.dataset)

    def champion_from(self, ctx: StageContext, tags: dict[str, str] | None = None) -> str:
        """Register a version with the register stage's lineage tags of `ctx`'s run (no
        weights) and make it the champion; returns its version."""
        client, name = ctx.tracker.client, ctx.cfg.model_name
        if not client.search_registered_models(f"name = '{name}'"):
            client.create_registered_model(name)
        lineage = register.lineage_tags(ctx) if tags is None else tags
        mv = client.create_model_version(name, str(self.root / "no-weights"), tags=lineage)
        client.set_registered_model_alias(name, CHAMPION, mv.version)
        return str(mv.version)

    def judged(self, ctx: StageContext, decision: str, reason: str) -> None:
        """The run's evaluate stage run, tagged as the evaluate stage tags its verdict."""
        with ctx.tracker.stage(ctx.parent_run_id, "evaluate") as run_id:
            ctx.tracker.log(run_id, tags={TAG_GATE: decision, TAG_GATE_REASON: reason})


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("recipe")
    cfg = _cfg()
    prepare_data.run(data_spec(cfg), root / "dataset")
    tracker = Tracker.open(f"sqlite:///{root / 'mlflow.db'}", "recipe-tests", "setup")
    return Store(root, tracker, root / "dataset", itertools.count(1))


def _prepare_run(ctx: StageContext) -> Any:
    return ctx.stage_runs()["prepare_data"]


def test_a_recipe_change_on_the_champions_data_retrains_and_says_what_changed(
    store: Store,
) -> None:
    trained = store.pipeline_run("recipe-change")
    first = store.record(trained)
    version = store.champion_from(trained)
    mv = trained.tracker.client.get_model_version("recipe-change", version)
    assert mv.tags[TAG_RECIPE_FINGERPRINT] == first.recipe_fingerprint  # register's tag

    longer = store.pipeline_run("recipe-change", train_steps=31)
    got = store.record(longer)
    assert got.data_state == CHANGED
    assert got.data_fingerprint == first.data_fingerprint
    assert got.recipe_fingerprint != first.recipe_fingerprint
    said = f"data unchanged since champion v{version} but the recipe changed (train_steps 30 -> 31)"
    assert said in got.headline
    run = _prepare_run(longer)
    assert run.data.tags[TAG_RECIPE_FINGERPRINT] == got.recipe_fingerprint
    assert run.data.params["recipe.train_steps"] == "31"
    assert "recipe changed" in run.data.tags[TAG_UNCHANGED]
    parent = longer.tracker.client.get_run(longer.parent_run_id)
    assert "recipe changed" in parent.data.tags[TAG_UNCHANGED]

    image = store.pipeline_run("recipe-change", trainer_image="ghcr.io/kubellm/trainer:0.2.0")
    assert "trainer_image ghcr.io/kubellm/trainer:0.1.0 -> ghcr.io/kubellm/trainer:0.2.0" in (
        store.record(image).headline
    )


def test_the_champions_data_and_recipe_stop_the_run_naming_what_matched(store: Store) -> None:
    trained = store.pipeline_run("same-recipe")
    first = store.record(trained)
    version = store.champion_from(trained)

    again = store.pipeline_run("same-recipe", experiment_name="renamed", gate_margin=0.5)
    same = store.record(again)  # names, gate settings: not the recipe
    assert same.data_state == UNCHANGED
    assert same.recipe_fingerprint == first.recipe_fingerprint
    n = len(RECIPE_FIELDS) - 2
    said = (
        f"data and recipe unchanged since champion v{version} (data fingerprint "
        f"{first.data_fingerprint[:8]}…, recipe {first.recipe_fingerprint[:8]}…: {n} training "
        "settings, base_model none, eval_data none, kubellm 0.1.0): training skipped "
        "(force=true retrains)"
    )
    assert said in same.headline and said in same.report
    assert _prepare_run(again).data.tags[TAG_UNCHANGED] == said

    forced = store.record(store.pipeline_run("same-recipe", force=True))
    assert forced.data_state == CHANGED and "force=true: retraining" in forced.headline


def test_a_champion_without_a_recorded_recipe_retrains_once(store: Store) -> None:
    """Versions registered before recipe fingerprints: the data alone no longer skips."""
    trained = store.pipeline_run("old-champion")
    first = store.record(trained)
    store.champion_from(trained, tags={TAG_FINGERPRINT: first.data_fingerprint})
    got = store.record(store.pipeline_run("old-champion"))
    assert got.data_state == CHANGED and "its recipe is not recorded" in got.headline


def test_new_evaluation_data_retrains(store: Store) -> None:
    evals = store.root / "eval.jsonl"
    evals.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    trained = store.pipeline_run("new-evals", eval_data=str(evals))
    store.record(trained)
    store.champion_from(trained)
    assert store.record(store.pipeline_run("new-evals", eval_data=str(evals))).data_state == (
        UNCHANGED
    )
    evals.write_text('{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+3=", "answer": "6"}\n')
    got = store.record(store.pipeline_run("new-evals", eval_data=str(evals)))
    assert got.data_state == CHANGED and "eval_data_digest" in got.headline


def test_a_rejected_data_and_recipe_stops_naming_the_run_and_the_reason(store: Store) -> None:
    reason = "exact_match 0.12 < gate_min_accuracy 0.2"
    rejected = store.pipeline_run("rejected")
    first = store.record(rejected)
    assert first.data_state == CHANGED
    store.judged(rejected, "reject", reason)

    again = store.pipeline_run("rejected")
    stopped = store.record(again)
    said = (
        f"data and recipe already rejected in run {rejected.kfp_run_id} (gate: {reason}): "
        "training skipped (force=true retrains)"
    )
    assert stopped.data_state == UNCHANGED and said in stopped.headline
    run = _prepare_run(again)
    assert run.data.tags[TAG_REJECTED_IN] == rejected.kfp_run_id
    assert run.data.tags[TAG_GATE_FINGERPRINT] == gate_fingerprint(again.cfg, "")
    parent = again.tracker.client.get_run(again.parent_run_id)
    assert parent.data.tags[TAG_UNCHANGED] == said  # what the summary shows

    # the next scheduled run still names the rejection (carried by the run that stopped)
    later = store.record(store.pipeline_run("rejected"))
    assert later.data_state == UNCHANGED and f"in run {rejected.kfp_run_id}" in later.headline

    forced_ctx = store.pipeline_run("rejected", force=True)
    forced = store.record(forced_ctx)
    assert forced.data_state == CHANGED
    assert f"already rejected in run {rejected.kfp_run_id}" in forced.headline
    assert "force=true: retraining" in forced.headline
    assert TAG_REJECTED_IN not in _prepare_run(forced_ctx).data.tags

    # a forced retrain the gate promoted is the newest verdict: no longer stopped
    store.judged(forced_ctx, "promote", "exact_match 0.3 >= 0.2")
    assert store.record(store.pipeline_run("rejected")).data_state == CHANGED


def test_a_rejection_holds_only_for_the_same_recipe_gate_and_champion(store: Store) -> None:
    rejected = store.pipeline_run("rejected-once")
    store.record(rejected)
    store.judged(rejected, "reject", "exact_match 0.1 < gate_min_accuracy 0.2")
    assert store.record(store.pipeline_run("rejected-once")).data_state == UNCHANGED

    for change in ({"learning_rate": 0.001}, {"gate_min_accuracy": 0.05}):
        got = store.record(store.pipeline_run("rejected-once", **change))
        assert got.data_state == CHANGED and "already rejected" not in got.headline, change
    # a new champion (trained on other data) is another comparison
    other = store.pipeline_run("rejected-once", seq_len=24)
    store.champion_from(other)
    got = store.record(store.pipeline_run("rejected-once"))
    assert got.data_state == CHANGED and "already rejected" not in got.headline
