"""`python -m kubellm.train.agent`: the per-node agent process (torchrun) that starts,
watches and restarts the worker processes (`python -m kubellm.train`), with exit codes a
PyTorchJob can act on.

It is the main process of every training pod and of the local trainer's child process.
Same arguments as torchrun (it is torchrun, run in this process). Three things differ:

- SIGUSR1 is handled like SIGTERM: torchrun forwards it to the workers, which checkpoint
  and exit (Slurm sends SIGUSR1 ahead of the time limit).
- Workers do not share the rendezvous TCPStore (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): with
  a shared store a restarted group (`--max-restarts`) can read the previous attempt's
  addresses and fail to connect (pytorch/pytorch#135712; seen here with gloo).
- The exit code says what happened, so `restartPolicy: ExitCode` retries pre-emption and
  does not loop on a real error (plain torchrun exits 1 for every failure):

    0                     training finished
    2                     bad config or data (the first worker to fail exited 2): not retried
    3, 4                  the fabric check failed (no RDMA; bus bandwidth too low;
                          kubellm.train.fabric): not retried
    200 (EXIT_PREEMPTED)  a worker checkpointed on SIGTERM / SIGUSR1, or this launcher was
                          told to stop (SIGTERM / SIGUSR1): retried, resumes the checkpoint
    201 (EXIT_RENDEZVOUS_LOST)  the c10d rendezvous store is gone (an elastic PyTorchJob
                          whose worker-0, the store's host, died): retried, so the operator
                          recreates this pod too and the new group resumes the checkpoint
    1                     anything else (a crash): not retried

With KUBELLM_LOG_DIR set (a Katib trial's pods; backends/kubernetes/katib.py) everything
printed in the container, by the agent and its workers, is also appended to
`$KUBELLM_LOG_DIR/$KUBELLM_POD_NAME.log` (train/tee.py): under Katib's StdOut collector the
container's own log is empty. SIGTERM reaches the agent from its parent shell there (the
trial's `sh -c` traps it and passes it on), and is handled as above.

Usage (what the PyTorchJob's pods and the local trainer run):

    python -m kubellm.train.agent --standalone --nproc_per_node=2 -m kubellm.train ARGS
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from kubellm.train.preempt import EXIT_PREEMPTED
from kubellm.train.tee import Tee, log_path

_HANDLED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# Worker exit codes that name a permanent failure; passed on as they are (1-127 are not
# retried under the PyTorchJob's restartPolicy ExitCode).
PERMANENT = (2, 3, 4)
# The agent lost its rendezvous store (retryable: 128-255). torchrun's c10d backend keeps
# the store in the agent of the endpoint's host; when that pod dies, the other agents cannot
# meet again through it, and only new pods (a new store) can.
EXIT_RENDEZVOUS_LOST = 201


def exit_code(failure_codes: list[int], first: int) -> int:
    """The launcher's exit code from the failed workers' codes and the first one to fail.

    The first failure is the cause; the others are usually workers torchrun stopped after it.
    """
    if EXIT_PREEMPTED in failure_codes:
        return EXIT_PREEMPTED
    return first if first in PERMANENT else 1


def main(argv: list[str] | None = None) -> int:
    path = log_path()
    with Tee(path) if path is not None else contextlib.nullcontext():
        return _launch(argv)


def _launch(argv: list[str] | None) -> int:
    # torchrun's --signals-to-handle (read from PET_SIGNALS_TO_HANDLE) sets
    # TORCHELASTIC_SIGNALS_TO_HANDLE over ours; without SIGUSR1 in it the agent dies of
    # Slurm's `--signal=USR1` / `scancel --signal=USR1` instead of passing it on.
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", _HANDLED)
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", _HANDLED)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        torchrun.main(argv if argv is not None else sys.argv[1:])
    except SignalException as err:
        if err.sigval in (signal.SIGTERM, signal.SIGUSR1):
            print(
                f"launch: {err.sigval.name}: workers were asked to checkpoint and stop; "
                f"exiting with {EXIT_PREEMPTED} (retryable)",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_PREEMPTED
        return 128 + int(err.sigval)
    except RendezvousConnectionError as err:
        print(
            f"launch: the rendezvous store is unreachable ({err}); exiting with "
            f"{EXIT_RENDEZVOUS_LOST} (retryable: a new pod meets the group again)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_RENDEZVOUS_LOST
    except ChildFailedError as err:
        _, first = err.get_first_failure()
        code = exit_code([f.exitcode for f in err.failures.values()], first.exitcode)
        print(f"launch: workers failed; exiting with {code}", file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    from kubellm.process import exit_now

    exit_now(main())  # without the interpreter's teardown (kubellm/process.py)
