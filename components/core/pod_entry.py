"""The training container's entrypoint: ``python -m kfp_nvrx.components.core.pod_entry CMD...``.

It runs ``CMD`` (the ft_launcher line) as its only child, copies the child's output through, and
exits with the child's status, except where Kubernetes' failure policies need to know more than
ft_launcher's exit code says (docs/eks.md, "Why the failure policies are set this way"):

* **Asked to stop** (SIGTERM: ``kubectl delete pod``, a drain, the JobSet recreating its pods):
  exit 143, 128 + SIGTERM, as a process killed by that signal reports it. ft_launcher itself
  exits 1 on SIGTERM (NVRx's ``main`` turns every exception, the agent's ``SignalException``
  included, into 1).
* **A peer or the rendezvous host vanished**: ft_launcher exits 1 too (``Agent run ended with
  exception``: the c10d store is gone, the rendezvous was closed or timed out) although it did not
  give up. That is an infrastructure failure of another pod, so this pod waits up to
  :func:`peer_lost_wait_s` to be stopped (in a TrainJob the Job controller deletes it as soon as
  the lost pod's own failure is counted: 143), then exits :data:`PEER_LOST` (200). 200 is >= 128
  like a signal, so the TrainJob runtime counts it (JobSet restart) and a PyTorchJob's
  ``restartPolicy: ExitCode`` recreates the pod. The wait matters when a *peer* gave up: its 1
  must reach the Job before this pod's 200, or the Job would fail as "infrastructure" and the
  JobSet restart a run that ft_launcher already gave up on.
* **ft_launcher gave up** (``Some rank(s) exited with non-zero exit code``: a worker group failed
  with its in-job restarts used up, or NVRx 0.7 saw no progress): its 1 passes through at once,
  the failure policies' "final verdict". So does the job's restart budget: rank 0 prints
  :data:`BUDGET_SPENT` and stops its agent (whose own exit then reads like a broken agent), when
  the in-job restarts of all nodes together exceed ``resilience.max_restarts``; once its workers
  are gone the agent's lingering shutdown is cut and the pod exits 1 (:mod:`.pod_child`).

The codes and the lines that tell them apart are :mod:`.exits` (which the trainer, the rounds and
the launchers read too). The two kinds of 1 are told apart by ft_launcher's own last log line
(the same words from NVRx 0.4.1 to 0.7 and later: its ``main``), read from the copy of its
output. Any other exit code, and a 1 without either line (ft_launcher died before its own
verdict), pass through unchanged.

In a container it is PID 1: it forwards SIGTERM, SIGINT and SIGHUP to the child (ft_launcher
stops its workers within ``--term-timeout``) and reaps the orphans re-parented to it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NoReturn

from kfp_nvrx.components.core.exits import GAVE_UP, PEER_LOST, TERMINATED, verdict
from kfp_nvrx.components.core.pod_child import BARRIER_ENV, SUCCEEDED_LINE, Child, exit_barrier_s
from kfp_nvrx.components.core.run_claim import RUN_DIR_ENV, Claim, PodClaim, in_use
from kfp_nvrx.components.core.stop_request import (
    SAVE_MARGIN_S,
    STOP_FILE_ENV,
    request_stop,
    stop_file,
    withdraw_stop,
)

#: Environment override of :func:`peer_lost_wait_s` (seconds; the PyTorchJob sets 0).
PEER_WAIT_ENV = "KFP_NVRX_PEER_LOST_WAIT_S"
#: After its grace period a stopped peer is SIGKILLed; its status then takes a moment to reach
#: the Job controller (kubelet, API server, a Job sync).
PEER_REPORT_S = 30.0
#: ft_launcher's stop timeout when the command names none (``stop_timeout_s`` of the default
#: config), and the shutdown margin the pods' grace period adds to it (``POD_STOP_MARGIN_S``).
DEFAULT_TERM_TIMEOUT_S = 15.0
POD_STOP_MARGIN_S = 30.0
#: How much of the child's output is kept for the verdict: its last lines.
TAIL_BYTES = 64 * 1024
#: How long the copy may take to catch up with a child that has exited.
DRAIN_S = 5.0
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Library warnings, not the run's, that every Python process of a job printed (torch imports
#: the deprecated pynvml package; ft_launcher, its rank monitor and every worker import torch).
QUIET_WARNINGS = ("ignore:The pynvml package is deprecated:FutureWarning",)


def quiet_warnings(env: dict[str, str] | os._Environ) -> str:
    """``PYTHONWARNINGS`` for a job's processes: ``env``'s own filters, then :data:`QUIET_WARNINGS`.

    Through the environment every process of the job inherits, whatever Python it runs and
    whenever it imports torch (a filter set in one process reaches none of its children).
    """
    have = [w for w in env.get("PYTHONWARNINGS", "").split(",") if w]
    return ",".join([*have, *(w for w in QUIET_WARNINGS if w not in have)])
def peer_lost_wait_s(argv: list[str], env: dict[str, str] | os._Environ) -> float:
    """How long a pod whose ft_launcher lost a peer waits to be stopped before it says so.

    A peer that was stopped ends within its grace period (``--term-timeout`` plus the shutdown
    margin, as ``pod_grace_period_s`` renders it) and is then reported; a peer that gave up ends
    sooner. ``KFP_NVRX_PEER_LOST_WAIT_S`` overrides it.

    Raises:
        ValueError: The override is not a number of seconds >= 0.
    """
    if env.get(PEER_WAIT_ENV, "") != "":
        value = float(env[PEER_WAIT_ENV])
        if not value >= 0 or value == float("inf"):
            raise ValueError(value)
        return value
    return term_timeout_s(argv) + POD_STOP_MARGIN_S + PEER_REPORT_S


def term_timeout_s(argv: list[str]) -> float:
    """ft_launcher's ``--term-timeout`` in ``argv`` (its default when it names none).

    Raises:
        ValueError: The value is not a number.
    """
    term = DEFAULT_TERM_TIMEOUT_S
    for i, arg in enumerate(argv):
        if arg == "-m":  # the worker's module and its own flags follow
            break
        if arg.startswith(("--term-timeout=", "--term_timeout=")):
            term = float(arg.split("=", 1)[1])
        elif arg in ("--term-timeout", "--term_timeout") and i + 1 < len(argv):
            term = float(argv[i + 1])
    return term


class _Copy(threading.Thread):
    """Copies one of the child's output pipes to ours and keeps the last :data:`TAIL_BYTES`."""

    def __init__(self, src: int, dst: int) -> None:
        super().__init__(daemon=True, name=f"pod_entry-copy-{dst}")
        self.src, self.dst = src, dst
        self.tail = bytearray()
        self.cond = threading.Condition()
        self.empties = 0  # times the pipe was found empty
        self.closed = False  # every writer closed it

    def run(self) -> None:
        while not self.closed:
            try:
                readable, _, _ = select.select([self.src], [], [], 0.2)
                data = os.read(self.src, 65536) if readable else None
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                with self.cond:
                    self.empties += 1
                    self.closed = data is not None
                    self.cond.notify_all()
                continue
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(self.dst, view):]
                except InterruptedError:
                    continue
                except OSError:  # our own stdout is gone: keep reading, so the child never blocks
                    break
            with self.cond:
                self.tail += data
                del self.tail[:-TAIL_BYTES]

    def caught_up(self, timeout: float) -> None:
        """Wait until everything written before this call was copied, at most ``timeout`` s.

        That is, until the pipe is found empty after the call (orphans of the child may keep
        writing: hence the bound).
        """
        with self.cond:
            start = self.empties
            self.cond.wait_for(lambda: self.closed or self.empties > start, timeout)

    def text(self) -> str:
        with self.cond:
            return self.tail.decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
    """Run ``argv`` and return the container's exit code (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("pod_entry: usage: python -m kfp_nvrx.components.core.pod_entry CMD [ARG...]",
              file=sys.stderr)
        return 2
    try:
        wait_s = peer_lost_wait_s(argv, os.environ)
        barrier_s = exit_barrier_s(os.environ)
    except ValueError:
        print(f"pod_entry: {PEER_WAIT_ENV} and {BARRIER_ENV} must be numbers of seconds >= 0, "
              f"got {os.environ.get(PEER_WAIT_ENV)!r}, {os.environ.get(BARRIER_ENV)!r}; unset "
              "them for the defaults", file=sys.stderr)
        return 2
    # One writer per run dir (core.run_claim): another job's claim is waited out for one lease,
    # then this pod is refused in one line naming the holder (2: the job fails, not restarts).
    claim = PodClaim.from_env(os.environ, lambda line: print(f"pod_entry: {line}",
                                                             file=sys.stderr, flush=True))
    refusal = claim.hold() if claim is not None else None
    if refusal is not None:
        print(f"pod_entry: {refusal}", file=sys.stderr, flush=True)
        return 2
    entry = _Entry(argv, barrier_s)
    if claim is not None:
        claim.keep(entry.lose_claim)
    code = entry.exit_code(entry.run(), wait_s)
    if claim is not None:  # a pod that is restarted (lost peer, killed child) keeps the claim
        claim.end(final=code != PEER_LOST and (code < 128 or code == TERMINATED))
    return code


class _Entry:
    """One run of the child: the signals forwarded to it, its output copied, its watch.

    Args:
        argv: The child's command line (the ft_launcher line).
        barrier_s: How long a node whose workers succeeded waits at ft_launcher's exit barrier.
    """

    def __init__(self, argv: list[str], barrier_s: float) -> None:
        self.argv = argv
        self.barrier_s = barrier_s
        self.stopped: list[int] = []
        self.child_alive = True
        self.watch: Child | None = None
        # FT: this node's stop request: a SIGTERM of the pod (not one of ft_launcher's restarts)
        # lets the workers save first, within ft_launcher's --term-timeout (core.stop_request).
        self.stop_path = stop_file(tempfile.gettempdir(), f"{os.getpid()}-{time.time_ns()}")
        self.term_s = term_timeout_s(argv)
        self.pid = 0
        self.copies: list[_Copy] = []
        self.lost: str | None = None  # another job took the run dir's claim: why we stopped

    def lose_claim(self, holder: Claim) -> None:
        """Another job holds the run dir now (our lease ran out): stop writing it at once."""
        self.lost = in_use(os.environ.get(RUN_DIR_ENV, "the run dir"), holder).message
        print(f"pod_entry: stopping the trainer: {self.lost}", file=sys.stderr, flush=True)
        if self.child_alive and self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)  # no stop request: nothing more is saved

    def forward(self, signum: int, _frame: object) -> None:
        """The handler of the forwarded signals: note them, pass them on to the child."""
        self.stopped.append(signum)
        if signum == signal.SIGTERM and not os.path.lexists(self.stop_path):
            request_stop(self.stop_path, self.term_s - SAVE_MARGIN_S)
        if signum == signal.SIGTERM and self.watch is not None and self.watch.stop_asked is None:
            self.watch.stop_asked = time.monotonic()  # FT: bounded from here (pod_child)
        if self.child_alive:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        """Starts the child, copies its output and waits for it; returns its exit status."""
        argv = self.argv
        # One pipe when our stdout and stderr are one file (a container log, the test agent's):
        # the child's lines then keep their order across the two streams.
        targets = (1,) if _same_file(1, 2) else (1, 2)
        pipes = [os.pipe() for _ in targets]
        self.pid = os.fork()
        if self.pid == 0:
            _exec_child(argv, pipes, self.stop_path)
        for sig in _FORWARDED:
            signal.signal(sig, self.forward)
        copies = self.copies
        for fd, (r, w) in zip(targets, pipes, strict=True):
            os.close(w)
            copies.append(_Copy(r, fd))
            copies[-1].start()
        self.watch = watch = Child(self.pid, argv, term_timeout_s(argv), self.barrier_s,
                                   lambda: any(SUCCEEDED_LINE in c.text() for c in copies),
                                   lambda: any(GAVE_UP in c.text() for c in copies))
        if self.stopped and signal.SIGTERM in self.stopped:  # asked to stop before the watch
            watch.stop_asked = time.monotonic()
        code = watch.wait(lambda: _reaped(self.pid))
        self.child_alive = False
        withdraw_stop(self.stop_path)
        deadline = time.monotonic() + DRAIN_S
        for c in copies:  # the child's last lines were written before it exited: copy them out
            c.caught_up(max(0.0, deadline - time.monotonic()))
        return code

    def exit_code(self, code: int, wait_s: float) -> int:
        """The container's exit code once the child exited with ``code`` (module docstring)."""
        stopped = self.stopped
        if self.lost is not None:
            return 2  # final: the run dir is another job's now
        if signal.SIGTERM in stopped:
            # Asked to stop: report the stop, never ft_launcher's "gave up" 1 (nor a 0 from
            # workers that exited cleanly on the signal: this pod did not finish the job).
            return TERMINATED
        if self.watch is not None and self.watch.cut == "gave up":
            return 1  # FT: a worker's verdict on the job, cut short (pod_child): final
        if self.watch is not None and self.watch.cut == "exit barrier":
            # FT: this node's workers succeeded; a peer that never reaches the barrier (its pod
            # lost after training ended) must not hold the job for ft_launcher's 300 s.
            print(f"pod_entry: this node's workers succeeded; stopped ft_launcher after "
                  f"{self.barrier_s:g} s at its exit barrier (a peer agent did not arrive)",
                  file=sys.stderr, flush=True)
            return 0
        code = verdict(code, "".join(c.text() for c in self.copies))
        if code != PEER_LOST:
            return code
        # FT: ft_launcher lost a peer or its rendezvous host but did not give up. Let the lost
        # pod's own failure (or a peer's verdict) reach the Job first: it stops this pod (143).
        print(f"pod_entry: ft_launcher lost a peer pod or the rendezvous host; waiting up to "
              f"{wait_s:g} s for this pod to be stopped, then exit {PEER_LOST} (restart)",
              file=sys.stderr, flush=True)
        deadline = time.monotonic() + wait_s
        while signal.SIGTERM not in stopped and time.monotonic() < deadline:
            _reap_for(min(0.5, max(0.0, deadline - time.monotonic())))
        return TERMINATED if signal.SIGTERM in stopped else PEER_LOST


def _exec_child(argv: list[str], pipes: list[tuple[int, int]], stop_path: Path) -> NoReturn:
    """In the forked child: default signals, output into ``pipes``, then exec ``argv``."""
    try:
        for sig in _FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(pipes[0][1], 1)
        os.dup2(pipes[-1][1], 2)
        os.environ["PYTHONWARNINGS"] = quiet_warnings(os.environ)
        os.environ[STOP_FILE_ENV] = str(stop_path)
        for r, w in pipes:
            os.close(r)
            os.close(w)
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"pod_entry: cannot run {argv[0]!r}: {e.strerror}", file=sys.stderr,
              flush=True)
    os._exit(127)


def _same_file(a: int, b: int) -> bool:
    try:
        sa, sb = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _reaped(pid: int) -> int | None:
    """``pid``'s status as a container reports it once it exited, else None (without waiting).

    Orphans re-parented to the entrypoint (PID 1 in a container) are reaped meanwhile.
    """
    while True:
        try:
            done, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
        if done == 0:
            return None
        if done == pid:
            return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _reap_for(seconds: float) -> None:
    """Sleep ``seconds`` (a signal cuts it short), reaping any orphan that ended meanwhile."""
    time.sleep(seconds)
    while True:
        try:
            done, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if done == 0:
            return


if __name__ == "__main__":
    sys.exit(main())
