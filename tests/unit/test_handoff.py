"""Warm starts: the hand-off protocol between a worker's stand-in and the agent's zygote.

Real processes and sockets: a zygote (``Zygote.serve`` in a child process) whose forked workers
run a small function instead of the trainer, and stand-ins started as ft_launcher starts workers
(``python -c`` calling ``hand_off``). The trainer under a warm start runs in
``tests/integration/test_warm_start.py``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kfp_nvrx.components.core.elastic_env import AGENT_PID_ENV
from kfp_nvrx.components.training.trainer.handoff import (
    STREAMS,
    ZYGOTE_ENV,
    hand_off,
    receive,
    send,
)
from kfp_nvrx.components.training.trainer.zygote import Zygote

#: A stand-in: this interpreter running hand_off as the trainer's __main__ does.
STAND_IN = ("import sys, time\n"
            "from kfp_nvrx.components.training.trainer.handoff import hand_off\n"
            "code = hand_off(sys.argv, time.time())\n"
            "print('cold' if code is None else f'stand-in exits {code}', flush=True)\n"
            "sys.exit(0 if code is None else code)\n")


#: A worker that ends with 7 once it got SIGTERM (says when its handler is set).
WAITS_FOR_TERM = ("import signal, sys, time\n"
                  "got = []\n"
                  "signal.signal(signal.SIGTERM, lambda s, f: got.append(s))\n"
                  "print('ready', flush=True)\n"
                  "deadline = time.monotonic() + 30\n"
                  "while not got and time.monotonic() < deadline:\n"
                  "    time.sleep(0.01)\n"
                  "sys.exit(7 if got else 1)\n")


def _worker(request: dict[str, Any]) -> int:
    """What a forked child runs in these tests: the request's argv says what to do."""
    what = request["argv"][1]
    got: list[int] = []
    if what == "wait-term":  # before the line below: the test signals once it read it
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    print(json.dumps({"pid": os.getpid(), "cwd": os.getcwd(), "argv": sys.argv,
                      "env": os.environ.get("HANDOFF_TEST", ""),
                      "agent": os.environ.get(AGENT_PID_ENV, ""), "pgid": os.getpgid(0)}),
          flush=True)
    if what in ("helper", "helper-exit"):  # a helper in the worker's group (as NVRx's writer)
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        print(json.dumps({"helper": helper.pid}), flush=True)
        if what == "helper-exit":
            return 0
    if what == "exit":
        return int(request["argv"][2])
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "wait-term":
        while not got:
            time.sleep(0.01)
        print("worker got SIGTERM", flush=True)
        return 7
    time.sleep(300)  # "sleep": stays until killed
    return 0


def _serve(path: str) -> None:
    zygote = Zygote(path, run=_worker)
    zygote.stop_on(signal.SIGTERM)  # as the zygote's main sets it up
    zygote.listen()
    zygote.serve()


@pytest.fixture()
def zygote(tmp_path: Path):
    path = str(tmp_path / "z.sock")
    pid = os.fork()
    if pid == 0:  # the zygote: serves until killed
        try:
            _serve(path)
        finally:
            os._exit(1)
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    yield path
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _stand_in(path: str, *args: str, cwd: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, ZYGOTE_ENV: path, "HANDOFF_TEST": "from the stand-in"}
    return subprocess.Popen([sys.executable, "-c", STAND_IN, *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _first_line(proc: subprocess.Popen) -> dict[str, Any]:
    return json.loads(proc.stdout.readline())


def test_the_worker_takes_the_stand_ins_place_and_its_exit_code_comes_back(zygote, tmp_path):
    proc = _stand_in(zygote, "exit", "3", cwd=tmp_path)
    seen = _first_line(proc)
    # The child wrote on the stand-in's stdout, with its argv, cwd and environment.
    assert seen["argv"][1:] == ["exit", "3"] and seen["cwd"] == str(tmp_path)
    assert seen["env"] == "from the stand-in" and seen["agent"] == str(os.getpid())
    assert seen["pid"] != proc.pid and seen["pgid"] == seen["pid"]  # a session of its own
    assert proc.wait(timeout=30) == 3
    assert proc.stdout.read().strip() == "stand-in exits 3"


def test_a_worker_killed_by_a_signal_kills_its_stand_in_with_it(zygote):
    proc = _stand_in(zygote, "kill")
    _first_line(proc)
    assert proc.wait(timeout=30) == -signal.SIGKILL  # ft_launcher sees a killed worker


def test_signals_to_the_stand_in_reach_the_worker(zygote):
    proc = _stand_in(zygote, "wait-term")
    _first_line(proc)
    proc.send_signal(signal.SIGTERM)  # ft_launcher stopping its workers
    assert proc.wait(timeout=30) == 7
    assert "worker got SIGTERM" in proc.stdout.read()


def _signalled_while_waiting(tmp_path: Path, reply: Callable[[socket.socket], None],
                            *args: str) -> subprocess.Popen:
    """A stand-in SIGTERMed while it waits for the zygote's reply; a zygote of the test's own
    then gives it ``reply`` (on a thread). Returns the stand-in once the reply is under way."""
    path = str(tmp_path / "z.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    asked, signalled = threading.Event(), threading.Event()

    def zygote() -> None:
        conn, _ = server.accept()
        with conn:
            _request, fds = receive(conn, len(STREAMS))
            for fd in fds:
                os.close(fd)
            asked.set()
            signalled.wait(30)
            reply(conn)
        server.close()

    threading.Thread(target=zygote, daemon=True).start()
    proc = _stand_in(path, *args)
    assert asked.wait(30)  # the stand-in waits for the reply
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)  # the stand-in has had the signal (and, unheld, died of it)
    signalled.set()
    return proc


def test_a_signal_before_the_forks_reply_reaches_the_worker(tmp_path):
    """ft_launcher may stop a worker while its stand-in still waits for the zygote's reply (the
    forked worker already runs): the signal is held and forwarded once the pid is known, never
    the stand-in's death by it with its worker left running."""
    codes: list[int] = []

    def fork(conn: socket.socket) -> None:
        worker = subprocess.Popen([sys.executable, "-c", WAITS_FOR_TERM],
                                  stdout=subprocess.PIPE, text=True)
        worker.stdout.readline()  # its handler is set
        send(conn, {"pid": worker.pid})
        codes.append(worker.wait(timeout=30))
        send(conn, {"exit": codes[-1]})

    proc = _signalled_while_waiting(tmp_path, fork, "slow")
    assert proc.wait(timeout=30) == 7, proc.stderr.read()
    assert codes == [7]


def test_a_signal_held_for_a_fork_that_never_came_is_delivered_to_the_cold_start(tmp_path):
    def refuse(conn: socket.socket) -> None:
        send(conn, {"error": "busy"})  # no fork: the stand-in starts cold

    proc = _signalled_while_waiting(tmp_path, refuse, "cold")
    # The held SIGTERM reaches the process as soon as it stops waiting: it ends of it, as a
    # cold start stopped at that moment does, and does not start the trainer.
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert "cold" not in proc.stdout.read()


def test_a_killed_stand_in_takes_its_worker_along(zygote):
    proc = _stand_in(zygote, "sleep")
    worker = _first_line(proc)["pid"]
    os.killpg(proc.pid, signal.SIGKILL)  # ft_launcher's SIGKILL of the worker's group
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(worker)


def test_the_zygote_serves_again_after_each_worker(zygote):
    for code in (0, 5, 0):
        proc = _stand_in(zygote, "exit", str(code))
        assert proc.wait(timeout=30) == code


def test_no_zygote_means_a_cold_start(tmp_path):
    proc = _stand_in(str(tmp_path / "nobody.sock"), "exit", "3")
    assert proc.wait(timeout=30) == 0 and proc.stdout.read().strip() == "cold"
    assert hand_off(["x", "--check"], time.time()) is None  # the preflight never hands off


def _zygote_of_our_own(tmp_path: Path) -> tuple[int, str]:
    """A zygote this test stops itself (the fixture's is killed at the end): (its pid, socket)."""
    path = str(tmp_path / "z.sock")
    zpid = os.fork()
    if zpid == 0:
        try:
            _serve(path)
        finally:
            os._exit(1)
    while not os.path.exists(path):
        time.sleep(0.01)
    return zpid, path


def test_a_worker_dies_with_its_zygote(tmp_path):
    zpid, path = _zygote_of_our_own(tmp_path)
    proc = _stand_in(path, "sleep")
    worker = _first_line(proc)["pid"]
    os.kill(zpid, signal.SIGKILL)
    os.waitpid(zpid, 0)
    assert proc.wait(timeout=30) == -signal.SIGKILL  # the stand-in reports a lost worker
    assert _gone(worker)  # PR_SET_PDEATHSIG


def _gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _alive(pid)


def test_a_stopped_zygote_takes_its_workers_helpers_along(tmp_path):
    """The agent is gone (the zygote's death signal is SIGTERM): the workers' groups are killed,
    helpers included, which a worker's own SIGKILL by its death signal would leave running."""
    zpid, path = _zygote_of_our_own(tmp_path)
    proc = _stand_in(path, "helper")
    worker = _first_line(proc)["pid"]
    helper = _first_line(proc)["helper"]
    os.kill(zpid, signal.SIGTERM)
    os.waitpid(zpid, 0)
    proc.wait(timeout=30)
    assert _gone(worker) and _gone(helper)


def test_what_an_ended_worker_left_in_its_group_goes_with_it(zygote):
    """As ft_launcher kills a cold worker's group when it closes it."""
    proc = _stand_in(zygote, "helper-exit")
    _first_line(proc)
    helper = _first_line(proc)["helper"]
    assert proc.wait(timeout=30) == 0
    assert _gone(helper)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_messages_are_read_whole_one_at_a_time_and_bounded():
    import socket
    import struct

    from kfp_nvrx.components.training.trainer.handoff import MAX_MESSAGE, receive, send

    a, b = socket.socketpair()
    with a, b:
        r, w = os.pipe()
        send(a, {"first": "x" * 100_000}, (r,))
        send(a, {"second": 2})
        first, fds = receive(b, 1)
        assert first == {"first": "x" * 100_000} and len(fds) == 1  # nothing of the next one
        assert receive(b) == ({"second": 2}, [])
        for fd in (r, w, *fds):
            os.close(fd)
        a.sendall(struct.pack("!I", MAX_MESSAGE + 1))
        with pytest.raises(ValueError):
            receive(b)
        a.close()
        assert receive(b) == (None, [])  # end of stream
