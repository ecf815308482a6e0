"""How a KFP v2 step's process is started and stopped: Argo's emissary and the KFP launcher.

A FAKE, for tests only. In a KFP v2 step pod the main container runs
`argoexec emissary -- /kfp-launcher/launch --pipeline_name ... -- <the component's command>`:
Argo's emissary is the container's PID 1, the KFP launcher its child, and the component's
command (our Python) the launcher's child. What upstream does when a run is stopped:

1. KFP terminates a run by merge-patching its Workflow with `spec.activeDeadlineSeconds: 0`
   (kubeflow/pipelines backend/src/apiserver/resource/resource_manager.go TerminateWorkflow
   L1024, backend/src/common/util/execution_spec.go GetTerminatePatch L294, @2.17.0): not
   Argo's `stop` or `terminate` (spec.shutdown).
2. Past the deadline, Argo's controller terminates every running pod that is not part of an
   exit handler (argo-workflows workflow/controller/exec_control.go applyExecutionControl
   L57-64 @v4.0.5, the same at v3.5.14/v3.6.7/v3.7.3): it execs `argoexec kill 15 1` in
   the main container (workflow/signal/signal.go L27), SIGTERM to the emissary, and SIGKILL
   after terminationGracePeriodSeconds (workflow/controller/pod/queue.go L122-128).
3. The emissary started the launcher in a process group of its own
   (workflow/executor/osspecific/command_unix.go L37, Setpgid) and forwards each signal it
   gets to that whole group (cmd/argoexec/commands/emissary.go L190; osspecific
   signal_darwin.go L19-22, kill(-pgid), which signal_linux.go links to): the launcher and
   the step's Python get SIGTERM at once.
4. The launcher is a Go binary that never calls signal.Notify (nothing in backend/src/v2
   does), and Go's default for SIGTERM is to exit (golang/go src/os/signal/doc.go
   L38-39). It runs the component's command with exec.Command and no process group of its
   own (backend/src/v2/component/launcher_v2.go L707-715), so it dies at once, leaving
   the step running.
5. The emissary reaps the launcher (osspecific.Wait: Wait4 polled once a second,
   signal_darwin.go L48-59) and returns (emissary.go L227); it is PID 1, and when the init
   process of a PID namespace exits the kernel SIGKILLs every other process in it
   (man-pages man7/pid_namespaces.7 L71-73). The step's Python dies wherever its SIGTERM
   handler has got to: within 0 to 1 s of the launcher's death.
6. Exit handlers are exempt from the deadline: their pods are created past it
   (workflow/controller/workflowpod.go L177, "ignore the workflow deadline for exit
   handler") and not terminated (exec_control.go L58), and the exit hook runs unless
   spec.shutdown is Terminate (workflow/controller/exit_handler.go L22, ShouldExecute).
   KFP compiles dsl.ExitHandler's task into such a hook (backend/src/v2/compiler/
   argocompiler/dag.go L62-107, common.go L126 addExitTask). So on a KFP terminate the
   exit handler runs, and a step's own SIGTERM cleanup may not finish.

What this fake does: `EmissaryStep(argv, env).start()` starts a process that plays the
emissary; it starts the launcher (a Python process that sets no SIGTERM handler, so the
default action ends it at once, as Go's does) in a new process group, and the launcher
starts `argv` in that group. `stop()` SIGTERMs the emissary, which forwards it to the
group; `reap_delay_s` after the launcher has exited, the emissary SIGKILLs whatever is
left of the group (the PID namespace ending) and exits with the launcher's status:
0, 1 when the command failed (the launcher's glog.Exit, backend/src/v2/cmd/launcher-v2/
main.go L59), or 128+N when signal N ended it (osspecific.Wait).

Simplified:
- `reap_delay_s` defaults to 0: upstream's delay is whenever the next once-a-second Wait4
  comes, 0 to 1 s; the fake takes the end of that range that cleanup must survive, and
  makes it exactly 0: it stops the group (SIGSTOP), sends the SIGTERM, and SIGKILLs the
  group, so the step has the SIGTERM pending and never runs again. Upstream's 0 s case
  leaves the step the microseconds to milliseconds the launcher takes to die and the
  emissary to wake; without the freeze the step's DELETE got through in about 1 of 20
  tries here (a loaded machine deschedules the emissary between its two kills), and a
  test could not show the stop. The launcher then dies of the SIGKILL (a stopped process
  does not act on its pending SIGTERM); the emissary reports the SIGTERM's 143, as
  upstream's launcher dies of it. With upstream's 1 s (`reap_delay_s=1.0`) the step's
  DELETE usually gets through: its SIGTERM cleanup is a best effort, not nothing.
- One process group stands for the container's PID namespace: a process that leaves it
  (setsid) escapes the final SIGKILL here; the kernel would still kill it.
- No `sh -ec` between the launcher and the Python (the component's command KFP compiles):
  it is in the same group and dies on SIGTERM too, so who gets the signal is the same.
- The controller's SIGKILL after the grace period is not sent: the emissary has ended
  the container before it could matter.

    step = EmissaryStep([sys.executable, "-c", code], env=env).start()
    ...
    assert step.stop() == 143  # the launcher died of SIGTERM
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# The launcher: no SIGTERM (or SIGINT) handler, like a Go binary without signal.Notify; the
# command in the launcher's own process group (exec.Command sets no Setpgid); exit 1 when
# the command failed (glog.Exit).
_LAUNCHER = """
import signal, subprocess, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
child = subprocess.Popen(sys.argv[1:])
sys.exit(0 if child.wait() == 0 else 1)
"""

# The emissary, PID 1 of the container: the launcher in a new process group (Setpgid);
# every signal it gets forwarded to that group. One that ends the launcher (Go exits on
# SIGTERM, SIGINT, SIGHUP) ends the container: `delay` after the launcher is reaped, SIGKILL
# to the group, as the kernel does to a PID namespace whose init has exited. With delay 0,
# at once: the group is frozen (SIGSTOP) before the signal and killed after it, so nothing
# in it runs in between (see the module docstring). Exit with the launcher's status.
_EMISSARY = """
import os, signal, subprocess, sys, time
delay, ctl, argv = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
ENDS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
pending = []
launcher = None
def kill(signum):
    try:
        os.killpg(launcher.pid, signum)
    except ProcessLookupError:
        pass
ended = []
def forward(signum, frame):
    if launcher is None:
        pending.append(signum)
        return
    at_once = delay == 0 and signum in ENDS
    if at_once:
        kill(signal.SIGSTOP)
    kill(signum)
    if at_once:
        ended.append(signum)
        kill(signal.SIGKILL)
for s in (*ENDS, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(s, forward)
launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, *argv], process_group=0)
os.write(ctl, f"{launcher.pid}\\n".encode())
os.close(ctl)
for s in pending:
    forward(s, None)
status = os.waitpid(launcher.pid, 0)[1]
if delay > 0:
    time.sleep(delay)
kill(signal.SIGKILL)
code = os.waitstatus_to_exitcode(status)
if code == -signal.SIGKILL and ended:  # the SIGKILL overtook the stopped launcher's signal
    code = -ended[0]
sys.exit(128 - code if code < 0 else code)
""".replace("LAUNCHER", repr(_LAUNCHER))

EXIT_SIGTERM = 128 + signal.SIGTERM  # what stop() returns when the launcher died of it


class EmissaryStep:
    """`argv` run as a KFP v2 step's component command: emissary -> launcher -> argv.

    `env`, `cwd`, `stdin`, `stdout`, `stderr` are the container's (passed to the emissary;
    the launcher and the step inherit them). `stdin` defaults to /dev/null.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        cwd: str | Path | None = None,
        stdin: int | IO[Any] | None = subprocess.DEVNULL,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        reap_delay_s: float = 0.0,
    ) -> None:
        if not argv:
            raise ValueError("EmissaryStep needs a command")
        if reap_delay_s < 0:
            raise ValueError(f"reap_delay_s must be >= 0, got {reap_delay_s}")
        self.argv = list(argv)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.reap_delay_s = reap_delay_s
        self.proc: subprocess.Popen[Any] | None = None  # the emissary
        self.launcher_pid: int | None = None  # also the step's process group id

    def start(self, timeout_s: float = 30.0) -> EmissaryStep:
        """Start the emissary and return once the launcher runs (its pid is known)."""
        if self.proc is not None:
            raise RuntimeError("EmissaryStep already started")
        read, write = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _EMISSARY, str(self.reap_delay_s), str(write), *self.argv],
                env=self.env,
                cwd=self.cwd,
                stdin=self.stdin,
                stdout=self.stdout,
                stderr=self.stderr,
                pass_fds=(write,),
                start_new_session=True,  # the test can always kill what is left
            )
        finally:
            os.close(write)
        try:
            ready, _, _ = select.select([read], [], [], timeout_s)
            line = os.read(read, 64).decode().strip() if ready else ""
        finally:
            os.close(read)
        if not line:
            self.kill()
            raise RuntimeError(f"the emissary did not start the launcher within {timeout_s}s")
        self.launcher_pid = int(line)
        return self

    @property
    def pid(self) -> int:
        """The emissary's pid: the container's PID 1, where Argo's SIGTERM goes."""
        return self._started().pid

    @property
    def returncode(self) -> int | None:
        return self._started().returncode

    def poll(self) -> int | None:
        return self._started().poll()

    def wait(self, timeout_s: float | None = None) -> int:
        """The emissary's exit code (the launcher's status, see the module docstring)."""
        return self._started().wait(timeout_s)

    def communicate(self, timeout_s: float | None = None) -> tuple[Any, Any]:
        """As Popen.communicate, for stdout/stderr=PIPE."""
        return self._started().communicate(timeout=timeout_s)

    def signal(self, signum: int) -> None:
        """Send `signum` to the emissary (PID 1), which forwards it to the step's group."""
        proc = self._started()
        if proc.poll() is None:
            proc.send_signal(signum)

    def stop(self, timeout_s: float = 30.0) -> int:
        """Stop the step as Argo does past a workflow's deadline (`argoexec kill 15 1`);
        returns the emissary's exit code, 143 when the launcher died of SIGTERM."""
        self.signal(signal.SIGTERM)
        return self.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL everything (test cleanup; the controller's SIGKILL after the grace)."""
        if self.proc is None or self.proc.poll() is not None:
            return  # an emissary that exited SIGKILLed its group; its ids may be reused now
        for pgid in (self.launcher_pid, self.proc.pid):
            if pgid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def __enter__(self) -> EmissaryStep:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def _started(self) -> subprocess.Popen[Any]:
        if self.proc is None:
            raise RuntimeError("EmissaryStep not started: call start()")
        return self.proc
