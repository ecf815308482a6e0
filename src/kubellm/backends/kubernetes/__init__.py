"""The Kubernetes backends: PyTorchJob (train), Katib Experiment (tune), InferenceService
(serve), and the PVC workspace.

Import the module you need (`kubellm.backends.kubernetes.pytorchjob`, `.katib`,
`.inferenceservice`); this package imports none of them, so using one does not load the
others' SDKs (kserve is slow).
"""
