"""One module per pipeline stage, named after its component; each `run` returns a typed
Result (metrics, Markdown report, headline). The only layer that combines config, tracking,
backends and the domain library."""
