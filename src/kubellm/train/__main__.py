"""Training entrypoint for every launcher: torchrun, a PyTorchJob, a Katib trial, Slurm.

CPU-only, on one machine (2 processes, gloo):

    torchrun --standalone --nproc_per_node=2 -m kubellm.train \\
        --config runs/train.json --set steps=200 --set learning_rate=0.003

The config is a TrainConfig (see kubellm/config.py); `--set` overrides one field.
"""

from kubellm.process import exit_now
from kubellm.train.loop import main

exit_now(main())  # without the interpreter's teardown (kubellm/process.py)
