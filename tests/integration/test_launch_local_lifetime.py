"""No process outlives launch-local, end to end (two CPU nodes, real agents and workers).

Readiness is observed, never slept for: the tests wait until ``events.jsonl`` shows a training
step (so agents and workers exist) before they signal the launcher, and then wait (with a generous
deadline) until no process carrying the test's environment marker is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from support.lifetime_procs import (
    TAG,
    alive,
    dead,
    gone_and_unlocked,
    lock_free_only_once_all_are_gone,
    wait_until,
)

from kfp_nvrx.components.data.prepare import prepare_dataset


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
        wait_until(lambda: _training(run_dir), 180, "the first training step")
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
        gone_and_unlocked(token, run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in alive(token):
            os.kill(pid, signal.SIGKILL)


def _starts(run_dir: Path) -> int:
    """How many worker incarnations the run started (``start`` events)."""
    return (run_dir / "events.jsonl").read_text().count('"type":"start"')


def _watchdogs(token: str) -> list[int]:
    """The run's watchdog processes (they carry the test's tag, and their script)."""
    found = []
    for pid in alive(token):
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
        wait_until(lambda: _training(run_dir), 180, "the first training step")
        (first,) = _watchdogs(token)
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: [p for p in _watchdogs(token) if p != first], 60,
                    "the launcher to start a new watchdog")
        wait_until(lambda: f"the watchdog (pid {first}) died (signal 9)" in out.read_text(), 30,
                    "the launcher to say so")
        assert launcher.poll() is None and _training(run_dir)  # the run goes on, covered again
        launcher.kill()
        launcher.wait()
        lock_free_only_once_all_are_gone(run_dir, token, 120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in alive(token):
            os.kill(pid, signal.SIGKILL)


def test_agents_die_with_the_launcher_when_the_watchdog_cannot_act(data, tmp_path):
    """The watchdog is stopped (alive, so not replaced, but useless): SIGKILL the launcher, and
    the kernel's death signal alone stops the agents, which stop their workers."""
    token, run_dir, out = uuid.uuid4().hex, tmp_path / "run", tmp_path / "launcher.log"
    launcher = _launch_logged(run_dir, data, token, out)
    stopped = None
    try:
        wait_until(lambda: _training(run_dir), 180, "the first training step")
        (stopped,) = _watchdogs(token)
        os.kill(stopped, signal.SIGSTOP)
        assert len(alive(token)) >= 4  # launcher, watchdog, 2 agents (and their workers)
        starts = _starts(run_dir)
        launcher.kill()
        launcher.wait()
        wait_until(lambda: alive(token) == [stopped], 120,
                    "every agent and worker to stop without the watchdog")
        # Stopped, not restarted: without the death signal the workers die of their broken
        # output pipe and the agents start new ones (what the issue saw) before giving up.
        assert _starts(run_dir) == starts
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
        for pid in alive(token):
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
        wait_until(lambda s=second: s.poll() is not None or "[trainer]" in out.read_text(),
                    240, "the relaunch to train or be refused")
        if second.poll() is None:
            return second
        text = out.read_text()
        assert second.returncode == 2 and "is gone, but pid " in text, text[-3000:]
        named = [p for p in agents if f"pid {p} (an ft_launcher agent)" in text]
        assert named, text
        wait_until(lambda n=named: all(dead(p) for p in n), 120, "the named agents to stop")


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
        wait_until(lambda: _training(run_dir), 180, "the first training step")
        (watchdog,) = _watchdogs(first)
        agents = [p for p in _children(launcher.pid) if p != watchdog]
        assert len(agents) == 2
        victims = [launcher.pid, watchdog, *(agents if agents_too else [])]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        launcher.wait()
        wait_until(lambda: all(dead(p) for p in victims), 30, "the SIGKILLs")
        token = uuid.uuid4().hex
        second = _relaunch_until_it_trains(run_dir, data, token, tmp_path / "second.log", agents)
        assert alive(first) == [], "the dead run's processes outlived the relaunch's start"
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=180)
        lock_free_only_once_all_are_gone(run_dir, token, 120)
    finally:
        for proc in (launcher, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
        for pid in alive(first):
            os.kill(pid, signal.SIGKILL)
