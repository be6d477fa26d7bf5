"""Issue 38 item 4: nothing a run creates in /dev/shm outlives the run or its watchdog.

A SIGKILLed ``multiprocessing`` user (and its ``resource_tracker``, which ignores SIGTERM and is
SIGKILLed after the grace) leaves its semaphores as ``/dev/shm/sem.mp-*``; a SIGKILLed launcher
left the run's host copy until the next worker start on the node. Real semaphores, real
processes, the real watchdog.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import uuid
from pathlib import Path

from support.lifetime_procs import TAG, gone_and_unlocked

from kfp_nvrx.components.core.host_copy import SHM_ROOT, host_copy_dir
from kfp_nvrx.components.core.shm_leftovers import (
    SEM_PREFIX,
    remove_new_semaphores,
    semaphores,
    snapshot,
)

#: A process that makes real multiprocessing semaphores (spawn: they stay named), says so, waits.
MAKE_SEMAPHORES = ("import multiprocessing as mp, sys, time\n"
                   "if __name__ == '__main__':\n"
                   "    ctx = mp.get_context('spawn')\n"
                   "    keep = [ctx.Lock(), ctx.Semaphore(2), ctx.Event()]\n"
                   "    print('made', flush=True)\n"
                   "    time.sleep(600)\n")


def _made(env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", MAKE_SEMAPHORES], stdout=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    assert proc.stdout.readline().strip() == "made"
    return proc


def test_a_sigkilled_processes_semaphores_are_removed_and_nobody_elses(tmp_path) -> None:
    before = semaphores()
    survivor = _made()  # alive: its semaphores are mapped and must stay
    victim = _made()
    try:
        theirs = semaphores() - before
        os.killpg(victim.pid, 9)
        victim.wait()
        leaked = semaphores() - before
        assert leaked >= theirs and len(leaked) >= 6, leaked  # the victim's stayed behind
        removed = set(remove_new_semaphores(before))
        left = semaphores() - before
        assert removed and left and removed.isdisjoint(left)
        assert all(n.startswith(SEM_PREFIX) for n in removed)
        assert before <= semaphores()  # what was there before the run is untouched
    finally:
        os.killpg(survivor.pid, 9)
        survivor.wait()
    remove_new_semaphores(before)
    assert semaphores() - before == set()


def test_an_unmapped_new_name_goes_a_mapped_one_stays(tmp_path) -> None:
    root = tmp_path / "shm"
    root.mkdir()
    (root / f"{SEM_PREFIX}old").write_bytes(b"\0" * 32)
    before = semaphores(root)
    for name in ("new", "inuse"):
        (root / f"{SEM_PREFIX}{name}").write_bytes(b"\0" * 32)
    (root / "other-file").write_bytes(b"x")
    with open(root / f"{SEM_PREFIX}inuse", "r+b") as fh, mmap.mmap(fh.fileno(), 32):
        assert remove_new_semaphores(before, root) == [f"{SEM_PREFIX}new"]
    assert sorted(os.listdir(root)) == ["other-file", f"{SEM_PREFIX}inuse", f"{SEM_PREFIX}old"]


def test_the_watchdog_of_a_sigkilled_launcher_removes_its_host_copy_and_semaphores(
        tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    before = semaphores()
    shot = tmp_path / "shm-before.json"
    snapshot(shot)
    # A "launcher": lock, watchdog with the sweep, a host copy of its run, and a marked child
    # that makes semaphores; then it is SIGKILLed.
    code = f"""
import os, subprocess, sys, time
from kfp_nvrx.components.core.host_copy import host_copy_base, host_copy_dir, private_dir
from kfp_nvrx.components.launch.local.lifetime import RunDirLock, Watchdog
lock = RunDirLock(sys.argv[1]).acquire()
wd = Watchdog("{TAG}={token}", grace=1.0, keep_fds=(lock.fd,), sweep=(sys.argv[1], sys.argv[2]))
private_dir(host_copy_base()); private_dir(host_copy_dir(sys.argv[1]))
open(os.path.join(host_copy_dir(sys.argv[1]), "rank0.bank0"), "wb").write(b"x" * 4096)
child = subprocess.Popen([sys.executable, "-c", {MAKE_SEMAPHORES!r}],
    env={{**os.environ, "{TAG}": "{token}"}}, stdout=subprocess.PIPE, text=True,
    start_new_session=True)
child.stdout.readline()
print("ready", flush=True)
time.sleep(600)
"""
    launcher = subprocess.Popen([sys.executable, "-c", code, str(run_dir), str(shot)],
                                stdout=subprocess.PIPE, text=True)
    assert launcher.stdout.readline().strip() == "ready"
    assert host_copy_dir(run_dir).is_dir() and semaphores() - before
    launcher.kill()
    launcher.wait()
    gone_and_unlocked(token, run_dir, 30)  # the watchdog releases the lock last
    assert not host_copy_dir(run_dir).exists()
    assert semaphores() - before == set(), sorted(semaphores() - before)
    assert json.loads(shot.read_text()) == sorted(before)
    assert SHM_ROOT.is_dir()


def test_a_lock_record_names_a_stop_folder_only_of_ours(tmp_path: Path) -> None:
    """The next launch removes the folder a dead run's lock record names (issue 38 item 4); the
    record is in the run dir, which others may write: a folder elsewhere, a link, another host's
    or another name is no stop folder, and nothing in it is touched."""
    import socket
    import tempfile

    from kfp_nvrx.components.launch.local.shm_sweep import (
        SNAPSHOT_FILE,
        STOPS_PREFIX,
        stops_folder,
        sweep_previous,
    )

    host = socket.gethostname()
    real = Path(tempfile.mkdtemp(prefix=STOPS_PREFIX))
    link = Path(tempfile.gettempdir()) / f"{STOPS_PREFIX}link-{uuid.uuid4().hex}"
    elsewhere = tmp_path / f"{STOPS_PREFIX}x"
    other_name = Path(tempfile.mkdtemp(prefix="kfp-nvrx-other-"))
    for d in (elsewhere, other_name):
        d.mkdir(exist_ok=True)
        (d / "keep").write_text("x")
    link.symlink_to(elsewhere)
    try:
        for path in (elsewhere, link, other_name):
            assert stops_folder({"stops": str(path), "host": host}) is None
            assert sweep_previous({"stops": str(path), "host": host}, tmp_path / "run") == ""
        assert stops_folder({"stops": str(real), "host": "another-host"}) is None
        assert (elsewhere / "keep").exists() and (other_name / "keep").exists()
        snapshot(real / SNAPSHOT_FILE)
        assert stops_folder({"stops": str(real), "host": host}) == real
        sweep_previous({"stops": str(real), "host": host}, tmp_path / "run")
        assert not real.exists()
    finally:
        link.unlink()
        for d in (real, other_name):
            if d.exists():
                import shutil

                shutil.rmtree(d)
