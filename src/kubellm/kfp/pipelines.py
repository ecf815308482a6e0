"""The compiled YAML as an uploaded pipeline version, shared by `kubellm submit` and
`kubellm schedule`, so every run they create references a version the server has.

The YAML goes up as a pipeline (created when missing, named by its pipelineInfo.name) and a
version named by its content hash (`version_name`), reused when the same bytes are already
there: the `pipeline_version` parameter each run carries into the registry names it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from kubellm.config import ConfigError
from kubellm.kfp.client import version_name


def equals(key: str, value: str) -> str:
    """A v2beta1 list filter on one field (filter.proto; as kfp.Client builds it)."""
    return json.dumps({"predicates": [{"operation": "EQUALS", "key": key, "stringValue": value}]})


def list_all(call: Callable[..., Any], field: str, **kwargs: Any) -> list[Any]:
    """Every item of a paginated list call."""
    items: list[Any] = []
    token = ""
    while True:
        resp = call(page_token=token, page_size=100, **kwargs)
        items += getattr(resp, field) or []
        token = resp.next_page_token or ""
        if not token:
            return items


def pipeline_name(path: str) -> str:
    """The compiled pipeline's pipelineInfo.name: the default recurring-run and pipeline name."""
    try:
        doc = next(yaml.safe_load_all(Path(path).read_text()))
        return str(doc["pipelineInfo"]["name"])
    except (OSError, StopIteration, KeyError, TypeError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read the pipeline name from {path}: {err}") from None


def upload(client: Any, pipeline: str, namespace: str | None, by: str) -> tuple[str, str, str]:
    """(pipeline id, version id, version name) of the YAML at `pipeline`, uploaded when not
    there yet; `by` (`kubellm submit`) goes into the descriptions."""
    import kfp_server_api

    name = pipeline_name(pipeline)
    found = list_all(
        client.list_pipelines,
        "pipelines",
        filter=equals("display_name", name),
        namespace=namespace,
    )
    found = [p for p in found if p.display_name == name]
    if found:
        pipeline_id = found[0].pipeline_id
    else:  # the pipeline alone; its only version is the one named by the content hash
        body = kfp_server_api.V2beta1Pipeline(
            name=name,
            display_name=name,
            description=f"uploaded by {by}",
            namespace=namespace,
        )
        pipeline_id = client.pipelines.pipeline_service_create_pipeline(body).pipeline_id
    version = version_name(pipeline)
    versions = list_all(
        client.list_pipeline_versions,
        "pipeline_versions",
        pipeline_id=pipeline_id,
        filter=equals("display_name", version),
    )
    same = [v for v in versions if version in (v.display_name, v.name)]
    if same:
        return pipeline_id, same[0].pipeline_version_id, version
    uploaded = client.upload_pipeline_version(
        pipeline,
        pipeline_version_name=version,
        pipeline_id=pipeline_id,
        description=f"{pipeline}, uploaded by {by}",
    )
    return pipeline_id, uploaded.pipeline_version_id, version
