"""What ties a local run to its launcher: the run-dir lock, the watchdog and the agents' leash.

Three layers, so that no single process's death breaks "one run owns a run dir" or "no process
outlives its launcher":

- :class:`RunDirLock`: one launcher owns a run dir at a time. ``flock`` on
  ``<run_dir>/.kfp-nvrx-run.lock`` (the holder's pid, host and start time written into it); the
  kernel drops the lock when the last process holding it dies, so a lock file left by a dead run
  is simply taken. The launcher holds it itself and hands the same open file to the watchdog and
  to every agent (:func:`die_with_parent` via ``pass_fds``), so it stays taken while any of them
  lives, whichever dies first.
- :class:`Watchdog`: a small process that outlives the launcher by design. It reads a pipe whose
  only writer is the launcher; end-of-file means the launcher is gone (exit, crash, SIGKILL), and
  the watchdog then stops every process carrying the run's marker in its environment (agents,
  workers, checkpoint writer processes): SIGTERM, a grace period, SIGKILL. The launcher polls it
  and starts a new one when it dies.
- :func:`die_with_parent`: every agent runs with ``PR_SET_PDEATHSIG`` = SIGTERM, so the kernel
  itself tells it to stop when the launcher dies, even with no watchdog left. A kernel mechanism,
  not one more process that can be killed: a pipe the agents watch would need a watcher in
  every agent (``ft_launcher`` is not ours), and that watcher could die like the watchdog did.
  SIGTERM, not SIGKILL: ``ft_launcher`` stops its workers on SIGTERM (they lead sessions of their
  own and would be orphaned by a SIGKILLed agent), and keeps the lock until they are gone.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from kfp_nvrx.components.errors import UserError

LOCK_FILE = ".kfp-nvrx-run.lock"


class RunDirLock:
    """An exclusive lock on a run dir, held from :meth:`acquire` until :meth:`release`.

    Args:
        run_dir: The (existing) run directory.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunDirLock:
        """Take the lock or raise UserError naming ``run_dir`` and the holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = self._holder(fd)
            os.close(fd)
            raise UserError("run_dir", f"{self.path.parent} is in use by another run ({holder});"
                            " wait for it to finish or choose another `run_dir`") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": dt.datetime.now().isoformat(timespec="seconds")}
                                ).encode())
        self.fd = fd
        return self

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"{}")
            return f"pid {info['pid']} on {info['host']} since {info['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def release(self) -> None:
        """Drop the lock (the file stays: it is ours, and an unlocked file means free)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def processes_with_env(key: str, value: str) -> list[int]:
    """PIDs of the processes whose environment holds ``key=value``, this process excluded.

    Every process of a run inherits the run's marker (agents, workers, the checkpoint writer's
    processes), also one that left its session or was reparented to init, so the marker finds
    what a walk of the process tree would miss. Processes we may not read are skipped.
    """
    import psutil  # imported by the scan only: the launcher may never need it

    me, found = os.getpid(), []
    for proc in psutil.process_iter():
        try:
            if proc.pid != me and proc.environ().get(key) == value:
                found.append(proc.pid)
        except psutil.Error:  # gone, a zombie, or another user's
            continue
    return found


_WATCHDOG = r"""
import os, signal, sys, time
from kfp_nvrx.components.launch.lifetime import processes_with_env
key, _, value = sys.argv[1].partition("=")
grace = float(sys.argv[2])
sys.stdin.buffer.read()  # returns at EOF: the launcher is gone
def alive():
    return processes_with_env(key, value)
for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
    pids = alive()
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    end = time.monotonic() + wait
    while pids and time.monotonic() < end:
        time.sleep(0.1)
        pids = alive()
"""


# Runs as the agent's first program: ask the kernel for SIGTERM when the parent dies, make sure
# the parent did not die before that took effect, then become the agent (execve keeps the
# setting). A wrapper rather than ``preexec_fn``: Python code between fork and exec is unsafe
# while the launcher's log threads run.
_DIE_WITH_PARENT = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
    sys.exit("kfp-nvrx: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)  # the launcher is already gone: nothing to run for
os.execvp(sys.argv[2], sys.argv[2:])
"""


def die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` wrapped so that the process gets SIGTERM from the kernel when we die.

    The signal follows the *thread* that starts the process (Linux semantics), so start it from
    the thread that lives as long as the run: :func:`.local.run_local`'s caller.
    """
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


class Watchdog:
    """Stops every process of a run once the launcher is gone, however it went.

    Args:
        env_marker: ``NAME=value`` that every process of the run carries in its environment.
        grace: Seconds between SIGTERM and SIGKILL.
        keep_fds: File descriptors the watchdog keeps open until it is done (the run-dir lock).
    """

    def __init__(self, env_marker: str, grace: float, keep_fds: tuple[int, ...] = ()) -> None:
        read, self._write = os.pipe()  # both ends close-on-exec: only we hold the write end
        env = {k: v for k, v in os.environ.items() if f"{k}={v}" != env_marker}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, env_marker, str(grace)], stdin=read,
            env=env, pass_fds=keep_fds, start_new_session=True,  # Ctrl-C reaches it not
            stdout=subprocess.DEVNULL)
        os.close(read)

    def dead(self) -> int | None:
        """The watchdog's exit status once it is gone (it should never go before :meth:`finish`)."""
        return self.proc.poll()

    def close(self) -> None:
        """Let go of a dead watchdog: close our end of its pipe and reap it."""
        if self._write is not None:
            os.close(self._write)
            self._write = None
        self.proc.wait()

    def finish(self, timeout: float = 30.0) -> None:
        """The launcher is done: let the watchdog sweep up leftovers, and wait for it."""
        if self._write is not None:
            os.close(self._write)
            self._write = None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass  # it is still killing stragglers; it holds the lock until it is done
