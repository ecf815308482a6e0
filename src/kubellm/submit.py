"""`kubellm submit`: create a run of a compiled pipeline on a Kubeflow Pipelines endpoint."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kubellm.config import ConfigError, PipelineConfig, parse_overrides, pipeline_config


def _message(err: Any) -> str:
    try:
        return str(json.loads(err.body).get("message", err.body))
    except (TypeError, ValueError, AttributeError):
        return str(err.reason)


def submit(args: argparse.Namespace) -> int:
    import kfp
    import kfp_server_api
    import urllib3

    if not Path(args.pipeline).is_file():
        raise ConfigError(f"pipeline {args.pipeline} not found (run `kubellm compile`)")
    overrides = parse_overrides(args.overrides, PipelineConfig)
    cfg = pipeline_config(overrides)  # the same validation preflight does, before anything is sent
    arguments = {k: getattr(cfg, k) for k in overrides}  # typed as the pipeline declares them
    if not args.endpoint:
        raise ConfigError("no KFP endpoint: pass --endpoint URL or set KFP_ENDPOINT")
    run_name = args.run_name or f"kubellm-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        client = kfp.Client(host=args.endpoint, namespace=args.namespace or "kubeflow")
        result = client.create_run_from_pipeline_package(
            args.pipeline,
            arguments=arguments,
            run_name=run_name,
            experiment_name=args.experiment,
            namespace=args.namespace,
            service_account=args.service_account or None,
        )
    except kfp_server_api.ApiException as err:
        raise ConfigError(
            f"KFP at {args.endpoint} refused the run ({err.status}): {_message(err)}"
        ) from None
    except (urllib3.exceptions.HTTPError, TimeoutError, ConnectionError) as err:
        raise ConfigError(f"cannot reach KFP at {args.endpoint}: {err}") from None
    print(f"submitted run {result.run_id} ({run_name}) to {args.endpoint}")
    print(f"{args.endpoint.rstrip('/')}/#/runs/details/{result.run_id}")
    return 0
