"""Two tiers at two paces: host snapshots every few seconds, durable DCP commits behind them.

A *snapshot* copies the training state into a persistent pinned, shared host bank (:mod:`.staging`)
every ``checkpoint.interval`` steps or ``checkpoint.interval_s`` seconds: on CUDA on a side stream,
overlapped with the next forward/backward (the optimizer step waits for it on the GPU, never the
CPU). It never waits for the store: a snapshot that finds no bank ready (still being pinned in the
background, or all being written) is skipped with one line. The banks are the recovery tier: an
in-process restart restores from them, and so does an in-job restart on the same node (their
sealed manifests under ``/dev/shm``, :mod:`.hostcopy`), whichever snapshot is newest, written to
the store or not.

The *durable* tier is the run's checkpoint store (:mod:`kfp_nvrx.components.core.ckpt_store`; the
volume store keeps one torch DCP checkpoint per step, reshardable to any world size). Behind the
snapshots, :class:`.durable.DurableWrites` writes the newest snapshot not yet written, one write at
a time, at the pace :mod:`.snapshots` sets; a snapshot taken meanwhile supersedes the one waiting.
NVRx's persistent writer process writes from the bank; a step counts only once committed: rank 0
commits it (on the volume, an atomic marker with every file's size and CRC32) after every rank's
write finished, on a thread (:mod:`.commit`). Resume takes the newest snapshot every rank holds or
the newest intact commit (:mod:`.recovery`); ``export`` and ``checkpoint.load_step`` read the store
only. Without banks (``checkpoint.staging=nvrx``, or no room in ``/dev/shm``) every save is a
durable write staged by NVRx and waits for the one before it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kfp_nvrx.components.core.ckpt_store import CheckpointStore, open_store
from kfp_nvrx.components.core.config import CheckpointConfig
from kfp_nvrx.components.training.checkpoint.durable import DurableWrites, Kept, Reports
from kfp_nvrx.components.training.checkpoint.hostcopy import HostCopyDir
from kfp_nvrx.components.training.checkpoint.peers import Peers
from kfp_nvrx.components.training.checkpoint.recovery import Recovery
from kfp_nvrx.components.training.checkpoint.replication import Replicator
from kfp_nvrx.components.training.checkpoint.snapshots import PINNING, Pace
from kfp_nvrx.components.training.checkpoint.staging import (
    HostStaging,
    StagingUnavailable,
    flat_state,
)
from kfp_nvrx.components.training.checkpoint.writer import CheckpointError, NvrxWriter
from kfp_nvrx.components.training.ranks import all_ranks, min_over_ranks

# What every rank reports before a snapshot (the least wins): no banks at all, no bank ready now.
_UNAVAILABLE, _NOT_NOW, _READY = 0, 1, 2


def staging_mode(cfg: CheckpointConfig, device: torch.device) -> str:
    """``checkpoint.staging`` resolved: overlap (CUDA) | blocking | nvrx | sync (no async save)."""
    if not cfg.async_save:
        return "sync"
    if cfg.staging == "auto":
        return "overlap" if device.type == "cuda" else "blocking"
    if cfg.staging == "overlap" and device.type != "cuda":
        return "blocking"  # CPU copies are synchronous anyway
    return cfg.staging


class Checkpointer:
    """Snapshots, durable writes and resume of one incarnation; every public method is collective.

    Args:
        run_dir: The run directory.
        cfg: The ``checkpoint`` config section.
        device: Training device (decides GPU staging vs CPU snapshot).
        kept: The process's staging banks and writer from its last incarnation (made if None).
        reports: Where commits, snapshots and notices go.
        final_step: The run's last step, saved too when ``checkpoint.save_final``.
    """

    def __init__(self, run_dir: str | os.PathLike, cfg: CheckpointConfig, device: torch.device,
                 kept: Kept | None = None, reports: Reports = Reports(),
                 final_step: int | None = None) -> None:
        kept = kept or Kept()
        self.run_dir = Path(run_dir)
        self.store: CheckpointStore = open_store(run_dir, cfg.store)
        self.cfg, self.device, self.final_step = cfg, device, final_step
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.on_snapshot = reports.on_snapshot
        self.log = reports.log
        self.pace = Pace(cfg.interval, cfg.interval_s, cfg.persist_interval_s, cfg.persist_duty)
        self.mode = staging_mode(cfg, device)
        staging = kept.staging
        if self.mode in ("overlap", "blocking") and staging is None:
            # A new worker process: the node-local host copy of this rank.
            home = HostCopyDir(run_dir, self.rank, self.world_size)
            home.sweep()  # other runs' copies whose ft_launcher agents are gone
            home.drop_other_ranks()  # ranks a relaunch on fewer nodes no longer has
            staging = HostStaging(device, home)
        if self.mode not in ("overlap", "blocking"):
            staging = None
        writer = kept.writer if kept.writer is not None else NvrxWriter(device)
        if writer.started:  # the last incarnation's, whose abort was cut short: not ours
            writer.abort()
        writer.use_cuda(staging is None)  # staged writes: the writer needs no GPU
        self.writes = DurableWrites(self.store, cfg, device, Kept(staging, writer), self.pace,
                                    Reports(reports.on_commit, log=lambda msg: self.log(msg),
                                            stopping=reports.stopping))
        # Peer copies of every snapshot (collective: every rank opens its side, in this order).
        peers = (Peers.open(staging.home, cfg.replicas)
                 if staging is not None and cfg.replicas > 1 else None)
        self.replicator = (Replicator(peers, staging, self.pace, device, lambda msg: self.log(msg),
                                      reports.on_replica)
                           if peers is not None and staging is not None else None)
        self.recovery = Recovery(self.store, cfg, device, staging,
                                 lambda msg: self.log(msg), peers)  # self.log may be replaced

    # ---------------------------------------------------------------- views
    @property
    def root(self) -> Path:
        """Where the store keeps the checkpoints (the folder, for a volume store)."""
        return Path(self.store.where)

    @property
    def staging(self) -> HostStaging | None:
        """The snapshot banks (None: no host tier, every save is a durable write)."""
        return self.writes.staging

    @property
    def writer(self) -> NvrxWriter:
        """The worker process's NVRx writer."""
        return self.writes.writer

    @property
    def commits(self) -> int:
        """Durable commits of this incarnation."""
        return self.writes.commits

    @property
    def write_events(self) -> int:
        """Durable writes started or committed by this incarnation (their steps are not steady)."""
        return self.writes.started + self.writes.commits

    @property
    def last_commit_step(self) -> int:
        """The newest step this incarnation committed (-1: none)."""
        return self.writes.last_commit_step

    @property
    def write_s(self) -> list[float]:
        """Seconds from each durable write's start to its commit."""
        return self.writes.write_s

    @property
    def commit_s(self) -> list[float]:
        """Seconds each durable write held the training loop."""
        return self.writes.commit_s

    @property
    def inflight(self) -> Any:
        """The durable write in flight (None: none)."""
        return self.writes.inflight

    # ---------------------------------------------------------------- policy
    @property
    def periodic(self) -> bool:
        """Whether this run snapshots during the run (by steps or seconds)."""
        return self.pace.periodic

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is snapshotted: by ``checkpoint.interval``/``interval_s``, and the final.

        Collective when ``checkpoint.interval_s`` is set (the ranks agree on the time).
        """
        due = self.pace.snapshot_due(step)
        if self.cfg.interval_s > 0:
            due = all_ranks(due, self.device)
        return bool(due or (self.cfg.save_final and step == self.final_step))

    # ---------------------------------------------------------------- resume
    def resume(self, state_fn: Callable[[], dict[str, Any]],
               check: Callable[[set[str], int], None] | None = None, first_start: bool = True,
               ) -> tuple[int | None, dict[str, Any] | None]:
        """Loads the newest state this run can resume from (:meth:`.recovery.Recovery.resume`).

        A step restored from host memory that the store does not hold yet is the newest
        snapshot: the next durable write takes it.
        """
        step, state = self.recovery.resume(state_fn, check, first_start)
        durable = self.recovery.durable  # listed once by the resume (no second store listing)
        self.pace.found(durable[0] if durable else -1)
        if step is not None and state is not None and self.restored_from_memory:
            self.pace.took(step, state)
        return step, state

    @property
    def restored_from_memory(self) -> bool:
        """Whether the last load came from host memory (the staging banks), not the files."""
        return self.recovery.restored_from_memory

    @property
    def sources(self) -> list[str] | None:
        """Where each rank's state came from in the last resume (memory, peer, volume; None: none)."""
        return self.recovery.sources

    @property
    def peer_bytes(self) -> int:
        """Bytes the ranks fetched from peers in the last resume."""
        peers = self.recovery.peers
        return peers.fetched_bytes if peers is not None else 0

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

    # ---------------------------------------------------------------- snapshots
    def warm_up(self) -> None:
        """Starts NVRx's writer process now (async saves), not inside the first write."""
        if self.cfg.async_save:
            self.writer.warm_up()

    def prepare(self, state_fn: Callable[[], dict[str, Any]]) -> None:
        """Allocates the staging banks for this state in the background (pinning takes seconds)."""
        if self.staging is not None:
            self.staging.prepare(state_fn())

    def preparing(self) -> bool:
        """Whether the staging banks are being allocated and pinned in the background."""
        return self.staging is not None and self.staging.preparing()

    def save(self, step: int, state: dict[str, Any], sync: bool = False) -> float:
        """Snapshots ``state`` as ``step``; returns the seconds this call held training.

        With banks: the state is copied into a free bank and this call returns (CUDA: the
        copies run beside the next step); the durable write of the newest snapshot starts from a
        later :meth:`tick`, never here, so no collective follows the queued copies (its small
        device-to-host copy would wait behind them on the copy engine). A snapshot that finds
        no bank ready is skipped with one line. The final step waits for what it needs (its
        banks; the write in flight only when it holds the one free bank), as the run ends after
        it. ``sync`` (or
        ``checkpoint.async_save=false``), or no banks: a durable write here, after the one in
        flight (``sync``: ``dcp.save``, committed before it returns).
        """
        t0 = time.perf_counter()
        sync = sync or not self.cfg.async_save
        if self.staging is None or sync:
            self.writes.unstaged(step, state, sync)
            return self._snapshot_done(step, t0, "")
        final = self.cfg.save_final and step == self.final_step
        flat = flat_state(state)
        why = self._why_not_snapshot(flat, wait=final or self.device.type != "cuda")
        if why is not None and final and self.staging is not None:
            # The final step is always snapshotted: every bank busy, the write in flight ends
            # first (every rank has a reason here, so every rank takes part).
            self.writes.advance(blocking=True)
            why = self._why_not_snapshot(flat, wait=True)
        staging = self.staging
        if why is None and staging is not None:
            staging.stage(flat, step)
            self.pace.took(step, state)
            return self._snapshot_done(step, t0, "")
        if staging is None:  # the banks are unavailable on some rank: NVRx staging from now on
            self.writes.unstaged(step, state, sync=False)
            return self._snapshot_done(step, t0, "")
        self.pace.skip(why or PINNING, self.log, step)
        return self._snapshot_done(step, t0, why or PINNING)

    def _snapshot_done(self, step: int, t0: float, skipped: str) -> float:
        stall = time.perf_counter() - t0
        if self.rank == 0 and self.on_snapshot is not None:
            self.on_snapshot(step, stall, skipped)
        return stall

    def _why_not_snapshot(self, flat: dict[str, Any], wait: bool) -> str | None:
        """None when every rank can snapshot now (one collective); else why not.

        ``wait``: the banks are allocated (and pinned) here if they are not ready (the CPU,
        where that is cheap, and the final step). Otherwise a rank without a ready bank starts
        their allocation in the background and the snapshot is skipped. Banks unavailable on any
        rank (no room in /dev/shm) switch every rank to NVRx's staging.
        """
        staging = self.staging
        assert staging is not None
        problem, why = "", None
        try:
            if wait:
                staging.ensure(flat)
            why = staging.why_not_now(flat)
        except StagingUnavailable as err:
            problem = str(err)
        mine = _UNAVAILABLE if problem else _NOT_NOW if why else _READY
        agreed = min_over_ranks(mine, self.device)
        if agreed == _READY:
            return None
        if agreed == _NOT_NOW:
            return why or PINNING  # (another rank's reason is not sent: it is one of the two)
        self.log(f"checkpoint.staging={self.cfg.staging}: {problem or 'unavailable on another rank'}"
                 "; using NVRx's staging")
        staging.release()
        self.mode = "nvrx"
        self.writes.without_banks()
        self.recovery.without_banks()
        self.replicator = None  # nothing to copy: the banks are gone
        self.writer.use_cuda(True)  # NVRx's staging copies from the GPU in the writer
        return "no staging banks"

    def gpu_wait(self) -> contextlib.AbstractContextManager[None]:
        """Wraps the loop's wait for the GPU: the banks pin in it, not beside the loop's launches."""
        if self.staging is None:
            return contextlib.nullcontext()
        return self.staging.gpu_waits.waiting()

    def wait_before_update(self) -> None:
        """Call before the optimizer step: it must not change tensors still being copied.

        The wait is on the GPU stream (the CPU goes on queueing work).
        """
        if self.staging is not None and self.staging.copying():
            self.staging.wait_before_update()

    # ---------------------------------------------------------------- durable tier
    def tick(self) -> None:
        """Call once per step on every rank: seals the last snapshot, moves the write on.

        Never waits for the store (:meth:`.durable.DurableWrites.tick`).
        """
        if self.staging is not None:
            self.staging.settle()
            for note in self.staging.take_notes():
                self.log(note)
        self.writes.tick()
        if self.replicator is not None and self.staging is not None:
            self.replicator.tick()

    def finalize(self, blocking: bool, timeout: float | None = None) -> bool:
        """Commits the write in flight; ``blocking`` also writes and commits the newest snapshot.

        True when no write is in flight. Raises :class:`CheckpointError` when a write or commit
        failed, or (``blocking``) after ``timeout`` (default ``checkpoint.finalize_timeout``).
        """
        return self.writes.drain(blocking, timeout)

    def save_on_stop(self, step: int, state_fn: Callable[[], dict[str, Any]],
                     seconds: float) -> int | None:
        """The node is being stopped: commits ``step`` within ``seconds`` if it fits (collective).

        ft_launcher signals its workers' whole process groups, so the writer process (and NVRx's
        results queue) got the SIGTERM too: the write in flight is dropped and ``step`` is
        written here, synchronously, unless ``step`` is already committed or the slowest write
        of this incarnation says it would not commit in the time left (then the work since the
        newest commit is lost, as it would be without this). A save cut by ft_launcher's SIGKILL
        never gets its commit marker.

        Returns:
            The newest step committed when it returns (None: none known).
        """
        deadline = time.monotonic() + seconds
        if self.pace.persisted != step:
            expected = max(self.write_s, default=0.0)
            fits = all_ranks(deadline - time.monotonic() > expected, self.device)
            self.abort()  # the writer is gone or going: nothing more comes from it
            if fits:
                try:
                    self.save(step, state_fn(), sync=True)
                except CheckpointError as err:
                    self.log(f"stop: the save of step {step} did not commit ({err})")
        return self.pace.persisted if self.pace.persisted >= 0 else None

    # ---------------------------------------------------------------- end
    def abort(self) -> None:
        """Error path: drops the write in flight, kills the writer, forgets cut copies."""
        self.writes.abort()
        if self.replicator is not None:
            self.replicator.abort()
        if self.staging is not None and self.staging.copying():
            self.staging.invalidate()  # a snapshot's copies the fault may have cut

    def close(self) -> None:
        """Writes what is not written yet (blocking) and stops the writer process."""
        try:
            self.finalize(blocking=True)
        finally:
            if self.replicator is not None:
                self.replicator.close(self.cfg.finalize_timeout)
            self.writer.close()

    def discard_host_copy(self) -> None:
        """The run is over: frees the staging banks and deletes their files under /dev/shm."""
        if self.staging is not None:
            self.staging.release()

