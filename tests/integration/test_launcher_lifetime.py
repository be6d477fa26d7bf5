"""One launcher owns a run dir at a time, and the watchdog and the kernel stop what it leaves.

The lock, the watchdog and the agents' leash (``die_with_parent``), each with small stand-in
processes; launch-local end to end is in ``test_launch_local_lifetime.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from support.lifetime_procs import (
    TAG,
    alive,
    dead,
    gone_and_unlocked,
    lock_free_only_once_all_are_gone,
    try_lock,
    wait_until,
)

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.local.lifetime import (
    LOCK_FILE,
    RunDirLock,
    Watchdog,
    die_with_parent,
    processes_with_env,
)


def test_processes_with_env_finds_exactly_the_marked_ones() -> None:
    """psutil's scan agrees with a plain read of /proc: the marked process, not a near miss."""
    token = uuid.uuid4().hex
    marked = subprocess.Popen(["sleep", "60"], env={**os.environ, TAG: token})
    other = subprocess.Popen(["sleep", "60"], env={**os.environ, TAG: token + "x"})
    try:
        assert processes_with_env(TAG, token) == alive(token) == [marked.pid]
    finally:
        for proc in (marked, other):
            proc.kill()
            proc.wait()
    assert processes_with_env(TAG, token) == []


# -- the lock ------------------------------------------------------------------------------------

def test_second_holder_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    first = RunDirLock(tmp_path).acquire()
    with pytest.raises(UserError) as err:
        RunDirLock(tmp_path).acquire()
    assert err.value.field == "run_dir" and f"pid {os.getpid()}" in err.value.message
    first.release()
    RunDirLock(tmp_path).acquire().release()


def test_a_lock_left_by_a_killed_run_is_taken(tmp_path: Path) -> None:
    code = ("import sys, time; from kfp_nvrx.components.launch.local.lifetime import "
            "RunDirLock; RunDirLock(sys.argv[1]).acquire(); print('locked', flush=True); "
            "time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(UserError):
        RunDirLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    assert (tmp_path / LOCK_FILE).exists()  # stale file, no holder
    RunDirLock(tmp_path).acquire().release()


# -- the watchdog --------------------------------------------------------------------------------

def test_watchdog_kills_the_run_when_the_launcher_is_killed(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    # A "launcher" that starts a watchdog and a child that ignores SIGTERM, then waits forever.
    code = f"""
import os, subprocess, sys, time
from kfp_nvrx.components.launch.local.lifetime import RunDirLock, Watchdog
lock = RunDirLock(sys.argv[1]).acquire()
wd = Watchdog("{TAG}={token}", grace=1.0, keep_fds=(lock.fd,))
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True);"
    " time.sleep(600)"], env={{**os.environ, "{TAG}": "{token}"}}, stdout=subprocess.PIPE,
    text=True, start_new_session=True)
child.stdout.readline()
print("ready", flush=True)
time.sleep(600)
"""
    launcher = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
    assert launcher.stdout.readline().strip() == "ready"
    assert len(alive(token)) == 1
    with pytest.raises(UserError):  # the lock is held while the run lives
        RunDirLock(tmp_path).acquire()
    launcher.kill()
    launcher.wait()
    # SIGTERM ignored: the watchdog escalates to SIGKILL, then releases the lock
    gone_and_unlocked(token, tmp_path, 30)


def test_watchdog_finish_returns_when_nothing_is_left() -> None:
    wd = Watchdog(f"{TAG}={uuid.uuid4().hex}", grace=1.0)
    wd.finish()
    assert wd.proc.returncode == 0


# -- the agents' leash: the kernel, not the watchdog -----------------------------------------

def test_a_child_dies_with_its_parent_by_sigterm_and_holds_the_lock_until_then(tmp_path):
    """No watchdog at all: the parent is SIGKILLed, the kernel SIGTERMs the child (PDEATHSIG).

    The child handles SIGTERM like ft_launcher does (a clean stop that takes a moment), and the
    run-dir lock it was handed stays taken until it has exited.
    """
    token = uuid.uuid4().hex
    stopped = tmp_path / "stopped"
    child = (f"import signal, sys, time\n"
             f"def stop(*_):\n    open({str(stopped)!r}, 'w').write('SIGTERM')\n"
             f"    time.sleep(1)\n    sys.exit(0)\n"
             f"signal.signal(signal.SIGTERM, stop)\nprint('up', flush=True)\ntime.sleep(600)\n")
    parent = f"""
import os, subprocess, sys, time
from kfp_nvrx.components.launch.local.lifetime import RunDirLock, die_with_parent
lock = RunDirLock(sys.argv[1]).acquire()
p = subprocess.Popen(die_with_parent([sys.executable, "-c", {child!r}], hold=lock.path),
                     env={{**os.environ, "{TAG}": "{token}"}}, stdout=subprocess.PIPE, text=True,
                     start_new_session=True)
p.stdout.readline()
print("ready", p.pid, flush=True)
time.sleep(600)
"""
    launcher = subprocess.Popen([sys.executable, "-c", parent, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
    try:
        ready, pid = launcher.stdout.readline().split()
        assert ready == "ready" and alive(token) == [int(pid)]
        launcher.kill()
        launcher.wait()
        lock_free_only_once_all_are_gone(tmp_path, token, 60)
        assert stopped.read_text() == "SIGTERM"
        assert try_lock(tmp_path)
    finally:
        for pid in alive(token):
            os.kill(pid, signal.SIGKILL)


_AGENT_WITH_HELPER = """
import os, signal, sys, time
if os.fork() == 0:  # a helper, forked as the agent forks its rank-monitor servers
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    os._exit(0)
signal.signal(signal.SIGTERM, lambda *_: time.sleep(600))  # stopping takes long (workers)
print("up", flush=True)
time.sleep(600)
"""


def _launcher_with_agent(tmp_path: Path, token: str) -> tuple[subprocess.Popen, list[int]]:
    """A "launcher": the lock, a watchdog that cannot act, an agent that forks a helper.

    Returns the launcher and the pids of (watchdog, agent).
    """
    code = f"""
import os, signal, subprocess, sys, time
from kfp_nvrx.components.launch.local.lifetime import RunDirLock, Watchdog, die_with_parent
lock = RunDirLock(sys.argv[1]).acquire("{token}")
wd = Watchdog("{TAG}=never-{token}", grace=1.0, keep_fds=(lock.fd,))
agent = subprocess.Popen(die_with_parent([sys.executable, "-c", {_AGENT_WITH_HELPER!r}],
                                         hold=lock.path),
                         env={{**os.environ, "{TAG}": "{token}"}}, stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
agent.stdout.readline()
print(wd.proc.pid, agent.pid, flush=True)
time.sleep(600)
"""
    launcher = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in launcher.stdout.readline().split()]
    wait_until(lambda: len(alive(token)) == 2, 30, "the agent and its helper")
    return launcher, pids


def test_sigkill_of_launcher_watchdog_and_agent_leaves_no_holder_and_no_orphan(tmp_path):
    """Issue 30 item 16: the agent's forked helper outlived them all and held the run dir."""
    from kfp_nvrx.components.launch.local.lifetime import stop_leftovers

    token = uuid.uuid4().hex
    launcher, (watchdog, agent) = _launcher_with_agent(tmp_path, token)
    try:
        for pid in (launcher.pid, watchdog, agent):
            os.kill(pid, signal.SIGKILL)
        launcher.wait()
        wait_until(lambda: all(dead(p) for p in (watchdog, agent)), 30, "the SIGKILLs")
        (helper,) = alive(token)  # the orphan: alive, and holding nothing
        lock = RunDirLock(tmp_path).acquire(uuid.uuid4().hex)  # at once, no waiting
        assert lock.previous["marker"] == token and lock.previous["pid"] == launcher.pid
        assert stop_leftovers(lock.previous, TAG) == 1 and dead(helper)
        assert alive(token) == []
        lock.release()
    finally:
        for pid in alive(token):
            os.kill(pid, signal.SIGKILL)


def test_a_refusal_names_the_live_holder_not_the_dead_launcher(tmp_path):
    token = uuid.uuid4().hex
    launcher, (watchdog, agent) = _launcher_with_agent(tmp_path, token)
    try:
        for pid in (launcher.pid, watchdog):
            os.kill(pid, signal.SIGKILL)
        launcher.wait()
        wait_until(lambda: dead(watchdog), 30, "the watchdog's SIGKILL")
        # The agent got its SIGTERM from the kernel and is slow to stop: the run dir stays taken.
        with pytest.raises(UserError) as err:
            RunDirLock(tmp_path).acquire()
        message = err.value.message
        assert "ft_launcher" not in message  # the agent here is a plain python process
        assert f"but pid {agent} (" in message and "still holds it" in message
        assert f"its launcher (pid {launcher.pid} on " in message and "is gone" in message
        assert str(watchdog) not in message  # dead, and the helper holds nothing
        os.kill(agent, signal.SIGKILL)
        wait_until(lambda: dead(agent), 30, "the agent's SIGKILL")
        RunDirLock(tmp_path).acquire().release()
    finally:
        for pid in alive(token):
            os.kill(pid, signal.SIGKILL)


def test_a_refusal_names_the_watchdog_when_only_it_is_left(tmp_path):
    code = """
import sys, time
from kfp_nvrx.components.launch.local.lifetime import RunDirLock, Watchdog
lock = RunDirLock(sys.argv[1]).acquire()
wd = Watchdog("KFP_NVRX_NOTHING=1", grace=1.0, keep_fds=(lock.fd,))
print(wd.proc.pid, flush=True)
time.sleep(600)
"""
    launcher = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
    watchdog = int(launcher.stdout.readline())
    try:
        os.kill(watchdog, signal.SIGSTOP)  # it would finish at once: nothing of the run is left
        launcher.kill()
        launcher.wait()
        with pytest.raises(UserError) as err:
            RunDirLock(tmp_path).acquire()
        assert f"but pid {watchdog} (the run's watchdog) still holds it" in err.value.message
    finally:
        os.kill(watchdog, signal.SIGKILL)


def test_die_with_parent_does_not_start_a_child_whose_parent_is_already_gone(tmp_path):
    """The pid check closes the window between fork and prctl: an orphan never runs the program."""
    ran = tmp_path / "ran"
    argv = die_with_parent([sys.executable, "-c", f"open({str(ran)!r}, 'w')"])
    argv[argv.index(str(os.getpid()))] = "1"  # "our parent" is init: we are not it
    assert subprocess.run(argv).returncode == 0
    assert not ran.exists()
    assert subprocess.run(die_with_parent([sys.executable, "-c", f"open({str(ran)!r}, 'w')"])
                          ).returncode == 0
    assert ran.exists()


def test_agent_stream_shows_what_matters_and_logs_everything(tmp_path):
    """Non-verbose: NVRx chatter and a survivor's peer-reset traceback are hidden, not lost."""
    from kfp_nvrx.components.launch.local.agent import Agent, NodeOutput

    lines = [
        "  max_restarts     : 3",
        "[trainer] step 10/40 loss 4.3",
        "[ALWAYS] [RankMonServer.Restarter] [NestedRestarter] name=[InJob] state=aborted",
        "[INFO] [RankMonServer1@vm:0] Started periodic restart check.",
        "[rank0]: Traceback (most recent call last):",
        "[rank0]:   File \"x.py\", line 1, in <module>",
        "[rank0]: RuntimeError: [pair.cc:537] Read error: Connection reset by peer. GLHF!",
        "[ERROR] [ft_launcher1@vm] failed (exitcode: -9) local_rank: 0",
        "[rank1]: Traceback (most recent call last):",
        "[rank1]: ValueError: a real error",
    ]
    script = "import sys\nfor line in sys.argv[1:]:\n    print(line)\n"
    shown: list[str] = []
    agent = Agent(0, [sys.executable, "-c", script, *lines], dict(os.environ),
                  NodeOutput(shown.append, False, tmp_path / "node0.log"))
    agent.proc.wait()
    agent.thread.join(10)
    assert shown == ["[node0] [trainer] step 10/40 loss 4.3",
                     "[node0] [ERROR] [ft_launcher1@vm] failed (exitcode: -9) local_rank: 0",
                     "[node0] [rank1]: Traceback (most recent call last):",
                     "[node0] [rank1]: ValueError: a real error"]
    assert (tmp_path / "node0.log").read_text().splitlines() == lines


_COUNTS_SIGTERMS = """
import signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
for line in sys.argv[1:]:
    print(line, flush=True)
deadline = time.time() + 3
while time.time() < deadline:
    time.sleep(0.05)
print(f"sigterms {len(got)}", flush=True)
"""


@pytest.mark.parametrize("verdict", [False, True])
def test_an_agent_is_sigtermed_once_and_not_by_us_after_its_worker_gave_up(tmp_path, verdict):
    """ft_launcher raises a second SIGTERM during its exit as a SignalException traceback, which
    reached a failed run's last lines (the launcher stopped every agent twice, and the one whose
    worker gave up had that worker's SIGTERM too: ``job.give_up``)."""
    from kfp_nvrx.components.core.exits import GAVE_UP
    from kfp_nvrx.components.launch.local.agent import Agent, NodeOutput

    lines = ["[trainer] step 4/8 loss 4.0"] + ([f"{GAVE_UP} the job's in-job restarts are used up"]
                                              if verdict else [])
    agent = Agent(0, [sys.executable, "-c", _COUNTS_SIGTERMS, *lines], dict(os.environ),
                  NodeOutput(lambda _line: None, False, tmp_path / "node0.log"))
    while len(agent.tail) < len(lines):  # the agent said all it had to say
        assert agent.proc.poll() is None
        time.sleep(0.05)
    agent.terminate()  # as _stop_agents does: terminate every agent, then stop each
    time.sleep(0.3)  # the first is handled by then (two at once would be one pending signal)
    agent.stop(grace=10)
    agent.thread.join(10)
    assert agent.tail[-1] == f"sigterms {0 if verdict else 1}"
    if verdict:
        assert agent.verdict_tail == lines
