"""A worker's start handed to a warm process: the client side, standard library only.

ft_launcher starts every worker as ``python -m kfp_nvrx.components.training.trainer``; a cold
start then spends 2-2.5 s importing torch, NVRx and the trainer (issue 37: 4.3 s of process start
in a 9-11 s in-job restart at 1b). When the agent runs a warm process (:mod:`.zygote`, beside the
agent since the job started, with those imports done and CUDA untouched), the worker ft_launcher
started only hands its start over: it sends its argv, environment, working directory and standard
streams (``SCM_RIGHTS``) over the zygote's socket, the zygote forks a child that becomes the
worker, and this process stays as its stand-in for ft_launcher: it forwards the signals it gets to
the child and ends as the child ended (the same exit code, or killed by the same signal). A
zygote that is not there yet (still importing) or fails the handshake means a cold start, as
without one.

Everything here runs before torch is imported, in the process ft_launcher watches.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import time
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.procfs import STARTTIME, stat_fields

#: The zygote's socket, set by the agent in its workers' environment when warm starts are on.
ZYGOTE_ENV = "KFP_NVRX_ZYGOTE"
#: Signals the stand-in passes on: ft_launcher's stop and restart (SIGTERM), a user's ^C, hangups,
#: and the user signals NVRx and torch use.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
#: The standard streams handed over (ft_launcher's log files or pipes for this worker).
STREAMS = (0, 1, 2)
#: Most bytes of one message (a worker's environment is a few KiB).
MAX_MESSAGE = 1 << 20
#: A message's length, ahead of it.
_HEADER = struct.Struct("!I")
#: Seconds the stand-in waits for the zygote to say it forked (it forks at once when idle).
FORK_WAIT_S = 10.0


def process_start_time(pid: int | str = "self") -> float | None:
    """When process ``pid`` was created (Unix seconds, 10 ms resolution; None off Linux)."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + int(fields[STARTTIME]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def send(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    """One JSON message behind its length, with ``fds`` passed alongside the length."""
    data = json.dumps(message).encode()
    header = _HEADER.pack(len(data))
    if fds:
        sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(header)
    sock.sendall(data)


def _read(sock: socket.socket, size: int, nfds: int = 0) -> tuple[bytes, list[int]]:
    """``size`` bytes (fewer only at end of stream) and the descriptors sent with the first."""
    buf, fds = bytearray(), list[int]()
    while len(buf) < size:
        if nfds and not buf:
            data, anc, _, _ = sock.recvmsg(size, socket.CMSG_LEN(nfds * 4))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += array.array("i", payload[:len(payload) - len(payload) % 4])
        else:
            data = sock.recv(size - len(buf))
        if not data:
            break
        buf += data
    return bytes(buf), fds


def receive(sock: socket.socket, nfds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors sent with it; (None, []) at end of stream.

    Reads the length first, then exactly that (never more than :data:`MAX_MESSAGE` bytes), so
    nothing of a next message is consumed.
    """
    header, fds = _read(sock, _HEADER.size, nfds)
    size = _HEADER.unpack(header)[0] if len(header) == _HEADER.size else None
    body = _read(sock, size)[0] if size is not None and size <= MAX_MESSAGE else b""
    if size is None or len(body) != size:
        for fd in fds:
            os.close(fd)
        if size is not None and size > MAX_MESSAGE:
            raise ValueError(f"a message of {size} bytes, over {MAX_MESSAGE}")
        return None, []
    return json.loads(body), fds


def _request(argv: list[str], t_main: float) -> dict[str, Any]:
    return {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "agent_pid": os.getppid(),
            "t_exec": process_start_time(), "t_main": t_main}


def hand_off(argv: list[str], t_main: float) -> int | None:
    """Hands this worker's start to the agent's zygote; returns the worker's exit code.

    Args:
        argv: ``sys.argv`` of this process (the module's flags after the first item).
        t_main: When this process's ``__main__`` began (its start-up so far is reported).

    Returns:
        None when no zygote took it (none configured or listening, or it did not fork): the
        caller starts cold. Otherwise the exit code to exit with; a worker killed by a signal
        kills this process with the same signal instead of returning.
    """
    path = os.environ.get(ZYGOTE_ENV, "")
    if not path or "--check" in argv:
        return None
    # The signals are caught before the zygote is asked: the worker may run (and ft_launcher
    # signal this process) before the fork's reply arrives here.
    forwarder = _Forwarder()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        sock.settimeout(FORK_WAIT_S)
        send(sock, _request(argv, t_main), STREAMS)
        forked, _ = receive(sock)
    except (OSError, ValueError):
        forked = None
    if not forked or not isinstance(forked.get("pid"), int):
        sock.close()
        forwarder.cancel()
        return None
    forwarder.to(forked["pid"])
    return _stand_in(sock, forwarder)


class _Forwarder:
    """This process's handler of the :data:`FORWARDED` signals, installed when it is made.

    Until the worker's pid is known a signal is held; then it and every later one go to the
    worker. Cancelled (no worker), the old handlers return and a held signal is delivered to
    this process, which starts cold as if it had come then.
    """

    def __init__(self) -> None:
        self.pid: int | None = None
        self.held: list[int] = []
        self.previous = {sig: signal.signal(sig, self) for sig in FORWARDED}

    def __call__(self, signum: int, _frame: object) -> None:
        if self.pid is None:
            self.held.append(signum)
            return
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def to(self, pid: int) -> None:
        """The worker is ``pid``: the held signals go to it now."""
        self.pid = pid
        for signum in self.held:
            self(signum, None)
        self.held = []

    def cancel(self) -> None:
        """No worker: the old handlers back, a held signal delivered here."""
        for sig, handler in self.previous.items():
            # None: a handler not set from Python, i.e. the default one this process began with
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for signum in self.held:
            os.kill(os.getpid(), signum)


def _stand_in(sock: socket.socket, forwarder: _Forwarder) -> int:
    """Forwards signals to the worker until the zygote says how it ended."""
    sock.settimeout(None)
    try:
        ended, _ = receive(sock)
    except (OSError, ValueError):
        ended = None
    if ended is None:  # the zygote died (its children die with it): a lost worker
        forwarder(signal.SIGKILL, None)
        ended = {"signal": int(signal.SIGKILL)}
    if "signal" in ended:  # end as the worker did, for ft_launcher's failure report
        died_of = int(ended["signal"])
        if died_of not in (signal.SIGKILL, signal.SIGSTOP):  # those have no handler to reset
            signal.signal(died_of, signal.SIG_DFL)
        os.kill(os.getpid(), died_of)
        return 128 + died_of  # a signal this process survives (ignored by its parent's setting)
    return int(ended.get("exit", 1))
