"""The training container's entrypoint: ``python -m kfp_nvrx.components.core.pod_entry CMD...``.

It runs ``CMD`` (the ft_launcher line) as its only child and exits with the child's status, with
one difference that Kubernetes' failure policies depend on: a container that was *asked to stop*
(SIGTERM: ``kubectl delete pod``, a drain, the JobSet recreating its pods) exits 143, 128 +
SIGTERM, as a process killed by that signal reports it. ft_launcher itself exits 1 on SIGTERM
(NVRx's ``main`` turns every exception, the agent's ``SignalException`` included, into 1), which
is also its code for "gave up" (in-job restarts used up). Without this entrypoint a deleted pod
would read as a final verdict: the TrainJob runtime's ``FailJob`` rule on 1..127 would fail the
TrainJob, and a PyTorchJob's ``restartPolicy: ExitCode`` would fail the PyTorchJob, instead of
restarting the pods (docs/eks.md, "Why the failure policies are set this way").

In a container it is PID 1: it forwards SIGTERM, SIGINT and SIGHUP to the child (ft_launcher
stops its workers within ``--term-timeout``) and reaps the orphans re-parented to it.
"""

from __future__ import annotations

import os
import signal
import sys

#: The exit code of a container stopped on request (128 + SIGTERM).
TERMINATED = 128 + signal.SIGTERM
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: What a training container's exit code says (the failure-policy table in docs/eks.md).
MEANINGS = {
    1: "ft_launcher gave up: in-job restarts used up (resilience.max_restarts) or no start",
    2: "bad command line or config",
    93: "ft_launcher saw no training progress",
    137: "killed (SIGKILL: OOM kill, lost node)",
    TERMINATED: "stopped (SIGTERM: deleted, drained or recreated)",
}


def exit_meaning(code: int | None) -> str:
    """One phrase for a training container's exit code ('' when it has none)."""
    return MEANINGS.get(code, "") if code is not None else ""


def main(argv: list[str] | None = None) -> int:
    """Run ``argv`` and return the container's exit code (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("pod_entry: usage: python -m kfp_nvrx.components.core.pod_entry CMD [ARG...]",
              file=sys.stderr)
        return 2
    stopped: list[int] = []

    def forward(signum: int, _frame) -> None:
        stopped.append(signum)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    pid = os.fork()
    if pid == 0:
        try:
            for sig in _FORWARDED:
                signal.signal(sig, signal.SIG_DFL)
            os.execvp(argv[0], argv)
        except OSError as e:
            print(f"pod_entry: cannot run {argv[0]!r}: {e.strerror}", file=sys.stderr,
                  flush=True)
        os._exit(127)
    for sig in _FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            done, status = os.wait()  # orphans are re-parented to PID 1: reap them too
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
        if done != pid:
            continue
        code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if signal.SIGTERM in stopped:
            # Asked to stop: report the stop, never ft_launcher's "gave up" 1 (nor a 0 from
            # workers that exited cleanly on the signal: this pod did not finish the job).
            return TERMINATED
        return code


if __name__ == "__main__":
    sys.exit(main())
