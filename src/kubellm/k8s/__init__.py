"""The Kubernetes backends: PyTorchJob (train), Katib Experiment (tune), InferenceService (serve).

Import the module you need (`kubellm.k8s.pytorchjob`, `.katib`, `.inferenceservice`); this
package imports none of them, so using one does not load the others' SDKs (kserve is slow).
"""
