"""Issue 38 item 4: a run whose launcher and watchdog were both SIGKILLed leaves nothing for good.

Neither could sweep: the run's host copy in /dev/shm, the ``sem.mp-*`` semaphores its killed
processes leaked and the launcher's stop folder in /tmp (with the /dev/shm snapshot of the run's
start) stayed; the next launch of the run dir stopped the dead run's processes but left those
(its own snapshot counted the leaked names as someone else's). It removes them now, end to end:
two CPU nodes, real agents and workers, observed (never slept for).
"""

from __future__ import annotations

import os
import signal
import tempfile
import uuid
from pathlib import Path

import pytest
from support.lifetime_procs import alive, dead, gone, lock_free_only_once_all_are_gone, wait_until

from kfp_nvrx.components.core.host_copy import host_copy_dir
from kfp_nvrx.components.core.shm_leftovers import mapped, semaphores
from kfp_nvrx.components.data.prepare import prepare_dataset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "ds"
    prepare_dataset("sample:200", out, seq_len=64)
    return out


def _stop_folder(agents: list[int]) -> Path:
    """The launcher's stop folder, as its agents were told (each node's stop request file)."""
    from kfp_nvrx.components.core.stop_request import STOP_FILE_ENV

    key = f"{STOP_FILE_ENV}=".encode()
    found = set()
    for pid in agents:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(key):
                found.add(Path(item[len(key):].decode()).parent)
    (folder,) = found
    assert folder.parent == Path(tempfile.gettempdir()), folder
    return folder


def _leaked(names: set[str]) -> set[str]:
    """Those of ``names`` still in /dev/shm that no live process maps: nobody's any more."""
    in_use = mapped()
    out = set()
    for name in names & semaphores():
        try:
            if os.lstat(f"/dev/shm/{name}").st_ino not in in_use:
                out.add(name)
        except OSError:
            continue
    return out


@pytest.mark.parametrize("agents_too", [False, True], ids=["launcher-watchdog", "with-agents"])
def test_the_next_launch_removes_what_a_run_killed_whole_left(agents_too: bool, data: Path,
                                                               tmp_path: Path) -> None:
    """SIGKILL the launcher and its watchdog (the agents get the kernel's SIGTERM and stop their
    workers), or the agents too (their workers, in sessions of their own, run on until the next
    launch stops them: SIGKILLed with their resource trackers, they leak their semaphores)."""
    from integration.test_launch_local_lifetime import _children, _launch_logged, _training, _watchdogs

    first, run_dir = uuid.uuid4().hex, tmp_path / "run"
    sems_before = semaphores()
    launcher = _launch_logged(run_dir, data, first, tmp_path / "first.log")
    second = None
    try:
        wait_until(lambda: _training(run_dir) and host_copy_dir(run_dir).is_dir(), 240,
                   "the first training step and the host copy")
        (watchdog,) = _watchdogs(first)
        agents = [p for p in _children(launcher.pid) if p != watchdog]
        assert len(agents) == 2
        folders = [_stop_folder(agents)]
        victims = [launcher.pid, watchdog, *(agents if agents_too else [])]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        launcher.wait()
        wait_until(lambda: all(dead(p) for p in victims), 30, "the SIGKILLs")
        if not agents_too:
            gone(first, 180)  # the agents stop their workers (the kernel's SIGTERM), then exit
        # What the run killed whole left (and its orphans, still running, hold): nobody removes
        # it; the relaunch stops the orphans first.
        leaked = semaphores() - sems_before if agents_too else _leaked(semaphores() - sems_before)
        assert host_copy_dir(run_dir).is_dir() and all(f.is_dir() for f in folders)
        print(f"left by the run killed whole: its host copy, {len(leaked)} semaphore(s) (of "
              f"orphans: {agents_too}), {len(folders)} stop folder(s)")

        token = uuid.uuid4().hex
        out = tmp_path / "second.log"
        second = _launch_logged(run_dir, data, token, out)
        wait_until(lambda: "[trainer]" in out.read_text() or second.poll() is not None, 240,
                   "the relaunch to train")
        assert second.poll() is None, out.read_text()[-3000:]
        # At the relaunch's start, before its own run made anything of the kind.
        assert not any(f.exists() for f in folders), folders
        assert not _leaked(leaked), sorted(_leaked(leaked))
        said = [line for line in out.read_text().splitlines() if "left in /dev/shm" in line]
        assert said and "its host copy" in said[0], said
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=180)
        lock_free_only_once_all_are_gone(run_dir, token, 120)
        assert not host_copy_dir(run_dir).exists()
    finally:
        for proc in (launcher, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
        for pid in alive(first):
            os.kill(pid, signal.SIGKILL)
