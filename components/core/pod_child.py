"""How the pod entrypoint waits for ft_launcher, and where it stops waiting for it.

ft_launcher can outlive its use by minutes, and the job waits for it:

* **asked to stop** (SIGTERM): it stops its workers within ``--term-timeout``, then, when it hosts
  the rendezvous store, hangs in its rendezvous shutdown until the pod's grace period ends (NVRx
  0.4.1: ~35 s). Its peers' agents wait on that store all along: a PyTorchJob that lost its
  rendezvous host recovered in 48 s against a TrainJob's 10-13 s. Once its workers are gone
  (:data:`STOP_SETTLE_S`), or ``--term-timeout`` + :data:`STOP_MARGIN_S` at the latest, it and its
  helpers are killed: the store closes and the peers learn at once.
* **a worker said the job's verdict** (``[trainer] gave up:``: the job's restart budget is spent,
  a diverged loss) and SIGTERMed it: it stops its workers and then lingers in its own shutdown
  (rank monitors, rendezvous, the store) before it exits 1, some 15 s on NVRx 0.4.1, and the job
  ends only with that exit (issue 38 item 7: 18-20 s from the verdict to Failed). Once its workers
  are gone (:data:`STOP_SETTLE_S`) it is killed, as after a stop, and the pod exits 1 at once.
* **its workers succeeded**: it waits at torch's exit barrier for every other agent, 300 s when
  one of them is gone (a pod lost right after training ended). This node's work is done: after
  :func:`exit_barrier_s` (healthy peers arrive within a second or two) it is stopped and the
  pod exits 0.

Everything here is the standard library: the entrypoint runs before anything else in the pod.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from kfp_nvrx.components.core.procfs import PPID, stat_fields

#: Seconds ft_launcher may take to exit after its last worker ended on a stop request.
STOP_SETTLE_S = 1.0
#: Seconds past ``--term-timeout`` after a stop request before ft_launcher is killed regardless.
STOP_MARGIN_S = 5.0
#: The line torch's agent (ft_launcher's) logs when its workers all succeeded; the exit barrier
#: follows it.
SUCCEEDED_LINE = "worker group successfully finished"
#: Environment override of :func:`exit_barrier_s`.
BARRIER_ENV = "KFP_NVRX_EXIT_BARRIER_S"
#: Default seconds at the exit barrier: peers whose workers finished the same last step arrive
#: within a monitor interval; a loaded machine gets ample room.
EXIT_BARRIER_S = 30.0


def exit_barrier_s(env: dict[str, str] | os._Environ) -> float:
    """Seconds a node whose workers succeeded waits at the exit barrier for the others.

    Raises:
        ValueError: ``KFP_NVRX_EXIT_BARRIER_S`` is not a number of seconds >= 0.
    """
    if env.get(BARRIER_ENV, "") == "":
        return EXIT_BARRIER_S
    value = float(env[BARRIER_ENV])
    if not value >= 0 or value == float("inf"):
        raise ValueError(value)
    return value


def worker_module(argv: list[str]) -> str:
    """The module ft_launcher runs as its workers (after ``-m``); '' when there is none."""
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""


def _processes() -> dict[int, tuple[int, bytes]]:
    """Every process's (parent pid, command line) (those that vanish meanwhile are left out)."""
    out: dict[int, tuple[int, bytes]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(entry.name)
        if fields is None:
            continue
        try:
            out[int(entry.name)] = (int(fields[PPID]), (entry / "cmdline").read_bytes())
        except (OSError, ValueError):
            continue
    return out


def descendants(pid: int) -> dict[int, bytes]:
    """``pid``'s descendants, with their command lines."""
    procs, found, todo = _processes(), {}, [pid]
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(p)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = procs[child][1]
                todo.append(child)
    return found


class Child:
    """ft_launcher as the entrypoint waits for it (see the module docstring).

    Args:
        pid: ft_launcher's process id (the entrypoint's only child).
        argv: Its command line (the worker module follows ``-m``).
        term_timeout_s: Its ``--term-timeout``.
        barrier_s: Seconds at the exit barrier (:func:`exit_barrier_s`).
        succeeded: Whether its output said its workers succeeded (read by the output copies).
        gave_up: Whether its output holds a worker's verdict on the job (``[trainer] gave up:``).
    """

    def __init__(self, pid: int, argv: list[str], term_timeout_s: float, barrier_s: float,
                 succeeded: Callable[[], bool],
                 gave_up: Callable[[], bool] = lambda: False) -> None:
        self.pid, self.term_timeout_s, self.barrier_s = pid, term_timeout_s, barrier_s
        self.module = worker_module(argv).encode()
        self.succeeded, self.gave_up = succeeded, gave_up
        self.verdict_at: float | None = None  # when a worker's verdict was seen
        self.stop_asked: float | None = None  # when SIGTERM was forwarded
        self.workers_gone: float | None = None  # when, after it, no worker was left
        self.done_at: float | None = None  # when the workers were seen to have succeeded
        self.cut = ""  # why it was killed ('' while it was not)

    def workers_left(self) -> bool:
        """Whether a worker (the module run by a process other than ft_launcher's forks) lives.

        The module must be a whole argument: the agent's warm process runs a module below it
        (``...trainer.zygote``) and stays until the agent ends; the workers it forks carry its
        command line and live no longer than the stand-ins ft_launcher started, which do match.
        """
        own = None
        try:
            own = Path(f"/proc/{self.pid}/cmdline").read_bytes()
        except OSError:
            pass
        return any(self.module and self.module in cmd.split(b"\0") and cmd != own
                   for cmd in descendants(self.pid).values())

    def kill(self, why: str) -> None:
        """SIGKILL ft_launcher and everything it started (a snapshot, so no orphan is missed)."""
        self.cut = why
        for p in [*descendants(self.pid), self.pid]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                continue

    def tick(self, now: float) -> None:
        """One look: cut a stop or an exit barrier that has lasted long enough."""
        if self.cut:
            return
        if self.stop_asked is None and self.verdict_at is None and self.gave_up():
            self.verdict_at = now  # its worker stopped it: the same end as a stop, exit 1
        since = self.stop_asked if self.stop_asked is not None else self.verdict_at
        if since is not None:
            if self.workers_gone is None and not self.workers_left():
                self.workers_gone = now
            if (self.workers_gone is not None and now - self.workers_gone >= STOP_SETTLE_S) \
                    or now - since >= self.term_timeout_s + STOP_MARGIN_S:
                self.kill("stopped" if self.stop_asked is not None else "gave up")
            return
        if self.done_at is None and self.succeeded():
            self.done_at = now
        if self.done_at is not None and now - self.done_at >= self.barrier_s:
            self.kill("exit barrier")

    def wait(self, reap: Callable[[], int | None], poll_s: float = 0.1) -> int:
        """Wait for ft_launcher, looking every ``poll_s``; its status as a container reports it.

        ``reap`` gives its status once it exited, else None.
        """
        while True:
            code = reap()
            if code is not None:
                return code
            time.sleep(poll_s)
            self.tick(time.monotonic())
