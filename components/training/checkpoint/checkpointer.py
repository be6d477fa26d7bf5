"""DCP checkpoints written asynchronously with NVRx's async DCP writer, committed atomically.

Where: the run's checkpoint store (:mod:`kfp_nvrx.components.core.ckpt_store`; the volume store
keeps one torch DCP checkpoint per step, reshardable to any world size). A step counts only once
committed: rank 0 commits it (on the volume, an atomic marker) after every rank's write finished
and the DCP metadata was written. The commit records each file's size and CRC32 (every rank
checksums its own files in the writer process, off the training loop). Resume takes the newest
intact committed step (:func:`~kfp_nvrx.components.core.ckpt_store.newest_intact`); torn or corrupt
ones are skipped with a log line (DCP itself loads flipped bytes silently). Resume splits the CRC
work over the ranks.

One save is in flight at a time. Staging (``checkpoint.staging``, see :mod:`.staging`) copies the
state into a persistent pinned, shared host buffer: on CUDA on a side stream, overlapped with the
next forward/backward (``overlap``: the optimizer step waits for it on the GPU) or waited for in
``save`` (``blocking``); ``nvrx`` leaves staging to NVRx (GPU: D2H in its worker; CPU: a clone,
because NVRx <= 0.4 does not snapshot CPU tensors). Writing runs in NVRx's persistent worker
process; finalisation happens at step boundaries once every rank's write is done (gather write
results, collective), rank 0 writing metadata and commit marker on a thread (:mod:`.commit`),
bounded by ``checkpoint.finalize_timeout``.
The staging banks keep the newest committed state in host memory, as files under ``/dev/shm``
that outlive the worker (:mod:`.hostcopy`): an in-process restart restores from them, and so does
an in-job restart on the same node once the bank's manifest matches the newest commit marker;
neither reads (nor CRC-checks) the files back. Rank 0 also records the newest committed step in
the store's progress file for ft_launcher's progress tracking (NVRx >= 0.7).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kfp_nvrx.components.core.ckpt_store import CheckpointStore, open_store
from kfp_nvrx.components.core.config import CheckpointConfig
from kfp_nvrx.components.training.checkpoint import dcp_io
from kfp_nvrx.components.training.checkpoint.async_save import AsyncSaver
from kfp_nvrx.components.training.checkpoint.commit import (
    InFlight,
    advance,
    write_commit,
)
from kfp_nvrx.components.training.checkpoint.hostcopy import HostCopyDir
from kfp_nvrx.components.training.checkpoint.recovery import Recovery
from kfp_nvrx.components.training.checkpoint.staging import (
    HostStaging,
    StagingUnavailable,
    flat_state,
)
from kfp_nvrx.components.training.checkpoint.writer import CheckpointError, NvrxWriter
from kfp_nvrx.components.training.ranks import all_ranks


def staging_mode(cfg: CheckpointConfig, device: torch.device) -> str:
    """``checkpoint.staging`` resolved: overlap (CUDA) | blocking | nvrx | sync (no async save)."""
    if not cfg.async_save:
        return "sync"
    if cfg.staging == "auto":
        return "overlap" if device.type == "cuda" else "blocking"
    if cfg.staging == "overlap" and device.type != "cuda":
        return "blocking"  # CPU copies are synchronous anyway
    return cfg.staging


@dataclass
class Kept:
    """What a worker process's checkpointing keeps across its in-process restarts.

    None is made by the next :class:`Checkpointer`, which holds the ones it used.

    Attributes:
        staging: The host staging buffer, which an in-process restart restores from.
        writer: NVRx's writer; its processes, killed on an abort, are reaped by a later incarnation.
    """

    staging: HostStaging | None = None
    writer: NvrxWriter | None = None


@dataclass(frozen=True)
class Reports:
    """Where a :class:`Checkpointer` tells what happened.

    Attributes:
        on_commit: Called on rank 0 with (step, blocking_s, total_s, bytes) after each commit.
        log: Where one-line notices go (e.g. falling back to NVRx staging).
    """

    on_commit: Callable[[int, float, float, int], None] | None = None
    log: Callable[[str], None] = print


class Checkpointer:
    """Saves and loads one incarnation's training state; every public method is collective.

    It decides when to save (:meth:`should_save`) and where to resume from (:meth:`resume`).
    Async writes go through an :class:`~.async_save.AsyncSaver` to the worker process's
    :class:`~.writer.NvrxWriter`.

    Args:
        run_dir: The run directory.
        cfg: The ``checkpoint`` config section.
        device: Training device (decides GPU staging vs CPU snapshot).
        kept: The process's staging buffer and writer from its last incarnation (made if None).
        reports: Where commits and notices go.
        final_step: The run's last step, saved too when ``checkpoint.save_final``.
    """

    def __init__(self, run_dir: str | os.PathLike, cfg: CheckpointConfig, device: torch.device,
                 kept: Kept | None = None, reports: Reports = Reports(),
                 final_step: int | None = None) -> None:
        kept = kept or Kept()
        staging = kept.staging
        self.run_dir = Path(run_dir)
        self.store: CheckpointStore = open_store(run_dir, cfg.store)
        self.cfg = cfg
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.on_commit = reports.on_commit
        self.final_step = final_step
        self.inflight: InFlight | None = None
        self.commits = 0  # saves committed by this incarnation
        self.commit_s: list[float] = []  # seconds each commit held the training loop
        self.write_s: list[float] = []  # seconds from each save's start to its commit
        self.last_commit_step = -1
        self.mode = staging_mode(cfg, device)
        self.staging = None
        if self.mode in ("overlap", "blocking"):
            if staging is None:  # a new worker process: the node-local host copy of this rank
                home = HostCopyDir(run_dir, self.rank, self.world_size)
                home.sweep()  # other runs' copies whose ft_launcher agents are gone
                home.drop_other_ranks()  # ranks a relaunch on fewer nodes no longer has
                staging = HostStaging(device, home)
            self.staging = staging
        self.writer = kept.writer if kept.writer is not None else NvrxWriter(device)
        if self.writer.started:  # the last incarnation's, whose abort was cut short: not ours
            self.writer.abort()
        self.writer.use_cuda(self.staging is None)  # staged saves: the writer needs no GPU
        self.saver = AsyncSaver(self.writer, device, self.rank, cfg.write_threads,
                                start_timeout=cfg.finalize_timeout)
        self.log = reports.log
        self.recovery = Recovery(self.store, cfg, device, self.staging,
                                 lambda msg: self.log(msg))  # self.log may be replaced

    @property
    def root(self) -> Path:
        """Where the store keeps the checkpoints (the folder, for a volume store)."""
        return Path(self.store.where)

    # ---------------------------------------------------------------- policy
    @property
    def periodic(self) -> bool:
        """Whether this run saves every ``checkpoint.interval`` steps."""
        return self.cfg.interval > 0

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is saved: every ``checkpoint.interval`` steps, and the final step."""
        return bool((self.periodic and step % self.cfg.interval == 0)
                    or (self.cfg.save_final and step == self.final_step))

    def resume(self, state_fn: Callable[[], dict[str, Any]],
               check: Callable[[set[str], int], None] | None = None, first_start: bool = True,
               ) -> tuple[int | None, dict[str, Any] | None]:
        """Loads the newest state this run can resume from (:meth:`.recovery.Recovery.resume`)."""
        return self.recovery.resume(state_fn, check, first_start)

    @property
    def restored_from_memory(self) -> bool:
        """Whether the last load came from host memory (the staging banks), not the files."""
        return self.recovery.restored_from_memory

    def select(self, steps: list[int] | None = None, log: Callable[[str], None] = print) -> int | None:
        """The newest intact committed step, the same on every rank (collective)."""
        return self.recovery.select(steps, log)

    def load(self, step: int, state: dict[str, Any]) -> None:
        """Loads ``step`` into ``state`` in place, from host memory or the files (collective)."""
        self.recovery.load(step, state)

    def memory_steps(self, pinned: bool = False) -> list[int]:
        """Steps every rank holds complete in host memory, newest first (collective)."""
        return self.recovery.memory_steps(pinned)

    def metadata_keys(self, step: int) -> set[str]:
        """Flattened keys stored in the snapshot or checkpoint of ``step``."""
        return self.recovery.metadata_keys(step)

    # ---------------------------------------------------------------- save
    def warm_up(self) -> None:
        """Starts NVRx's writer process now (async saves), not inside the first save."""
        if self.cfg.async_save:
            self.writer.warm_up()

    def save(self, step: int, state: dict[str, Any], sync: bool = False) -> float:
        """Starts saving ``state`` as ``step``; returns the seconds this call blocked.

        ``sync`` (or ``checkpoint.async_save=false``): written here with ``dcp.save`` and
        committed before it returns, without the writer process.
        """
        self.finalize(blocking=True)
        t0 = time.perf_counter()
        path = self.store.location(step)
        if self.rank == 0:
            self.store.begin(step)  # a torn leftover goes; never through a symlink
        dist.barrier()
        sync = sync or not self.cfg.async_save
        staging = self.staging
        flat = flat_state(state) if staging is not None and not sync else None
        if sync:
            dcp.save(state, checkpoint_id=path, storage_writer=dcp_io.writer(self.store, step))
            self.store.seal_rank(step, self.rank)
            finalize_fns = []
        elif staging is not None and flat is not None and self._staging_ok(staging, flat):
            finalize_fns = [self.saver.staged(path, state, flat, staging, step,
                                              submit=self.mode == "blocking")]
        else:
            finalize_fns = [self.saver.nvrx_staged(path, state)]
        blocking = time.perf_counter() - t0
        self.inflight = InFlight(step, path, t0, blocking, finalize_fns, local_done=sync)
        if sync:
            self.finalize(blocking=True)
        return blocking

    def prepare(self, state_fn: Callable[[], dict[str, Any]]) -> None:
        """Allocates the staging buffer for this state in the background (pinning takes seconds)."""
        if self.staging is not None:
            self.staging.prepare(state_fn())

    def preparing(self) -> bool:
        """Whether the staging banks are being allocated and pinned in the background."""
        return self.staging is not None and self.staging.preparing()

    def _staging_ok(self, staging: HostStaging, flat: dict[str, Any]) -> bool:
        """Every rank has a staging buffer for this state; else all fall back to NVRx staging."""
        problem = ""
        try:
            staging.ensure(flat)
        except StagingUnavailable as err:
            problem = str(err)
        if all_ranks(not problem, self.device):
            return True
        self.log(f"checkpoint.staging={self.cfg.staging}: {problem or 'unavailable on another rank'}; "
                 "using NVRx's staging")
        staging.release()
        self.staging, self.mode = None, "nvrx"
        self.writer.use_cuda(True)  # NVRx's staging copies from the GPU in the writer
        return False

    def wait_before_update(self) -> None:
        """Call before the optimizer step: it must not change tensors still being staged.

        The wait is on the GPU stream (the CPU goes on queueing work).
        """
        if self.saver.pending is not None and self.staging is not None:
            self.staging.wait_before_update()

    def _poll_local(self, blocking_wait: float) -> bool:
        """Whether this rank's write finished (sticky), waiting at most ``blocking_wait`` s."""
        inf, staging = self.inflight, self.staging
        if inf is None or inf.local_done:
            return True
        if self.saver.pending is not None and staging is not None:
            if not staging.ready():
                return False
            self.saver.submit(staging)
        inf.local_done = self.writer.done(blocking_wait, f"checkpoint step {inf.step}")
        return inf.local_done

    def finalize(self, blocking: bool, timeout: float | None = None) -> bool:
        """Commits the in-flight save once all ranks wrote it; True when nothing is pending.

        Two phases, each ended by a collective (:func:`.commit.advance`): every rank's write done
        -> rank 0's file work (``.metadata``, marker, progress file, pruning) starts on a thread;
        that work done -> the save counts as committed everywhere. With ``blocking`` it waits up to
        ``timeout`` (default ``checkpoint.finalize_timeout``) and raises :class:`CheckpointError`
        after that, or when the commit failed.
        """
        inf = self.inflight
        if inf is None:
            return True
        files = functools.partial(write_commit, self.store, inf.step, self.world_size, self.cfg.keep)
        limit = self.cfg.finalize_timeout if timeout is None else max(0.0, timeout)
        if not advance(inf, self._poll_local, files if self.rank == 0 else None, self.device,
                       blocking, limit):
            return False
        t0 = time.perf_counter()
        if self.rank == 0 and self.on_commit is not None:
            self.on_commit(inf.step, inf.blocking_s, time.perf_counter() - inf.started,
                           inf.commit.result if inf.commit is not None else 0)
        if self.staging is not None:  # the bank now holds committed state: describe it
            self.staging.commit(inf.step)
        self.commits += 1
        self.commit_s.append(inf.loop_s + time.perf_counter() - t0)
        self.write_s.append(time.perf_counter() - inf.started)
        self.last_commit_step = inf.step
        self.inflight = None
        return True

    def save_on_stop(self, step: int, state_fn: Callable[[], dict[str, Any]],
                     seconds: float) -> int | None:
        """The node is being stopped: commits ``step`` within ``seconds`` if it fits (collective).

        ft_launcher signals its workers' whole process groups, so the writer process (and NVRx's
        results queue) got the SIGTERM too: the save in flight is dropped and ``step`` is
        written here, synchronously, unless ``step`` is already committed or the slowest save
        of this incarnation says it would not commit in the time left (then the work since the
        newest commit is lost, as it would be without this). A save cut by ft_launcher's SIGKILL
        never gets its commit marker.

        Returns:
            The newest step committed when it returns (None: none this incarnation).
        """
        deadline = time.monotonic() + seconds
        if self.last_commit_step != step:
            expected = max(self.write_s, default=0.0)
            fits = all_ranks(deadline - time.monotonic() > expected, self.device)
            self.abort()  # the writer is gone or going: nothing more comes from it
            if fits:
                try:
                    self.save(step, state_fn(), sync=True)
                except CheckpointError as err:
                    self.log(f"stop: the save of step {step} did not commit ({err})")
        return self.last_commit_step if self.last_commit_step >= 0 else None

    # ---------------------------------------------------------------- end
    def abort(self) -> None:
        """Error path: drops the pending save and kills the writer.

        A commit whose file work already started (every rank's write was complete) may still land
        its marker: it is waited for (5 s at most), so the next incarnation's resume sees a
        settled directory.
        """
        inf, self.inflight = self.inflight, None
        if inf is not None and inf.commit is not None:
            inf.commit.join(min(5.0, self.cfg.finalize_timeout))  # a hung FS must not stall it
        staging_incomplete, self.saver.pending = self.saver.pending is not None, None
        if self.staging is not None and staging_incomplete:
            self.staging.invalidate()
        self.writer.abort()

    def close(self) -> None:
        """Finishes the pending save (blocking) and stops the writer process."""
        try:
            self.finalize(blocking=True)
        finally:
            self.writer.close()

    def discard_host_copy(self) -> None:
        """The run is over: frees the staging banks and deletes their files under /dev/shm."""
        if self.staging is not None:
            self.staging.release()
