"""The deploy stage: serve the registered model and wait until it answers readiness."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kubellm.backends.base import ServeRequest
from kubellm.config import PipelineConfig
from kubellm.stages.context import StageContext, StageResult, markdown_table


@dataclass
class Result(StageResult):
    endpoint: str = ""


def serve_request(cfg: PipelineConfig, model_uri: str, kfp_run_id: str) -> ServeRequest:
    """The deployment of `model_uri` under the run's model name."""
    return ServeRequest(
        name=cfg.model_name,
        model_uri=model_uri,
        namespace=cfg.namespace,
        image=cfg.serving_image,
        timeout_s=cfg.job_timeout_minutes * 60.0,
        run_tag=kfp_run_id,
    )


def run(ctx: StageContext, model_dir: str | Path, version: str) -> Result:
    cfg = ctx.cfg
    with ctx.stage("deploy") as run_id:
        ws = ctx.backends.workspace
        shared = ws.share(model_dir, "serve", f"v{version}")
        request = serve_request(cfg, ws.model_uri(shared), ctx.kfp_run_id)
        endpoint = ctx.backends.server.deploy(request)
        ctx.tracker.log(
            run_id,
            params={"model_version": version, "model_uri": request.model_uri},
            tags={"kubellm.endpoint": endpoint.url},
        )
    return ctx.finish(
        "deploy",
        Result(
            report=markdown_table(
                "Deployment",
                [("model", f"{cfg.model_name} v{version}"), ("endpoint", endpoint.url)],
            ),
            headline=f"{cfg.model_name} v{version} ready at {endpoint.url}",
            endpoint=endpoint.url,
        ),
    )
