"""Writer-process tracking in checkpoint_files: killing and reaping NVRx's writer process."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

from kfp_nvrx.components.train_fsdp.trainer import checkpoint_files
from kfp_nvrx.components.train_fsdp.trainer.checkpoint_files import _track, kill_writers


def _writer_with_forked_child(pid_file: str) -> None:
    """Like NVRx's persistent writer: a spawned process that forks a (long) write process."""
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    Path(pid_file).write_text(str(child))
    time.sleep(600)


def _gone(pid: int, within: float) -> bool:
    """Exited (a zombie only until whoever inherited the orphan reaps it); SIGKILL takes a moment."""
    deadline = time.monotonic() + within
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def test_kill_writers_reaps_a_writer_whose_child_holds_its_sentinel(tmp_path):
    pid_file = tmp_path / "child.pid"
    proc = mp.get_context("spawn").Process(target=_writer_with_forked_child, args=(str(pid_file),))
    proc.start()
    child_pid = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.is_file() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the writer never forked its child"
            time.sleep(0.05)
        child_pid = int(pid_file.read_text())
        _track(SimpleNamespace(process=proc))
        assert proc in checkpoint_files._WRITERS

        start = time.monotonic()
        kill_writers()
        elapsed = time.monotonic() - start

        # The forked child keeps the sentinel open: join() would have waited its full 10 s.
        assert elapsed < 5, f"kill_writers took {elapsed:.1f} s"
        assert proc.exitcode is not None and proc not in checkpoint_files._WRITERS
        assert _gone(child_pid, within=5), "the writer's forked child is still running"
    finally:
        if proc in checkpoint_files._WRITERS:
            checkpoint_files._WRITERS.remove(proc)
        if proc.exitcode is None:
            proc.kill()
        for pid in (child_pid,) if child_pid else ():
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def test_priming_the_results_queue_leaves_its_items_alone():
    """The warm-up probe must never take or add a result, even if the writer's came first."""
    import multiprocessing as mp

    from kfp_nvrx.components.train_fsdp.trainer.checkpoint_nvrx import _prime_results_queue

    manager = mp.get_context("spawn").Manager()
    try:
        queue = manager.Queue()
        queue.put({0: ["a write result"]})
        _prime_results_queue(queue)
        assert queue.qsize() == 1 and queue.get() == {0: ["a write result"]}
        _prime_results_queue(queue)
        assert queue.qsize() == 0
    finally:
        manager.shutdown()
