"""What runs under torchrun, and only that.

Three processes, three entry modules:

- `kubellm.train.agent`: the per-node agent (torchrun) that starts and watches the workers;
- `kubellm.train` (`__main__`, the engine in `loop`): each worker process;
- `kubellm.train.fabric`: preflight's all-reduce check, a worker under the same agent.

The pipeline step that starts the agent (locally or as a PyTorchJob) lives in
kubellm.backends, not here.
"""
