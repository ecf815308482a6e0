"""kubellm: one Kubeflow Pipelines DAG from raw text to a served language model."""

__version__ = "0.1.0"

# The default image of pipeline steps (containers/Dockerfile, target runtime; the pipeline
# parameter runtime_image picks another). Locally, kfp.local's
# SubprocessRunner runs the same component code in this Python environment instead.
RUNTIME_IMAGE = f"ghcr.io/kubellm/runtime:{__version__}"
