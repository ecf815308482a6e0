"""The local backends: torchrun, optuna, a loopback KServe ModelServer, plain directories."""
