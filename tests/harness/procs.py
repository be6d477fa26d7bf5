"""Processes of the test cluster: started in their own process group, tied to their parent.

Every component is a child of one supervisor. ``PR_SET_PDEATHSIG`` makes the kernel SIGKILL a
child whose supervisor dies (even by SIGKILL), so no component outlives the cluster; a normal
stop sends SIGTERM to the child's process group, waits, then SIGKILLs the group.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec; survives exec (not a setuid binary).
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


#: Locks on the ports this process handed out; open (held) until the process ends.
_held: list[int] = []
#: Below this, ports are left to the system's fixed services.
_LOWEST = 10000


def _ephemeral_start() -> int:
    """The first port of the kernel's range for outgoing connections (bounded read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", "rb") as f:
            return int(f.read(64).split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _reserve(port: int, locks: Path) -> bool:
    """Takes this machine's lock on ``port`` for this process's life, if free and unlocked."""
    fd = os.open(locks / str(port), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    except OSError:  # another cluster holds it, or something listens or lingers on it
        os.close(fd)
        return False
    _held.append(fd)
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1, free now and reserved on this machine for this process's life.

    Ports come from below the kernel's range for outgoing connections: a port from that range
    (``bind(0)``) can be taken by any process's next connection before the component binds it
    (CI saw Kueue's health port go so). Two clusters on one machine (pytest-xdist workers) pick
    apart through one ``flock`` per port, held by the supervisor that started the components.
    """
    locks = Path(tempfile.gettempdir()) / f"kfp-nvrx-test-ports-{os.getuid()}"
    locks.mkdir(mode=0o700, exist_ok=True)
    top = _ephemeral_start()
    if top - _LOWEST < 1000:  # an unusual range leaves no room below it: take the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(200):
        port = random.randrange(_LOWEST, top)
        if _reserve(port, locks):
            return port
    raise RuntimeError(f"no free TCP port in {_LOWEST}-{top - 1} after 200 tries")


def tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a log file (bounded read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError as e:
        return f"<no log: {e}>"
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22).

    Together with the pid it names one process for good: a recycled pid has another start time.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def alive(pid: int, started: int | None = None) -> bool:
    """Whether ``pid`` runs (and is still the process that started at ``started``)."""
    st = start_time(pid)
    if st is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and (started is None or st == started)


class Proc:
    """One component process with its log file.

    Args:
        name: Component name (log file ``<name>.log`` in ``logs``).
        argv: Command line.
        logs: Folder for the log.
        env: Extra environment (merged over the supervisor's).
        cwd: Working directory.
    """

    def __init__(self, name: str, argv: Sequence[str], logs: Path,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = logs / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        """Start the process in a new session (its own process group)."""
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd,
                                          start_new_session=True, preexec_fn=_die_with_parent)
        return self

    @property
    def pid(self) -> int:
        """The process id (the process group id too)."""
        assert self.popen is not None
        return self.popen.pid

    def running(self) -> bool:
        """Whether the process has not exited."""
        return self.popen is not None and self.popen.poll() is None

    def died(self) -> str | None:
        """None while running, else a line naming the exit and the log's tail."""
        if self.popen is None or self.popen.poll() is None:
            return None
        return f"{self.name} exited with {self.popen.returncode}; log {self.log}:\n{tail(self.log)}"

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL the group."""
        if self.popen is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # Whatever else the component left in its group (it forked helpers) goes too.
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_until(what: str, check, timeout_s: float, procs: Sequence[Proc] = (),
               interval_s: float = 0.25) -> None:
    """Poll ``check()`` until it is truthy; fail early if one of ``procs`` died.

    Raises:
        RuntimeError: the deadline passed or a process exited, with its log tail.
    """
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        for p in procs:
            if (msg := p.died()) is not None:
                raise RuntimeError(f"waiting for {what}: {msg}")
        try:
            if check():
                return
        except Exception as e:  # noqa: BLE001 - readiness probes fail in many ways until ready
            last = e
        time.sleep(interval_s)
    logs = "\n".join(f"--- {p.name}:\n{tail(p.log, 20)}" for p in procs)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s (last error: {last})\n{logs}")
