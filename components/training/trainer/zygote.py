"""The warm process an agent keeps for its workers' starts (issue 37: an in-job restart <= 6 s).

``python -m kfp_nvrx.components.training.trainer.zygote SOCKET PARENT_PID``, started by the agent
(:mod:`kfp_nvrx.components.training.ft_agent`) when ``resilience.warm_start`` is on. It imports
what a worker imports (torch, NVRx, the trainer: 2-2.5 s at 1b, every restart) once, never touches
CUDA or starts a thread, then serves :mod:`.handoff` requests: for each it forks a child that
takes the requesting worker's argv, environment, working directory and standard streams and runs
the trainer's ``main``, in a session of its own; the zygote tells the stand-in how the child ended
(exit code or signal) and SIGKILLs the child's process group when the stand-in goes away first
(ft_launcher stopped that worker).

Lifetimes: the zygote dies with the agent (``PR_SET_PDEATHSIG``: SIGTERM, on which it SIGKILLs
every child's process group first) and every child with the zygote, so no process outlives the
agent; a child's own helpers (NVRx's checkpoint writer, spawned into its process group) die with
that group, which is killed when its stand-in is gone, when the child ended (as ft_launcher kills
a cold worker's group when it closes it) and when the zygote is stopped.
"""

from __future__ import annotations

import ctypes
import gc
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.elastic_env import AGENT_PID_ENV
from kfp_nvrx.components.training.trainer.handoff import STREAMS, receive, send

#: Seconds a request may take to arrive once a stand-in connected.
REQUEST_WAIT_S = 5.0
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Send ``sig`` to this process when its parent dies; exits at once if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # the parent was gone before the request took effect
        os._exit(1)


def warm_up() -> None:
    """Imports, once, what a worker imports before it trains (every child shares the pages).

    ``__main__``'s "imports" part and what ``prepare_job`` and ``run`` import later.
    """
    import kfp_nvrx.components.training.checkpoint  # noqa: F401
    import kfp_nvrx.components.training.trainer.__main__  # noqa: F401
    import kfp_nvrx.components.training.trainer.bootstrap  # noqa: F401
    import kfp_nvrx.components.training.trainer.data  # noqa: F401
    import kfp_nvrx.components.training.trainer.inprocess_restart  # noqa: F401
    import kfp_nvrx.components.training.trainer.resilience  # noqa: F401
    import kfp_nvrx.components.training.trainer.train  # noqa: F401


@dataclass
class Child:
    """A forked worker: its pid (its process group too), its stand-in's socket, its pidfd.

    ``conn`` is None once the stand-in is gone (the worker was killed and is being reaped).
    """

    pid: int
    conn: socket.socket | None
    pidfd: int


class Zygote:
    """Accepts hand-offs on ``path`` and forks one worker per hand-off.

    Args:
        path: The socket's path (its folder private to the agent's user).
        run: What a forked child runs with the hand-off's request; its return is the exit code.
    """

    def __init__(self, path: str, run: Callable[[dict[str, Any]], int] | None = None) -> None:
        self.path = path
        self.run = run or run_worker
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.children: list[Child] = []
        self.pid = os.getpid()

    def stop_on(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """On ``sig`` (the agent is gone, or stops it): every child's group is killed, then exit.

        A worker SIGKILLed by its own death signal leaves the helpers it spawned into its group
        (NVRx's checkpoint writer) running: nothing but this kills that group then.
        """
        def stop(_signum: int, _frame: object) -> None:
            if os.getpid() != self.pid:  # a fork that has not reset its dispositions yet
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
                return
            for child in self.children:
                _kill_group(child.pid)
            os._exit(0)

        signal.signal(sig, stop)

    def listen(self) -> None:
        """Binds under a temporary name and renames, so a client never finds a dead socket."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        self.listener.bind(tmp)
        self.listener.listen(64)
        os.replace(tmp, self.path)

    def serve(self) -> None:
        """The loop: new hand-offs, children that ended, stand-ins that went away."""
        while True:
            watched: list[Any] = [self.listener, *(c.pidfd for c in self.children),
                                  *(c.conn for c in self.children if c.conn is not None)]
            ready, _, _ = select.select(watched, [], [])
            for child in list(self.children):
                if child.pidfd in ready:
                    self._ended(child)
                elif child.conn is not None and child.conn in ready:
                    self._orphaned(child)
            if self.listener in ready:
                self._accept()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(REQUEST_WAIT_S)
        try:
            request, fds = receive(conn, len(STREAMS))
        except (OSError, ValueError):
            conn.close()
            return
        if request is None or len(fds) != len(STREAMS):
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._become_worker(parent, request, fds, conn)  # never returns
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        self.children.append(Child(pid, conn, os.pidfd_open(pid)))
        try:
            send(conn, {"pid": pid})
        except OSError:  # the stand-in is already gone
            self._orphaned(self.children[-1])

    def _ended(self, child: Child) -> None:
        """The worker ended: what is left of its group goes too, its stand-in ends the same way."""
        _kill_group(child.pid)  # before the reap: the zombie keeps its pid from being reused
        _, status = os.waitpid(child.pid, 0)
        end = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
               else {"exit": os.waitstatus_to_exitcode(status)})
        if child.conn is not None:
            try:
                send(child.conn, end)
            except OSError:
                pass
            child.conn.close()
        os.close(child.pidfd)
        self.children.remove(child)

    def _orphaned(self, child: Child) -> None:
        """The stand-in is gone (ft_launcher killed it): so goes its worker, helpers and all.

        Reaped when its pidfd says it ended; the loop serves other hand-offs meanwhile (a worker
        with a GPU context takes most of a second to die).
        """
        _kill_group(child.pid)
        assert child.conn is not None
        child.conn.close()
        child.conn = None

    def _become_worker(self, parent: int, request: dict[str, Any], fds: list[int],
                       conn: socket.socket) -> None:
        """In the forked child: take the stand-in's place and run the trainer (never returns)."""
        code = 1
        try:
            os.setsid()  # its own process group: what ft_launcher would have killed
            die_with_parent(parent)
            self.listener.close()
            conn.close()
            for other in self.children:
                if other.conn is not None:
                    other.conn.close()
                os.close(other.pidfd)
            for target, fd in zip(STREAMS, fds, strict=True):
                os.dup2(fd, target)
                os.close(fd)
            take_over(request)
            code = self.run(request)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:  # noqa: BLE001 - the worker's last words, then its exit
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)


def _kill_group(pid: int) -> None:
    """SIGKILLs the process group of the child ``pid`` (the child alone before its setsid)."""
    for kill in (os.killpg, os.kill):  # the group exists once the child called setsid
        try:
            kill(pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            continue


def take_over(request: dict[str, Any]) -> None:
    """This fork becomes the stand-in's worker: its streams, directory, environment, argv."""
    # Fresh stream objects on the handed-over descriptors (line-buffered: a log line is never
    # held back); what the zygote buffered before the fork is not the worker's.
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stream
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(request["cwd"])
    env = {str(k): str(v) for k, v in request["env"].items()}
    env[AGENT_PID_ENV] = str(request["agent_pid"])
    os.environ.clear()
    os.environ.update(env)  # putenv too: NCCL and NVRx read the C environment
    for sig in range(1, signal.NSIG):  # the stand-in's dispositions were the defaults
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
    sys.argv = list(request["argv"])


def run_worker(request: dict[str, Any]) -> int:
    """The trainer's ``main``, in a fork that took the stand-in's place (:func:`take_over`)."""
    import torch

    # The OpenMP pool was sized from the agent's environment at import; a worker's says more.
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    from kfp_nvrx.components.training.trainer.__main__ import main

    return main(sys.argv[1:], clock=(request.get("t_exec"), float(request["t_main"]),
                                     time.time()))


def cuda_initialized() -> bool:
    """Whether the imports initialised CUDA in this process, which a fork cannot share.

    torch initialises it lazily (the first tensor on a GPU); loading its libraries, ``libcuda``
    included, is fine: forks of this process ran CUDA and NCCL on an H100 (NOTES, issue 37).
    """
    import torch

    return torch.cuda.is_initialized()


def main(argv: list[str] | None = None) -> int:
    """``zygote.py SOCKET PARENT_PID``: warms up, then serves until the agent is gone."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m kfp_nvrx.components.training.trainer.zygote SOCKET PARENT_PID",
              file=sys.stderr)
        return 2
    # SIGTERM, not SIGKILL: stop_on() below kills the workers' groups before the zygote goes.
    die_with_parent(int(args[1]), signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is the agent's to handle
    t0 = time.time()
    warm_up()
    # The imported objects stay out of every fork's garbage collections: a collection that walked
    # them would write to (and so copy) each of their shared pages in every worker.
    gc.collect()
    gc.freeze()
    if cuda_initialized():
        print("[zygote] the imports initialised CUDA, which a fork cannot share; workers start "
              "cold", file=sys.stderr, flush=True)
        return 1
    zygote = Zygote(args[0])
    zygote.stop_on(signal.SIGTERM)
    zygote.listen()
    print(f"[zygote] warm in {time.time() - t0:.1f} s: workers start from {Path(args[0]).name}",
          file=sys.stderr, flush=True)  # nothing left buffered to fork
    zygote.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
