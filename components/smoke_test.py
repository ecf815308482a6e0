"""smoke_test: real prompts to the served model; promote to champion or roll back."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Markdown, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def smoke_test(
    config: str,
    parent_run_id: str,
    kfp_run_id: str,
    endpoint: str,
    predictions: Input[Dataset],
    version: str,
    report: Output[Markdown],
) -> str:
    from kubellm.serve.stage import run_smoke_test
    from kubellm.stage import StageContext

    ctx = StageContext.load(config, parent_run_id, kfp_run_id)
    result = run_smoke_test(ctx, endpoint, predictions.path, version)
    with open(report.path, "w") as fh:
        fh.write(
            f"# Smoke test\n\n`{result['prompt']}` -> `{result['answer']}` "
            f"(expected `{result['expected']}`); served = evaluated on "
            f"{result['agreement']:.0%} of prompts\n"
        )
    return result["answer"]
