"""A commit's file work off the training loop: ``.metadata``, the commit marker, progress, pruning.

Rank 0 writes them once every rank's write finished and the write results were gathered (both
collective, on the loop). Written inline they made the commit step the slowest step of a run (the
fsyncs; ``bench.ckpt_stall``, figures in docs/benchmarks/NOTES.md). On a thread they overlap the
next steps; the loop learns that the marker is on disk from one small all-reduce per step
(:func:`min_over_ranks`), so no rank treats the save as committed before the marker exists.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kfp_nvrx.components.core.ckpt_store import CheckpointStore
from kfp_nvrx.components.training.checkpoint.async_save import Gather
from kfp_nvrx.components.training.checkpoint.writer import CheckpointError
from kfp_nvrx.components.training.ranks import min_over_ranks

RUNNING, DONE, FAILED = 0, 1, -1


class CommitJob:
    """Runs ``steps`` in order on a daemon thread; the last one's return value is :attr:`result`.

    With no steps (ranks other than 0) the job is done at once.
    """

    def __init__(self, steps: list[Callable[[], Any]]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if steps:
            self._thread = threading.Thread(target=self._run, args=(steps,), daemon=True,
                                            name="ckpt-commit")
            self._thread.start()

    def _run(self, steps: list[Callable[[], Any]]) -> None:
        try:
            for step in steps:
                self.result = step()
        except BaseException as err:  # noqa: BLE001 - reported to every rank by state()
            self.error = err

    def state(self) -> int:
        """RUNNING, DONE or FAILED."""
        if self._thread is not None and self._thread.is_alive():
            return RUNNING
        return FAILED if self.error is not None else DONE

    def join(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for the thread."""
        if self._thread is not None:
            self._thread.join(timeout)


def write_commit(store: CheckpointStore, step: int, world_size: int, keep: int) -> int:
    """Rank 0, after ``.metadata``: the commit marker, the progress file, pruning; returns bytes."""
    nbytes = store.commit(step, world_size)
    # FT: ft_launcher's progress tracking reads the newest committed step from here.
    store.record_progress(step)
    store.prune(keep)
    return nbytes


@dataclass
class InFlight:
    """The save being written (one at a time) and how far its commit got."""

    step: int
    path: str  # the step's location in the store (where DCP writes it)
    started: float
    blocking_s: float
    finalize_fns: list[Gather]
    local_done: bool = False
    commit: CommitJob | None = None  # rank 0's file work, once every rank's write is done
    loop_s: float = 0.0  # seconds the commit held the loop


def advance(inf: InFlight, poll_local: Callable[[float], int], files: Callable[[], int] | None,
            device: torch.device, blocking: bool, timeout: float) -> bool:
    """Moves ``inf``'s commit on; True once it is committed on every rank (collective).

    Args:
        inf: The save in flight.
        poll_local: 1 when this rank's write is done (waiting at most the given seconds), 0
            while it runs, -1 when its writer died.
        files: Rank 0's marker/progress/pruning step (None on other ranks), run after the
            coordinator's ``.metadata`` write on the commit thread.
        device: The training device (the flags are reduced there).
        blocking: Wait (up to ``timeout`` seconds) instead of returning False.
        timeout: ``checkpoint.finalize_timeout``.

    Raises:
        CheckpointError: A write or the commit failed, or ``timeout`` passed while blocking.
    """
    deadline = time.monotonic() + timeout

    def check_deadline() -> None:
        if time.monotonic() >= deadline:
            raise CheckpointError(f"checkpoint step {inf.step} not written within "
                                  f"checkpoint.finalize_timeout={timeout:g}s")

    while not _all_written(inf, poll_local, files, device, blocking):
        if not blocking:
            return False
        check_deadline()
    job = inf.commit
    assert job is not None  # _all_written started it
    while True:
        t0 = time.perf_counter()
        state = min_over_ranks(job.state(), device)
        inf.loop_s += time.perf_counter() - t0
        if state == DONE:
            return True
        if state == FAILED:
            raise CheckpointError(f"checkpoint step {inf.step} commit failed: "
                                  f"{job.error or 'on rank 0'}")
        if not blocking:
            return False
        job.join(0.01)
        check_deadline()


def _all_written(inf: InFlight, poll_local: Callable[[float], int],
                 files: Callable[[], int] | None, device: torch.device, blocking: bool) -> bool:
    """Whether every rank's write is done; the first time, starts the commit's file work."""
    if inf.commit is not None:
        return True
    code = min_over_ranks(poll_local(0.05 if blocking else 0.0), device)
    if code < 0:  # told to every rank in the same collective: none is left waiting in one
        raise CheckpointError(f"checkpoint step {inf.step}: a rank's NVRx writer process "
                              "died before its write was complete")
    if not code:
        return False
    t0 = time.perf_counter()
    finish = [f for f in (fn() for fn in inf.finalize_fns) if f is not None]
    inf.commit = CommitJob([*finish, files] if files is not None else finish)
    inf.loop_s += time.perf_counter() - t0
    return True
