"""The Kubeflow Pipelines API client (kubellm.kfp.client): connecting to an endpoint with a
token, pipeline arguments from a config, experiments and run links. Part of the core
install: it imports kfp and kfp_server_api, never torch.
"""
