"""`kubellm submit`: create a run of a compiled pipeline on a Kubeflow Pipelines endpoint.

It refuses, in one line and before anything is created, a KFP backend older than 2.16 or one
that does not announce its version (kfp_client.check_backend_version; --skip-version-check).
"""

from __future__ import annotations

import argparse
import time

from kubellm.kfp.client import connect, kfp_errors, pipeline_arguments, run_link


def submit(args: argparse.Namespace) -> int:
    arguments = pipeline_arguments(args.pipeline, args.overrides)  # before anything is sent
    run_name = args.run_name or f"kubellm-{time.strftime('%Y%m%d-%H%M%S')}"
    client = connect(args)
    with kfp_errors(args.endpoint, "the run"):
        result = client.create_run_from_pipeline_package(
            args.pipeline,
            arguments=arguments,
            run_name=run_name,
            experiment_name=args.experiment,
            namespace=args.namespace,
            service_account=args.service_account or None,
        )
    print(f"submitted run {result.run_id} ({run_name}) to {args.endpoint}")
    print(run_link(args.endpoint, args.ui_url, result.run_id))
    return 0
