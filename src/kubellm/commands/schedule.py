"""`kubellm schedule`: recurring retraining as one Kubeflow Pipelines recurring run.

kubellm schedule pipelines/llm_train.yaml --cron '0 2 * * *' --endpoint http://localhost:8888 \
    --set train_steps=5000                # create, or replace in place: one run per name
kubellm schedule --list --endpoint http://localhost:8888
kubellm schedule --pause  --endpoint http://localhost:8888     # --resume, --delete

Creating, updating and resuming refuse a KFP backend older than 2.16, or one that does not
announce its version, as `kubellm submit` does (kfp_client.check_backend_version;
--skip-version-check); --list, --pause and --delete run nothing and work on any backend.

The YAML goes up as a pipeline (created when missing) and a version named by its content
hash, reused when the same bytes are already there, so every scheduled run links to the exact
pipeline it ran. KFP v2beta1 has no update for recurring runs; a changed schedule is created
first and the old one deleted after, so a failure never leaves none, and a rerun converges on
exactly one.

Cron: KFP's API server and ScheduledWorkflow controller parse with robfig/cron v1.2.0's
`cron.Parse`, whose 6 fields start with seconds and whose 5-field form means "seconds minute
hour day month" (`0 2 * * *` there is every hour at :02, not 02:00). So the usual 5-field
crontab `minute hour day-of-month month day-of-week` is sent as `0 <expr>`; 6 fields and
descriptors (@daily, @every 6h) are sent as written. The times are the controller's time zone
(UTC unless its deployment sets one).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from kubellm.config import ConfigError
from kubellm.kfp.client import connect, kfp_errors, pipeline_arguments, recurring_run_link
from kubellm.kfp.pipelines import equals, list_all, pipeline_name, upload

# -- cron, as KFP parses it --------------------------------------------------------------

_MONTHS = {
    m: i
    for i, m in enumerate(
        ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"], 1
    )
}
_DAYS = {d: i for i, d in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
# (min, max, names) of second, minute, hour, day of month, month, day of week: robfig spec.go
_BOUNDS: list[tuple[int, int, dict[str, int] | None]] = [
    (0, 59, None),
    (0, 59, None),
    (0, 23, None),
    (1, 31, None),
    (1, 12, _MONTHS),
    (0, 6, _DAYS),
]
_DESCRIPTORS = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
_GO_DURATION = re.compile(r"[-+]?(0|([0-9]*(\.[0-9]*)?(ns|us|µs|μs|ms|s|m|h))+)")
_GO_INT = re.compile(r"[+-]?[0-9]+")


class _CronError(ValueError):
    pass


def _int(expr: str, names: dict[str, int] | None = None) -> int:
    if names and expr.lower() in names:
        return names[expr.lower()]
    if not _GO_INT.fullmatch(expr):
        raise _CronError(f'Failed to parse int from {expr}: strconv.Atoi: parsing "{expr}"')
    if int(expr) < 0:
        raise _CronError(f"Negative number ({int(expr)}) not allowed: {expr}")
    return int(expr)


def _check_range(expr: str, lo: int, hi: int, names: dict[str, int] | None) -> None:
    range_and_step = expr.split("/")
    low_high = range_and_step[0].split("-")
    if low_high[0] in ("*", "?"):
        start, end = lo, hi
    else:
        start = _int(low_high[0], names)
        if len(low_high) > 2:
            raise _CronError(f"Too many hyphens: {expr}")
        end = _int(low_high[1], names) if len(low_high) == 2 else start
    if len(range_and_step) > 2:
        raise _CronError(f"Too many slashes: {expr}")
    step = 1
    if len(range_and_step) == 2:
        step = _int(range_and_step[1])
        if len(low_high) == 1:  # "N/step" means "N-max/step"
            end = hi
    if start < lo:
        raise _CronError(f"Beginning of range ({start}) below minimum ({lo}): {expr}")
    if end > hi:
        raise _CronError(f"End of range ({end}) above maximum ({hi}): {expr}")
    if start > end:
        raise _CronError(f"Beginning of range ({start}) beyond end of range ({end}): {expr}")
    if step == 0:
        raise _CronError(f"Step of range should be a positive number: {expr}")


def robfig_cron_error(spec: str) -> str | None:
    """Why robfig/cron v1.2.0's `cron.Parse` (KFP's validator and scheduler) rejects `spec`,
    or None when it accepts it: a port of its parser.go, error texts included."""
    if not spec:
        return "Empty spec string"
    if spec[0] == "@":
        if spec in _DESCRIPTORS:
            return None
        if spec.startswith("@every "):
            duration = spec[len("@every ") :]
            if _GO_DURATION.fullmatch(duration):
                return None
            return f"Failed to parse duration {spec}: time: invalid duration {duration!r}"
        return f"Unrecognized descriptor: {spec}"
    fields = spec.split()
    if not 5 <= len(fields) <= 6:
        return f"Expected 5 to 6 fields, found {len(fields)}: {spec}"
    try:
        for field, (lo, hi, names) in zip(fields, _BOUNDS, strict=False):
            for expr in (e for e in field.split(",") if e):
                _check_range(expr, lo, hi, names)
    except _CronError as err:
        return str(err)
    return None


def kfp_cron(expr: str) -> str:
    """The cron expression to send to KFP for what the user wrote (see the module docstring);
    a ConfigError naming --cron when KFP would refuse it."""
    spec = " ".join(expr.split()) if not expr.strip().startswith("@") else expr.strip()
    fields = spec.split()
    if spec.startswith("@"):
        sent = spec
    elif len(fields) == 5:
        sent = f"0 {spec}"  # crontab's minute..day-of-week, with the seconds KFP wants first
    elif len(fields) == 6:
        sent = spec
    else:
        raise ConfigError(
            f"--cron {expr!r}: needs 5 fields (minute hour day-of-month month day-of-week), "
            f"6 with seconds first, or a descriptor such as @daily; found {len(fields)}"
        )
    error = robfig_cron_error(sent)
    if error:
        raise ConfigError(f"--cron {expr!r}: KFP would refuse it (sent as {sent!r}): {error}")
    return sent


# -- the command -------------------------------------------------------------------------

MAX_CONCURRENCY = (1, 10)  # the API server's bounds for max_concurrency


def schedule(args: argparse.Namespace) -> int:
    action = next((a for a in ("list", "pause", "resume", "delete") if getattr(args, a)), None)
    if action and (args.cron or args.overrides):
        raise ConfigError(f"--{action} takes no --cron or --set")
    if action == "list":
        return _list(args)
    name = args.name or pipeline_name(args.pipeline)
    if action:
        return _change_state(args, action, name)
    if not args.cron:
        raise ConfigError(
            "--cron is required to create or update a recurring run "
            "(or --list, --pause, --resume, --delete)"
        )
    cron = kfp_cron(args.cron)
    arguments = pipeline_arguments(args.pipeline, args.overrides)
    lo, hi = MAX_CONCURRENCY
    if not lo <= args.max_concurrency <= hi:
        raise ConfigError(f"--max-concurrency {args.max_concurrency}: must be {lo} to {hi}")
    return _create_or_update(args, name, cron, arguments)


def _find(
    client: Any, args: argparse.Namespace, name: str | None, create: bool
) -> tuple[Any, list[Any]]:
    """The experiment (None when missing and not created) and its recurring runs named
    `name` (all of them when None)."""
    if create:
        experiment = client.create_experiment(args.experiment, namespace=args.namespace)
    else:
        try:
            experiment = client.get_experiment(
                experiment_name=args.experiment, namespace=args.namespace
            )
        except ValueError as err:
            if str(err).startswith("No experiment is found"):
                return None, []
            raise ConfigError(str(err)) from None
    kwargs = {"filter": equals("display_name", name)} if name else {}
    runs = list_all(
        client.list_recurring_runs,
        "recurring_runs",
        experiment_id=experiment.experiment_id,
        **kwargs,
    )
    return experiment, [r for r in runs if name is None or r.display_name == name]


def _matches(run: Any, want: dict[str, Any]) -> bool:
    """Whether an existing recurring run already is the one asked for."""
    trigger = run.trigger.cron_schedule if run.trigger else None
    ref = run.pipeline_version_reference
    params = (run.runtime_config.parameters if run.runtime_config else None) or {}
    return (
        (trigger.cron if trigger else None) == want["cron"]
        and (ref.pipeline_version_id if ref else None) == want["version_id"]
        and params == want["params"]
        and (run.service_account or "") == (want["service_account"] or "")
        and int(run.max_concurrency or 0) == want["max_concurrency"]
        and bool(run.no_catchup) == want["no_catchup"]
    )


def _create_or_update(
    args: argparse.Namespace, name: str, cron: str, arguments: dict[str, Any]
) -> int:
    client = connect(args)
    with kfp_errors(args.endpoint, "the recurring run"):
        experiment, existing = _find(client, args, name, create=True)
        pipeline_id, version_id, version = upload(
            client, args.pipeline, args.namespace, "kubellm schedule"
        )
        want = {
            "cron": cron,
            "version_id": version_id,
            "params": arguments,
            "service_account": args.service_account,
            "max_concurrency": args.max_concurrency,
            "no_catchup": not args.catchup,
        }
        keep = next((r for r in existing if _matches(r, want)), None)
        paused = bool(existing) and all(r.mode == "DISABLE" for r in existing)
        if keep is None:
            keep = client.create_recurring_run(
                experiment_id=experiment.experiment_id,
                job_name=name,
                description=f"kubellm schedule: cron {args.cron!r}, sent as {cron!r}",
                cron_expression=cron,
                max_concurrency=args.max_concurrency,
                no_catchup=not args.catchup,
                params=arguments,
                pipeline_id=pipeline_id,
                version_id=version_id,
                enabled=not paused,
                service_account=args.service_account or None,
            )
            verb = "updated" if existing else "created"
        else:
            verb = "unchanged"
    replaced = [r.recurring_run_id for r in existing if r.recurring_run_id != keep.recurring_run_id]
    for old in replaced:
        with kfp_errors(args.endpoint, f"deleting the replaced recurring run {old}"):
            client.delete_recurring_run(old)
    state = "paused" if keep.mode == "DISABLE" else "enabled"
    shown = cron if cron == args.cron.strip() else f"{cron!r} (from {args.cron!r})"
    print(
        f"{verb} recurring run {name} ({keep.recurring_run_id}) in experiment "
        f"{args.experiment}: cron {shown}, pipeline version {version}, {state}"
    )
    for old in replaced:
        print(f"deleted the replaced recurring run {old}")
    link = recurring_run_link(args.endpoint, args.ui_url, keep.recurring_run_id)
    if link:
        print(link)
    return 0


def _change_state(args: argparse.Namespace, action: str, name: str) -> int:
    client = connect(args, check_version=action == "resume")  # resume starts runs again
    with kfp_errors(args.endpoint, f"{action} of the recurring run"):
        _, runs = _find(client, args, name, create=False)
        if not runs:
            raise ConfigError(
                f"no recurring run named {name!r} in experiment {args.experiment!r} at "
                f"{args.endpoint} (`kubellm schedule --list` shows them)"
            )
        call = {
            "pause": client.disable_recurring_run,
            "resume": client.enable_recurring_run,
            "delete": client.delete_recurring_run,
        }[action]
        for run in runs:
            call(run.recurring_run_id)
    done = {"pause": "paused", "resume": "resumed", "delete": "deleted"}[action]
    for run in runs:
        print(f"{done} recurring run {name} ({run.recurring_run_id})")
    return 0


def _list(args: argparse.Namespace) -> int:
    client = connect(args, check_version=False)  # listing runs nothing
    rows = [("NAME", "CRON", "STATE", "PIPELINE VERSION", "ID")]
    with kfp_errors(args.endpoint, "listing recurring runs"):
        _, runs = _find(client, args, args.name, create=False)
        versions: dict[tuple[str, str], str] = {}
        for run in runs:
            ref = run.pipeline_version_reference
            key = (ref.pipeline_id, ref.pipeline_version_id) if ref else ("", "")
            if ref and key not in versions:
                versions[key] = client.get_pipeline_version(*key).display_name or key[1]
            trigger = run.trigger
            if trigger and trigger.cron_schedule:
                when = trigger.cron_schedule.cron
            elif trigger and trigger.periodic_schedule:
                when = f"every {trigger.periodic_schedule.interval_second}s"
            else:
                when = "-"
            state = {"ENABLE": "enabled", "DISABLE": "paused"}.get(run.mode, str(run.mode))
            version = versions.get(key, "-")
            rows.append((run.display_name, when, state, version, run.recurring_run_id))
    if not runs:
        print(f"no recurring runs in experiment {args.experiment} at {args.endpoint}")
        return 0
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return 0
