"""The commands a user runs against a pipeline and its runs, one module each: `kubellm run
--local` (local_run), `submit`, `schedule`, `render`, `lineage` and `promote`.

They sit above the stages and the KFP client and below the CLI (kubellm.cli parses the
arguments and imports a command's module only when that command runs). submit, schedule
and render need only the core install; local_run needs the [local] extra (kfp.local runs
every stage on this machine).
"""
