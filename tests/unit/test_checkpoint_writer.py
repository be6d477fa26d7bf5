"""The NVRx writer object's process tracking: killing and reaping NVRx's writer process."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from kfp_nvrx.components.training.checkpoint import NvrxWriter


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


def test_kill_reaps_a_writer_whose_child_holds_its_sentinel(tmp_path):
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
        writer = NvrxWriter(torch.device("cpu"))
        writer.track(proc)
        assert writer.processes == (proc,)

        start = time.monotonic()
        writer.kill()
        elapsed = time.monotonic() - start

        # The forked child keeps the sentinel open: join() would have waited its full 10 s.
        assert elapsed < 5, f"kill took {elapsed:.1f} s"
        assert proc.exitcode is not None and writer.processes == ()
        assert _gone(child_pid, within=5), "the writer's forked child is still running"
    finally:
        if proc.exitcode is None:
            proc.kill()
        for pid in (child_pid,) if child_pid else ():
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def test_abort_kills_the_writer_and_dropping_it_does_not_hang(one_rank_env):
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        _abort_and_restart()
    finally:
        dist.destroy_process_group()


def _abort_and_restart() -> None:
    writer = NvrxWriter(torch.device("cpu"))
    writer.warm_up()
    writer.wait_started(timeout=120)
    (proc,) = writer.processes
    assert proc.is_alive()
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    writer.schedule(AsyncRequest(time.sleep, (600,), []))  # a write that will not finish

    # NVRx's close() (run by its __del__) would wait for that write: it must not run.
    dropped = threading.Thread(target=writer.abort, daemon=True)
    dropped.start()
    dropped.join(30)
    assert not dropped.is_alive(), "abort() hung"
    gc.collect()
    assert not writer.started and writer.processes == () and proc.exitcode is not None

    # The next save's request starts a new process (it maps the staging banks by path itself).
    writer.warm_up()
    writer.wait_started(timeout=120)
    assert writer.processes != (proc,)
    writer.close()
    assert writer.processes == ()


def test_priming_the_results_queue_leaves_its_items_alone():
    """The warm-up probe must never take or add a result, even if the writer's came first."""
    import multiprocessing as mp

    from kfp_nvrx.components.training.checkpoint.writer import _prime_results_queue

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
