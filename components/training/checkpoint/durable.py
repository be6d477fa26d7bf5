"""The durable tier's writes: one in flight, always the newest snapshot the store does not hold.

A write reads a complete snapshot from its staging bank (:mod:`.staging`) in NVRx's persistent
writer process (:class:`~.writer.NvrxWriter`), so it never needs the GPU or the training state:
it starts from the loop's per-step :meth:`DurableWrites.tick`, paced by :class:`.snapshots.Pace`,
and is committed there once every rank's write finished (:func:`.commit.advance`). Nothing here
waits for the store on a training step; only :meth:`DurableWrites.drain` (the run's end, the
final step) and the paths without banks (``checkpoint.staging=nvrx``, synchronous saves) wait.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kfp_nvrx.components.core.ckpt_store import CheckpointStore
from kfp_nvrx.components.core.config import CheckpointConfig
from kfp_nvrx.components.core.faults import take_write_delay
from kfp_nvrx.components.training.checkpoint import dcp_io
from kfp_nvrx.components.training.checkpoint.async_save import AsyncSaver, Seal
from kfp_nvrx.components.training.checkpoint.commit import InFlight, advance, write_commit
from kfp_nvrx.components.training.checkpoint.snapshots import Pace
from kfp_nvrx.components.training.checkpoint.staging import HostStaging
from kfp_nvrx.components.training.checkpoint.writer import CheckpointError, NvrxWriter
from kfp_nvrx.components.training.ranks import all_ranks


@dataclass
class Kept:
    """What a worker process's checkpointing keeps across its in-process restarts.

    None is made by the next :class:`Checkpointer`, which holds the ones it used.

    Attributes:
        staging: The host staging banks, which an in-process restart restores from.
        writer: NVRx's writer; its processes, killed on an abort, are reaped by a later incarnation.
    """

    staging: HostStaging | None = None
    writer: NvrxWriter | None = None


@dataclass(frozen=True)
class Reports:
    """Where a :class:`Checkpointer` tells what happened (and learns of a stop).

    Attributes:
        on_commit: Called on rank 0 with (step, blocking_s, total_s, bytes) after each durable
            commit (``blocking_s``: every second the write held the loop).
        on_snapshot: Called on rank 0 with (step, stall_s, skipped) after each snapshot
            (``stall_s``: every second it held the loop; ``skipped``: why none was taken).
        log: Where one-line notices go (e.g. falling back to NVRx staging).
        stopping: Whether this node was asked to stop (a write its SIGTERM cut is no failure:
            the stop saves its step).
        on_replica: Called on rank 0 with (step, seconds, bytes sent per rank, ok, loop seconds)
            after each round of copies to peer nodes (loop seconds: what its collectives held
            the training loop).
    """

    on_commit: Callable[[int, float, float, int], None] | None = None
    on_snapshot: Callable[[int, float, str], None] | None = None
    log: Callable[[str], None] = print
    stopping: Callable[[], bool] = lambda: False
    on_replica: Callable[[int, float, int, bool, float], None] | None = None


class DurableWrites:
    """Writes snapshots to the run's store, one at a time, and commits them (collective).

    Args:
        store: The run's checkpoint store.
        cfg: The ``checkpoint`` config section.
        device: The training device (the flags are reduced there).
        kept: The banks the snapshots are in (None: every write is unstaged) and the writer.
        pace: The snapshot and write pace this incarnation shares with its Checkpointer.
        reports: Where commits and notices go, and whether a stop was asked for.
    """

    def __init__(self, store: CheckpointStore, cfg: CheckpointConfig, device: torch.device,
                 kept: Kept, pace: Pace, reports: Reports) -> None:
        assert kept.writer is not None
        self.store, self.cfg, self.device, self.pace = store, cfg, device, pace
        self.staging: HostStaging | None = kept.staging
        self.writer: NvrxWriter = kept.writer
        self.on_commit, self.log, self.stopping = reports.on_commit, reports.log, reports.stopping
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.saver = AsyncSaver(self.writer, device, self.rank, cfg.write_threads,
                                start_timeout=cfg.finalize_timeout)
        self.inflight: InFlight | None = None
        self.started = 0  # writes started by this incarnation
        self.commits = 0  # writes committed by this incarnation
        self.commit_s: list[float] = []  # seconds each write held the training loop
        self.write_s: list[float] = []  # seconds from each write's start to its commit
        self.last_commit_step = -1

    def without_banks(self) -> None:
        """The banks are gone (unavailable on some rank): every write is NVRx-staged from now."""
        self.staging = None

    # ---------------------------------------------------------------- starting a write
    def start(self, force: bool) -> bool:
        """Starts writing the newest snapshot when every rank agrees (collective).

        Called with no write in flight. Unless ``force`` (the run's end, a final step), it waits
        for the pace (:meth:`.Pace.write_due`) and for every rank's writer process to be up,
        and so may start in a later call; ``force`` waits for both copies and writer here.
        """
        staging, pace = self.staging, self.pace
        if self.inflight is not None or staging is None or not pace.unwritten():
            return False
        if force:
            staging.synchronize()
            self.writer.warm_up()
            self.writer.wait_started(self.cfg.finalize_timeout)
        else:
            staging.settle()  # the snapshot's copies: complete once the optimizer step waited
        bank = staging._holding(pace.newest)
        # Not the only ready bank (the first seconds, while the others pin): a write holds it
        # for tens of seconds, and snapshots would be skipped all that time.
        mine = bank is not None and (force or (pace.write_due() and staging.can_lend(bank)
                                               and self.writer.up()))
        if not all_ranks(mine, self.device):
            return False
        assert bank is not None and pace.plan_state is not None
        t0 = time.perf_counter()
        step = pace.newest
        path = self.begin(step)
        staging.lend(bank)  # never staged into while the writer reads it
        # take_write_delay: the seconds a slow-write fault slows this write by (0: none)
        finish = self.saver.staged(path, pace.plan_state, staging, bank, self._sealer(step),
                                   take_write_delay())
        pace.started_write()
        self.started += 1
        self.inflight = InFlight(step, path, t0, time.perf_counter() - t0, [finish])
        return True

    def begin(self, step: int) -> str:
        """The step's place in the store, emptied by rank 0 (collective); its spool folder.

        An asynchronous write puts its files in the spool (:meth:`.CheckpointStore.spool`); the
        store takes them from there (:meth:`_sealer`, :meth:`.CheckpointStore.commit`).
        """
        if self.rank == 0:
            self.store.begin(step)  # a torn leftover goes; never through a symlink
        dist.barrier()
        return self.store.spool(step)

    def _sealer(self, step: int) -> Seal:
        """What the writer process calls with this rank's files of ``step`` once written."""
        return functools.partial(self.store.seal_files, step, self.rank)

    def unstaged(self, step: int, state: dict[str, Any], sync: bool) -> None:
        """Writes ``state`` as ``step`` without the banks: ``dcp.save`` here, or NVRx staging.

        Waits for the write in flight first (there is no bank to hold a second snapshot).
        ``sync`` commits before it returns.
        """
        self.drain(blocking=True, write_newest=False)
        t0 = time.perf_counter()
        path = self.begin(step)
        if sync:
            dcp.save(state, checkpoint_id=path, storage_writer=dcp_io.writer(self.store, step))
            self.store.seal_rank(step, self.rank)
            finalize_fns = []
        else:
            finalize_fns = [self.saver.nvrx_staged(path, state, self._sealer(step))]
        self.pace.started_write()
        self.started += 1
        self.inflight = InFlight(step, path, t0, time.perf_counter() - t0, finalize_fns,
                                 local_done=sync)
        if sync:
            self.advance(blocking=True)

    # ---------------------------------------------------------------- moving it on
    def tick(self) -> None:
        """Once per step on every rank: moves the write on, starts the next when due.

        Never waits for the store. A write cut by a stop (its writer got the pod's SIGTERM) is
        dropped on every rank: the stop's own save follows.
        """
        try:
            done = self.advance(blocking=False)
        except CheckpointError as err:
            if all_ranks(not self.stopping(), self.device):
                raise
            self.log(f"stop: the write in flight was cut ({err}); the stop saves its step")
            self.abort()
            return
        if done:
            self.start(force=False)

    def drain(self, blocking: bool = True, timeout: float | None = None,
              write_newest: bool = True) -> bool:
        """Commits the write in flight, then (``write_newest``) writes the newest snapshot too.

        With ``blocking`` it waits up to ``timeout`` (default ``checkpoint.finalize_timeout``)
        for each; raises :class:`CheckpointError` after that, or when a write or commit failed.
        """
        done = self.advance(blocking, timeout)
        if blocking and done and write_newest and self.start(force=True):
            done = self.advance(blocking, timeout)
        return done

    def advance(self, blocking: bool, timeout: float | None = None) -> bool:
        """Commits the write in flight once every rank wrote it; True when none is in flight.

        Two phases, each ended by a collective (:func:`.commit.advance`): every rank's write
        done -> rank 0's file work (``.metadata``, marker, progress file, pruning) starts on a
        thread; that work done -> the step counts as committed everywhere.
        """
        inf = self.inflight
        if inf is None:
            return True
        files = functools.partial(write_commit, self.store, inf.step, self.world_size, self.cfg.keep)
        limit = self.cfg.finalize_timeout if timeout is None else max(0.0, timeout)
        if not advance(inf, self._poll_local, files if self.rank == 0 else None, self.device,
                       blocking, limit):
            return False
        if self.rank == 0 and self.on_commit is not None:
            # Every second this write held the loop: its start (planning) and its commit steps.
            self.on_commit(inf.step, inf.blocking_s + inf.loop_s, time.perf_counter() - inf.started,
                           inf.commit.result if inf.commit is not None else 0)
        if self.staging is not None:  # the bank now holds committed state
            self.staging.commit(inf.step)
            self.staging.lend(None)
        self.commits += 1
        self.commit_s.append(inf.blocking_s + inf.loop_s)
        self.write_s.append(time.perf_counter() - inf.started)
        self.last_commit_step = inf.step
        self.pace.wrote(inf.step)
        self.inflight = None
        return True

    def _poll_local(self, blocking_wait: float) -> int:
        """1 when this rank's write finished (sticky), 0 while it runs, -1: the writer died."""
        inf = self.inflight
        if inf is None or inf.local_done:
            return 1
        try:
            inf.local_done = self.writer.done(blocking_wait, f"checkpoint step {inf.step}")
        except CheckpointError as err:
            self.log(f"rank {self.rank}: {err}")
            return -1
        return 1 if inf.local_done else 0

    # ---------------------------------------------------------------- ending
    def abort(self) -> None:
        """Error path: drops the write in flight and kills the writer.

        A commit whose file work already started (every rank's write was complete) may still land
        its marker: it is waited for (5 s at most), so the next incarnation's resume sees a
        settled directory.
        """
        inf, self.inflight = self.inflight, None
        if inf is not None and inf.commit is not None:
            inf.commit.join(min(5.0, self.cfg.finalize_timeout))  # a hung FS must not stall it
        if self.staging is not None:
            self.staging.lend(None)
        self.writer.abort()
