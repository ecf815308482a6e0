"""One module per pipeline stage, named after its component; each `run` returns a typed
Result (metrics, Markdown report, headline). The only layer that combines config, tracking,
backends and the domain library."""

# The stages after preflight, in DAG order (preflight starts every run; the summary is the
# exit handler): what `kubellm run --local --from/--to` spans, and what the summary reads.
DAG = (
    "prepare_data",
    "record_data",
    "tune",
    "train",
    "evaluate",
    "register",
    "deploy",
    "smoke_test",
)
