"""Checkpoint files the trainer handles itself.

Per-rank CRC32 sidecars, snapshots of CPU write buckets, off-loop deletion and NVRx writer-process
tracking.

The layout, the commit marker and its verification live in :mod:`kfp_nvrx.components.core.rundir`.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kfp_nvrx.components.core.rundir import CRC_SIDECAR_PREFIX, crc32_file, write_atomic

#: NVRx writer processes this worker started and has not seen stop. They are not daemons, so one
#: left running blocks interpreter exit (multiprocessing joins its children) forever.
_WRITERS: list[Any] = []


def kill_writers(reap_timeout: float = 5.0) -> None:
    """Kills and reaps every writer process still tracked (abort path and interpreter exit).

    A process leaves the list only once reaped (or after ``reap_timeout`` seconds, e.g. stuck in
    uninterruptible I/O), so an async exception (in-process restart) that interrupts this leaves
    the rest for the next call.
    """
    for proc in list(_WRITERS):
        if proc.exitcode is None:
            _kill_tree(proc.pid)
        # Not join(): NVRx's writer forks child write processes that inherit the write end of its
        # exit-sentinel pipe, so join() sat out its whole timeout (10 s, longer than a learned
        # heartbeat timeout during an in-process restart). exitcode polls waitpid(WNOHANG).
        deadline = time.monotonic() + reap_timeout
        while proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.005)
        _WRITERS.remove(proc)


def _kill_tree(pid: int) -> None:
    """SIGKILLs a writer and all its descendants (NVRx's forked write processes).

    The writer is stopped first so it cannot fork more while its tree is listed. psutil comes
    with nvidia-resiliency-ext, the only source of tracked writers.
    """
    import psutil

    try:
        writer = psutil.Process(pid)
        writer.suspend()
        procs = [*writer.children(recursive=True), writer]
    except psutil.Error:  # already gone (or a zombie waiting to be reaped)
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    if not procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


atexit.register(kill_writers)  # registered after multiprocessing's exit hook, so it runs first


def _track(caller: Any) -> None:
    if caller.process is not None and caller.process not in _WRITERS:
        _WRITERS.append(caller.process)


class CheckpointError(RuntimeError):
    """A save that failed or did not finish in time (never swallowed)."""


def write_checksums(files: list[str], rank: int) -> None:
    """Records the CRC32 of this rank's checkpoint files in a sidecar next to them.

    Runs in NVRx's writer process after the write (or inline for synchronous saves); rank 0 folds
    every sidecar into the commit marker.
    """
    if not files:
        return
    try:
        sums = {Path(name).name: crc32_file(Path(name)) for name in files}
        write_atomic(Path(files[0]).parent / f"{CRC_SIDECAR_PREFIX}{rank}.json", json.dumps(sums).encode())
    except OSError:  # the write itself failed (e.g. disk full): finalisation reports that error
        return


def _write_then_checksum(save_fn: Callable, rank: int, write_buckets: list, *rest: Any) -> None:
    """The writer process's job: NVRx's write, then the checksums of the files it wrote."""
    save_fn(rank, write_buckets, *rest)
    write_checksums([bucket[0] for bucket in write_buckets], rank)


def _snapshot(obj: Any) -> Any:
    """Clones CPU tensors inside NVRx write buckets (the CPU path's staging)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, list):
        return [_snapshot(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_snapshot(x) for x in obj)
    return obj


_DELETING: set[Path] = set()  # trash directories a thread of this process is removing


def _discard(path: Path) -> None:
    """Deletes a checkpoint directory off the training loop's critical path.

    The directory is renamed first (atomic: resume never sees it half-deleted), then removed by a
    daemon thread: unlinking a multi-GB file can take seconds, which showed up as a stalled
    training step at commit time.
    """
    if path in _DELETING:
        return
    trash = path
    if not path.name.startswith(".trash-"):
        trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.replace(path, trash)
        except OSError:
            return
    _DELETING.add(trash)
    threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True},
                     daemon=True, name="ckpt-prune").start()
