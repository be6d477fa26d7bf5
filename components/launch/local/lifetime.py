"""What ties a local run to its launcher: the run-dir lock, the watchdog and the agents' leash.

Three layers, so that no single process's death breaks "one run owns a run dir" or "no process
outlives its launcher":

- :class:`RunDirLock`: one launcher owns a run dir at a time, through two kinds of lock on
  ``<run_dir>/.kfp-nvrx-run.lock`` (the launcher's pid, host, start time and run marker written
  into it). The launcher takes ``flock`` and hands that open file to the watchdog (``pass_fds``),
  which forks nothing. Each agent takes a POSIX read lock of its own (``fcntl``) in
  :func:`die_with_parent` before it becomes ``ft_launcher``: a POSIX lock belongs to one process
  and is never inherited by a fork, so ft_launcher's forked helpers (NVRx's rank-monitor servers,
  which outlive a SIGKILLed agent by minutes) hold nothing, while a ``flock`` file handed to the
  agent was shared with every fork of it and kept the run dir taken by those orphans. A new
  launcher needs both: no ``flock`` (no launcher or watchdog of a run lives) and no POSIX lock (no
  agent does). The kernel drops each when its holder dies, so a lock file left by a dead run is
  simply taken; a refusal names the processes that hold it now (:func:`lock_holders`), not the
  pid of a launcher that may be long gone. What a dead run leaves behind once none of those lives
  (orphaned helpers carrying its marker) is stopped by the next launcher before it starts
  (:func:`stop_leftovers`).
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
  own and would be orphaned by a SIGKILLed agent), and keeps its lock until they are gone.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.launch_command import FT_LAUNCHER
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
        #: What the lock file said before we took it: the run that held the run dir last.
        self.previous: dict[str, Any] = {}

    def acquire(self, marker: str = "") -> RunDirLock:
        """Take the lock or raise UserError naming ``run_dir`` and the processes holding it.

        Args:
            marker: The run's environment marker, recorded for the next launcher (it stops what
                this run leaves behind if it dies without its watchdog, :func:`stop_leftovers`).
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no launcher or watchdog lives
            # No agent of an earlier run lives: a write lock is refused while any read lock is
            # held. Dropped at once, or our own agents could not take theirs.
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.lockf(fd, fcntl.LOCK_UN)
        except OSError:
            fcntl.flock(fd, fcntl.LOCK_UN)  # taken above if only an agent holds it: not a holder
            message = self._in_use(fd)
            os.close(fd)
            raise UserError("run_dir", message) from None
        self.previous = _read_record(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": dt.datetime.now().isoformat(timespec="seconds"),
                                  "marker": marker}).encode(), 0)
        self.fd = fd
        return self

    def _in_use(self, fd: int) -> str:
        """The refusal: who holds the run dir now (the recorded launcher may be gone)."""
        info = _read_record(fd)
        try:
            launcher = f"pid {info['pid']} on {info['host']} since {info['since']}"
        except KeyError:
            launcher = "holder unknown"
        holders = lock_holders(self.path) if info.get("host") == socket.gethostname() else []
        fix = "wait for it to finish or choose another `run_dir`"
        if not holders or info.get("pid") in holders:
            return f"{self.path.parent} is in use by another run ({launcher}); {fix}"
        held = ", ".join(f"pid {pid} ({_what(pid)})" for pid in holders[:3])
        return (f"{self.path.parent} is in use by another run: its launcher ({launcher}) is gone, "
                f"but {held} still hold{'s' if len(holders) == 1 else ''} it while stopping; "
                f"{fix}")

    def note(self, **fields: Any) -> None:
        """Adds ``fields`` to this launcher's record in the lock file (the next launch reads it).

        Raises:
            RuntimeError: The lock is not held.
        """
        fd = self.held()
        record = json.dumps({**_read_record(fd), **fields}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)

    def held(self) -> int:
        """The descriptor that holds the lock (a watchdog keeps it open until it is done).

        Raises:
            RuntimeError: The lock is not held (taken after :meth:`release`, or never).
        """
        if self.fd is None:
            raise RuntimeError(f"{self.path} is not locked by this launcher")
        return self.fd

    def release(self) -> None:
        """Drop the lock (the file stays: it is ours, and an unlocked file means free)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _read_record(fd: int) -> dict[str, Any]:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def lock_holders(path: str | os.PathLike[str]) -> list[int]:
    """PIDs of the live processes holding a lock on ``path`` (Linux; [] where /proc says nothing).

    ``/proc/<pid>/fdinfo/<fd>`` lists the locks held through that descriptor: a ``flock`` in
    every process sharing the open file, a POSIX lock in its owner alone. Processes we may not
    read are skipped.
    """
    try:
        want = os.stat(path)
    except OSError:
        return []
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fds = f"/proc/{entry.name}/fd"
        try:
            names = os.listdir(fds)
        except OSError:  # gone, or another user's
            continue
        for name in names:
            try:
                st = os.stat(f"{fds}/{name}")
                if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):
                    continue
                with open(f"/proc/{entry.name}/fdinfo/{name}", "rb") as fh:
                    if b"\nlock:" in b"\n" + fh.read(16384):
                        found.append(int(entry.name))
                        break
            except OSError:
                continue
    return sorted(found)


def _what(pid: int) -> str:
    """What a process of a run is, for a person: its role, or its program."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()[:4096].split(b"\0")
    except OSError:
        return "gone meanwhile"
    text = b" ".join(argv).decode("utf-8", "replace")
    if "ft_launcher" in text or FT_LAUNCHER in text:  # NVRx's own, or ours around it
        return "an ft_launcher agent"
    if WATCHDOG_TAG in text:
        return "the run's watchdog"
    return os.path.basename(argv[0].decode("utf-8", "replace")) or "unknown"


def stop_leftovers(previous: dict[str, Any], key: str, timeout: float = 30.0) -> int:
    """SIGKILLs what the run that held the run dir before left running; returns how many.

    Call it holding the lock: then no launcher, watchdog or agent of that run lives, and a
    process still carrying its marker (``key=previous['marker']``) is an orphan of a run that
    died whole (SIGKILLed with its watchdog): ft_launcher's rank-monitor servers, a worker's
    checkpoint writer, which would otherwise go on for minutes beside the new run. Only a run of
    this host is looked for; waits (up to ``timeout``) until they are gone.
    """
    marker = previous.get("marker")
    if not (isinstance(marker, str) and marker) or previous.get("host") != socket.gethostname():
        return 0
    import psutil

    pids = processes_with_env(key, marker)
    killed = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            proc = psutil.Process(pid)
            proc.kill()
            killed.append(proc)
    end = time.monotonic() + timeout
    # A dying process stops showing its environment before it closes its files (the run dir's
    # lock among them): the scan alone could say "gone" too early.
    while time.monotonic() < end and (
            not all(_ended(p) for p in killed) or processes_with_env(key, marker)):
        time.sleep(0.1)  # SIGKILLed: gone in a moment
    return len(pids)


def _ended(proc: Any) -> bool:
    """Past its exit: gone (or its pid reused) or a zombie, its files and locks released."""
    import psutil

    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:  # gone meanwhile, or not ours to read: take the scan's word
        return True


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


#: In the watchdog's command line: how a refusal tells it from other processes (:func:`_what`).
WATCHDOG_TAG = "kfp-nvrx watchdog"

_WATCHDOG = r"""
# kfp-nvrx watchdog
import os, signal, sys, time
from kfp_nvrx.components.launch.local.lifetime import processes_with_env
key, _, value = sys.argv[1].partition("=")
grace = float(sys.argv[2])
sweep = sys.argv[3:5]  # the run dir and the /dev/shm snapshot of the run's start
if sweep:
    from kfp_nvrx.components.core.shm_leftovers import read_snapshot, sweep_run
    before = read_snapshot(sweep[1])  # now: the launcher deletes the file when it ends
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
if sweep:  # every process of the run is gone: its host copy and leaked semaphores go too
    sweep_run(sweep[0], before)
    # and the launcher's stop folder (the snapshot's), when it is one: the next launch of the
    # run dir need not sweep again
    from pathlib import Path
    from kfp_nvrx.components.launch.local.shm_sweep import remove_stops_folder
    remove_stops_folder(Path(sweep[1]).parent)
"""


# Runs as the agent's first program: ask the kernel for SIGTERM when the parent dies, take the
# run dir's POSIX read lock (argv[2], "" for none) on a descriptor that stays open across exec, so
# the agent holds it until it exits and its forks never do; make sure the parent did not die
# before that took effect, then become the agent (execve keeps both). A wrapper rather than
# ``preexec_fn``: Python code between fork and exec is unsafe while the launcher's log threads run.
_DIE_WITH_PARENT = r"""
import ctypes, fcntl, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
    sys.exit("kfp-nvrx: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if sys.argv[2]:
    fd = os.open(sys.argv[2], os.O_RDONLY)
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        sys.exit("kfp-nvrx: cannot lock the run dir " + sys.argv[2] + ": " + err.strerror)
    os.set_inheritable(fd, True)  # closed by exec, the lock would go with it
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)  # the launcher is already gone: nothing to run for
os.execvp(sys.argv[3], sys.argv[3:])
"""


def die_with_parent(argv: list[str], hold: str | os.PathLike[str] = "") -> list[str]:
    """``argv`` wrapped so that the process gets SIGTERM from the kernel when we die.

    The signal follows the *thread* that starts the process (Linux semantics), so start it from
    the thread that lives as long as the run: :func:`.local.run_local`'s caller.

    Args:
        argv: The program to run.
        hold: A :class:`RunDirLock` file: the process holds a POSIX read lock on it until it
            exits, which keeps the run dir taken while it stops its workers (none of its forks
            holds it).
    """
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), str(hold),
            *argv]


class Watchdog:
    """Stops every process of a run once the launcher is gone, however it went.

    Args:
        env_marker: ``NAME=value`` that every process of the run carries in its environment.
        grace: Seconds between SIGTERM and SIGKILL.
        keep_fds: File descriptors the watchdog keeps open until it is done (the run-dir lock).
        sweep: The run dir and the file of :func:`..core.shm_leftovers.snapshot` taken at the
            run's start: once the run's processes are gone the watchdog removes the run's host
            copy and the semaphores it leaked in ``/dev/shm`` (a SIGKILLed launcher left them).
    """

    def __init__(self, env_marker: str, grace: float, keep_fds: tuple[int, ...] = (),
                 sweep: tuple[str, str] | tuple[()] = ()) -> None:
        read, write = os.pipe()  # both ends close-on-exec: only we hold the write end
        self._write: int | None = write
        env = {k: v for k, v in os.environ.items() if f"{k}={v}" != env_marker}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, env_marker, str(grace), *sweep], stdin=read,
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
