"""The commit's two phases: rank 0's file work runs off the loop, and no rank counts the save
committed before that work is done; a failure there reaches every rank as a CheckpointError."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from kfp_nvrx.components.training.checkpoint.commit import InFlight, advance
from kfp_nvrx.components.training.checkpoint.writer import CheckpointError

CPU = torch.device("cpu")


@pytest.fixture()
def pg(one_rank_env):
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _inflight(tmp_path, gathered: list[str]) -> InFlight:
    def gather():  # the collective part: runs on the loop, returns the coordinator's file work
        gathered.append(threading.current_thread().name)
        return lambda: gathered.append("metadata:" + threading.current_thread().name)

    return InFlight(step=7, path=tmp_path, started=time.perf_counter(), blocking_s=0.0,
                    finalize_fns=[gather])


def test_marker_work_runs_on_a_thread_and_the_save_commits_only_after_it(pg, tmp_path):
    gathered: list[str] = []
    inf = _inflight(tmp_path, gathered)
    release = threading.Event()
    written: list[str] = []

    def files() -> int:
        release.wait(30)
        written.append(threading.current_thread().name)
        return 123

    writes_done = [False]
    poll = lambda wait: writes_done[0]  # noqa: E731 - this rank's write, as the writer reports it
    assert not advance(inf, poll, files, CPU, blocking=False, timeout=30)
    assert inf.commit is None  # the write is not done: nothing gathered yet
    writes_done[0] = True
    assert not advance(inf, poll, files, CPU, blocking=False, timeout=30)  # marker still pending
    assert gathered[0] == threading.current_thread().name  # gathered on the loop
    assert not advance(inf, poll, files, CPU, blocking=False, timeout=30)
    release.set()
    assert advance(inf, poll, files, CPU, blocking=True, timeout=30)
    assert written == ["ckpt-commit"]
    assert gathered[1] == "metadata:ckpt-commit"  # .metadata before the marker, same thread
    assert inf.commit.result == 123


def test_a_failed_commit_raises_on_the_loop(pg, tmp_path):
    inf = _inflight(tmp_path, [])

    def files() -> int:
        raise OSError("No space left on device")

    with pytest.raises(CheckpointError, match="step 7 commit failed: No space left"):
        advance(inf, lambda wait: True, files, CPU, blocking=True, timeout=30)


def test_a_blocking_commit_gives_up_after_the_timeout(pg, tmp_path):
    inf = _inflight(tmp_path, [])
    stop = threading.Event()
    try:
        with pytest.raises(CheckpointError, match="finalize_timeout=0.2s"):
            advance(inf, lambda wait: True, lambda: stop.wait(30), CPU, blocking=True, timeout=0.2)
    finally:
        stop.set()
