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

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.prepare_dataset.prepare import prepare_dataset
from kfp_nvrx.components.train_fsdp.launcher.lifetime import LOCK_FILE, RunDirLock, Watchdog

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


# -- the lock ------------------------------------------------------------------------------------

def test_second_holder_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    first = RunDirLock(tmp_path).acquire()
    with pytest.raises(UserError) as err:
        RunDirLock(tmp_path).acquire()
    assert err.value.field == "--run-dir" and f"pid {os.getpid()}" in err.value.message
    first.release()
    RunDirLock(tmp_path).acquire().release()


def test_a_lock_left_by_a_killed_run_is_taken(tmp_path: Path) -> None:
    code = ("import sys, time; from kfp_nvrx.components.train_fsdp.launcher.lifetime import "
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
from kfp_nvrx.components.train_fsdp.launcher.lifetime import RunDirLock, Watchdog
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


# -- launch-local, end to end ----------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "ds"
    prepare_dataset("sample:200", out, seq_len=64)
    return out


def _launch(run_dir: Path, data: Path, token: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kfp_nvrx.pipelines.cli", "launch-local", "--run-dir",
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
            [sys.executable, "-m", "kfp_nvrx.pipelines.cli", "launch-local", "--run-dir",
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


def test_agent_stream_shows_what_matters_and_logs_everything(tmp_path):
    """Non-verbose: NVRx chatter and a survivor's peer-reset traceback are hidden, not lost."""
    from kfp_nvrx.components.train_fsdp.launcher.local import _Agent

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
    agent = _Agent(0, [sys.executable, "-c", script, *lines], dict(os.environ), shown.append,
                   False, tmp_path / "node0.log")
    agent.proc.wait()
    agent.thread.join(10)
    assert shown == ["[node0] [trainer] step 10/40 loss 4.3",
                     "[node0] [ERROR] [ft_launcher1@vm] failed (exitcode: -9) local_rank: 0",
                     "[node0] [rank1]: Traceback (most recent call last):",
                     "[node0] [rank1]: ValueError: a real error"]
    assert (tmp_path / "node0.log").read_text().splitlines() == lines
