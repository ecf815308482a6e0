"""evaluate: held-out loss, perplexity and exact match; the gate decision; the HTML report
(loss curve, candidate vs champion, sample generations) that KFP's UI renders."""

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Markdown, Metrics, Model, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def evaluate(
    config: str,
    parent_run_id: str,
    kfp_run_id: str,
    model: Input[Model],
    dataset: Input[Dataset],
    metrics: Output[Metrics],
    predictions: Output[Dataset],
    report: Output[Markdown],
    html_report: Output[HTML],
) -> str:
    """Returns the gate decision ("promote" or "reject"), the DAG's one condition input.

    A single output on purpose: kfp.local resolves `dsl.If` conditions on a task's
    `Output` but not on NamedTuple fields.
    """
    from kubellm.stages import evaluate
    from kubellm.stages.context import StageContext

    ctx = StageContext.load(config, parent_run_id, kfp_run_id)
    result = evaluate.run(ctx, model.path, dataset.path, predictions.path, html_report.path)
    result.write_outputs(metrics=metrics, report=report)
    return result.decision
