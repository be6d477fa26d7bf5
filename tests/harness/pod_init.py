"""The init process (PID 1) of one container the test node agent runs.

The agent starts ``unshare --pid --fork --kill-child --mount-proc --mount --uts`` and a shell that
bind-mounts the pod's volumes and hosts file and sets its hostname, then ``exec``s this script,
which becomes PID 1 of the container's own PID namespace (like ``tini`` in a container):

* it runs the container's command as its only child and forwards SIGTERM/SIGINT/SIGHUP to it
  (signals sent from outside to a namespace's PID 1 are dropped unless it handles them, so the
  command itself could not be PID 1 and still get the kubelet's SIGTERM);
* it reaps every orphan, so nothing lingers as a zombie;
* it exits with the child's status the way a container runtime reports it: the exit code, or
  128 + the signal number for a child killed by a signal. ``unshare`` passes a plain exit code
  through; it cannot re-raise a child's signal under gVisor (it exits 1 instead), hence this file.

When PID 1 exits, the kernel kills everything else in the namespace: workers that ft_launcher
started in sessions of their own (``start_new_session``) cannot outlive the container.

Usage: ``python pod_init.py CMD [ARG...]`` (environment and working directory inherited).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn


def main(argv: list[str]) -> int:
    """Run ``argv`` as the only child; return its container exit code."""
    if not argv:
        print("pod_init: no command", file=sys.stderr)
        return 127
    pid = os.fork()
    if pid == 0:
        _exec(argv)
    _forward_signals(pid)
    return _wait(pid)


def _exec(argv: list[str]) -> NoReturn:
    """In the child: become the container's command (127/126 when it cannot run)."""
    try:
        # Back to default dispositions and a group of its own, as a container's command has.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"pod_init: cannot run {argv[0]!r}: {e.strerror}", file=sys.stderr, flush=True)
        os._exit(127 if e.errno == 2 else 126)


def _forward_signals(pid: int) -> None:
    """Pass SIGTERM/SIGINT/SIGHUP sent to PID 1 on to the child."""

    def forward(signum: int, _frame) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)


def _wait(pid: int) -> int:
    """Reap every process until ``pid`` ends; its exit code, or 128 + the signal that killed it."""
    while True:
        try:
            done, status = os.wait()  # reaps orphans too: they are re-parented to PID 1
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
        if done == pid:
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
