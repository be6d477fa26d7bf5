"""No process outlives launch-local, and one launcher owns a run dir at a time.

Readiness is observed, never slept for: the tests wait until ``events.jsonl`` shows a training
step (so agents and workers exist) before they signal the launcher, and then wait (with a generous
deadline) until no process carrying the test's environment marker is left.
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

from kfp_nvrx.components.data.prepare import prepare_dataset
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.local.lifetime import (
    LOCK_FILE,
    RunDirLock,
    Watchdog,
    die_with_parent,
    processes_with_env,
)

TAG = "KFP_NVRX_LIFETIME_TEST"


def _alive(token: str) -> list[int]:
    needle = f"{TAG}={token}".encode()
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def _wait_until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _gone(token: str, timeout: float = 90) -> None:
    _wait_until(lambda: not _alive(token), timeout, "every process of the run to exit")


def test_processes_with_env_finds_exactly_the_marked_ones() -> None:
    """psutil's scan agrees with a plain read of /proc: the marked process, not a near miss."""
    token = uuid.uuid4().hex
    marked = subprocess.Popen(["sleep", "60"], env={**os.environ, TAG: token})
    other = subprocess.Popen(["sleep", "60"], env={**os.environ, TAG: token + "x"})
    try:
        assert processes_with_env(TAG, token) == _alive(token) == [marked.pid]
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
    assert len(_alive(token)) == 1
    with pytest.raises(UserError):  # the lock is held while the run lives
        RunDirLock(tmp_path).acquire()
    launcher.kill()
    launcher.wait()
    _gone(token, 30)  # SIGTERM ignored: the watchdog escalates to SIGKILL
    _wait_until(lambda: _try_lock(tmp_path), 30, "the watchdog to release the lock")


def _lock_free_only_once_all_are_gone(run_dir: Path, token: str, timeout: float) -> None:
    """Wait until no process of the run is left; never may the lock be free before that.

    The lock is tried *before* the processes are listed: a free lock means every holder was
    already dead, so a process still listed afterwards outlived the lock (no births here).
    """
    end = time.monotonic() + timeout
    while True:
        free = _try_lock(run_dir)
        alive = _alive(token)
        assert not (free and alive), f"run dir free while {alive} still run"
        if not alive:
            return
        assert time.monotonic() < end, f"{alive} outlived the launcher"
        time.sleep(0.1)


def _try_lock(path: Path) -> bool:
    try:
        RunDirLock(path).acquire().release()
        return True
    except UserError:
        return False


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
        assert ready == "ready" and _alive(token) == [int(pid)]
        launcher.kill()
        launcher.wait()
        _lock_free_only_once_all_are_gone(tmp_path, token, 60)
        assert stopped.read_text() == "SIGTERM"
        assert _try_lock(tmp_path)
    finally:
        for pid in _alive(token):
            os.kill(pid, signal.SIGKILL)


def _dead(pid: int) -> bool:
    """Gone, or a zombie (its locks and files are released before it becomes one)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


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
    _wait_until(lambda: len(_alive(token)) == 2, 30, "the agent and its helper")
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
        _wait_until(lambda: all(_dead(p) for p in (watchdog, agent)), 30, "the SIGKILLs")
        (helper,) = _alive(token)  # the orphan: alive, and holding nothing
        lock = RunDirLock(tmp_path).acquire(uuid.uuid4().hex)  # at once, no waiting
        assert lock.previous["marker"] == token and lock.previous["pid"] == launcher.pid
        assert stop_leftovers(lock.previous, TAG) == 1 and _dead(helper)
        assert _alive(token) == []
        lock.release()
    finally:
        for pid in _alive(token):
            os.kill(pid, signal.SIGKILL)


def test_a_refusal_names_the_live_holder_not_the_dead_launcher(tmp_path):
    token = uuid.uuid4().hex
    launcher, (watchdog, agent) = _launcher_with_agent(tmp_path, token)
    try:
        for pid in (launcher.pid, watchdog):
            os.kill(pid, signal.SIGKILL)
        launcher.wait()
        _wait_until(lambda: _dead(watchdog), 30, "the watchdog's SIGKILL")
        # The agent got its SIGTERM from the kernel and is slow to stop: the run dir stays taken.
        with pytest.raises(UserError) as err:
            RunDirLock(tmp_path).acquire()
        message = err.value.message
        assert "ft_launcher" not in message  # the agent here is a plain python process
        assert f"but pid {agent} (" in message and "still holds it" in message
        assert f"its launcher (pid {launcher.pid} on " in message and "is gone" in message
        assert str(watchdog) not in message  # dead, and the helper holds nothing
        os.kill(agent, signal.SIGKILL)
        _wait_until(lambda: _dead(agent), 30, "the agent's SIGKILL")
        RunDirLock(tmp_path).acquire().release()
    finally:
        for pid in _alive(token):
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


# -- launch-local, end to end ----------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "ds"
    prepare_dataset("sample:200", out, seq_len=64)
    return out


def _launch(run_dir: Path, data: Path, token: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kfp_nvrx.components.cli", "launch-local", "--run-dir",
         str(run_dir), "--nodes", "2", "--set", f"data.path={data}", "--set",
         "train.steps=100000", "--set", "train.step_sleep=0.05"],
        env={**os.environ, TAG: token}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def _training(run_dir: Path) -> bool:
    events = run_dir / "events.jsonl"
    return events.is_file() and '"type":"step"' in events.read_text()


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL])
def test_nothing_outlives_launch_local(sig: signal.Signals, data: Path, tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    launcher = _launch(run_dir, data, token)
    try:
        _wait_until(lambda: _training(run_dir), 180, "the first training step")
        second = subprocess.run(
            [sys.executable, "-m", "kfp_nvrx.components.cli", "launch-local", "--run-dir",
             str(run_dir), "--set", f"data.path={data}", "--set", "train.steps=100000"],
            capture_output=True, text=True, timeout=180)
        assert second.returncode == 2, second.stderr
        assert "--run-dir" in second.stderr and "in use" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
        launcher.send_signal(sig)
        rc = launcher.wait(timeout=120)
        if sig == signal.SIGHUP:
            assert rc == 128 + signal.SIGHUP, launcher.stderr.read()[-2000:]
        _gone(token)
        assert _try_lock(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _alive(token):
            os.kill(pid, signal.SIGKILL)


def _starts(run_dir: Path) -> int:
    """How many worker incarnations the run started (``start`` events)."""
    return (run_dir / "events.jsonl").read_text().count('"type":"start"')


def _watchdogs(token: str) -> list[int]:
    """The run's watchdog processes (they carry the test's tag, and their script)."""
    found = []
    for pid in _alive(token):
        try:
            if b"sys.stdin.buffer.read()" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def _launch_logged(run_dir: Path, data: Path, token: str, out: Path) -> subprocess.Popen:
    """launch-local as in :func:`_launch`, its output in a file (a pipe nobody reads fills up)."""
    with open(out, "w") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "kfp_nvrx.components.cli", "launch-local", "--run-dir",
             str(run_dir), "--nodes", "2", "--set", f"data.path={data}", "--set",
             "train.steps=100000", "--set", "train.step_sleep=0.05"],
            env={**os.environ, TAG: token}, stdout=fh, stderr=subprocess.STDOUT, text=True)


def test_a_killed_watchdog_is_replaced_and_the_run_still_ends_with_its_launcher(data, tmp_path):
    """SIGKILL the watchdog: the launcher starts a new one; SIGKILL the launcher: nothing of the
    run is left, and the run dir is not free while any process of it runs."""
    token, run_dir, out = uuid.uuid4().hex, tmp_path / "run", tmp_path / "launcher.log"
    launcher = _launch_logged(run_dir, data, token, out)
    try:
        _wait_until(lambda: _training(run_dir), 180, "the first training step")
        (first,) = _watchdogs(token)
        os.kill(first, signal.SIGKILL)
        _wait_until(lambda: [p for p in _watchdogs(token) if p != first], 60,
                    "the launcher to start a new watchdog")
        _wait_until(lambda: f"the watchdog (pid {first}) died (signal 9)" in out.read_text(), 30,
                    "the launcher to say so")
        assert launcher.poll() is None and _training(run_dir)  # the run goes on, covered again
        launcher.kill()
        launcher.wait()
        _lock_free_only_once_all_are_gone(run_dir, token, 120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _alive(token):
            os.kill(pid, signal.SIGKILL)


def test_agents_die_with_the_launcher_when_the_watchdog_cannot_act(data, tmp_path):
    """The watchdog is stopped (alive, so not replaced, but useless): SIGKILL the launcher, and
    the kernel's death signal alone stops the agents, which stop their workers."""
    token, run_dir, out = uuid.uuid4().hex, tmp_path / "run", tmp_path / "launcher.log"
    launcher = _launch_logged(run_dir, data, token, out)
    stopped = None
    try:
        _wait_until(lambda: _training(run_dir), 180, "the first training step")
        (stopped,) = _watchdogs(token)
        os.kill(stopped, signal.SIGSTOP)
        assert len(_alive(token)) >= 4  # launcher, watchdog, 2 agents (and their workers)
        starts = _starts(run_dir)
        launcher.kill()
        launcher.wait()
        _wait_until(lambda: _alive(token) == [stopped], 120,
                    "every agent and worker to stop without the watchdog")
        # Stopped, not restarted: without the death signal the workers die of their broken
        # output pipe and the agents start new ones (what the issue saw) before giving up.
        assert _starts(run_dir) == starts
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
        for pid in _alive(token):
            os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(d.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _relaunch_until_it_trains(run_dir: Path, data: Path, token: str, out: Path,
                              agents: list[int]) -> subprocess.Popen:
    """launch-local again into ``run_dir``: it trains, or it is refused naming a live agent.

    A refusal must name one of ``agents`` (still stopping) as the holder, never only the dead
    launcher; once they are gone the next try must train.
    """
    while True:
        second = _launch_logged(run_dir, data, token, out)
        _wait_until(lambda s=second: s.poll() is not None or "[trainer]" in out.read_text(),
                    240, "the relaunch to train or be refused")
        if second.poll() is None:
            return second
        text = out.read_text()
        assert second.returncode == 2 and "is gone, but pid " in text, text[-3000:]
        named = [p for p in agents if f"pid {p} (an ft_launcher agent)" in text]
        assert named, text
        _wait_until(lambda n=named: all(_dead(p) for p in n), 120, "the named agents to stop")


@pytest.mark.parametrize("agents_too", [True, False], ids=["with-agents", "launcher-watchdog"])
def test_a_relaunch_right_after_sigkill_of_the_launch_tree(agents_too, data, tmp_path):
    """Issue 30 item 16: SIGKILL launcher and watchdog (and the agents), relaunch at once.

    The relaunch trains, or is refused naming a live holder; it never waits minutes on a
    rank-monitor server (an orphan) holding the lock, nor names the dead launcher as holder. What
    the dead run left running is stopped before the new one starts.
    """
    first, run_dir = uuid.uuid4().hex, tmp_path / "run"
    launcher = _launch_logged(run_dir, data, first, tmp_path / "first.log")
    second = None
    try:
        _wait_until(lambda: _training(run_dir), 180, "the first training step")
        (watchdog,) = _watchdogs(first)
        agents = [p for p in _children(launcher.pid) if p != watchdog]
        assert len(agents) == 2
        victims = [launcher.pid, watchdog, *(agents if agents_too else [])]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        launcher.wait()
        _wait_until(lambda: all(_dead(p) for p in victims), 30, "the SIGKILLs")
        token = uuid.uuid4().hex
        second = _relaunch_until_it_trains(run_dir, data, token, tmp_path / "second.log", agents)
        assert _alive(first) == [], "the dead run's processes outlived the relaunch's start"
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=180)
        _lock_free_only_once_all_are_gone(run_dir, token, 120)
    finally:
        for proc in (launcher, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
        for pid in _alive(first):
            os.kill(pid, signal.SIGKILL)


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
