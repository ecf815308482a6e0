"""`kubellm submit`: create a run of a compiled pipeline on a Kubeflow Pipelines endpoint.

It refuses, in one line and before anything is created, a KFP backend older than 2.16 or one
that does not announce its version (kfp_client.check_backend_version; --skip-version-check).

The YAML goes up first as the pipeline version its content hash names, as `kubellm schedule`
uploads it (kubellm.kfp.pipelines.upload; reused when the same bytes are there), and the run
references that version: the `pipeline_version` the run passes to the registry is one the
server has.
"""

from __future__ import annotations

import argparse
import time

from kubellm.kfp.client import connect, kfp_errors, pipeline_arguments, run_link
from kubellm.kfp.pipelines import upload


def submit(args: argparse.Namespace) -> int:
    arguments = pipeline_arguments(args.pipeline, args.overrides)  # before anything is sent
    run_name = args.run_name or f"kubellm-{time.strftime('%Y%m%d-%H%M%S')}"
    client = connect(args)
    with kfp_errors(args.endpoint, "the run"):
        experiment = client.create_experiment(args.experiment, namespace=args.namespace)
        pipeline_id, version_id, version = upload(
            client, args.pipeline, args.namespace, "kubellm submit"
        )
        result = client.run_pipeline(
            experiment.experiment_id,
            run_name,
            params=arguments,
            pipeline_id=pipeline_id,
            version_id=version_id,
            service_account=args.service_account or None,
        )
    print(
        f"submitted run {result.run_id} ({run_name}) to {args.endpoint}, pipeline version {version}"
    )
    print(run_link(args.endpoint, args.ui_url, result.run_id))
    return 0
