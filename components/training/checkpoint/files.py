"""Checkpoint files the trainer handles itself: CRC32 sidecars and pruning old checkpoints.

The run directory's layout, the commit marker and its verification live in
:mod:`kfp_nvrx.components.core.rundir` (shared with export and the drills).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

from kfp_nvrx.components.core.rundir import (
    COMMIT_MARKER,
    CRC_SIDECAR_PREFIX,
    STEP_PREFIX,
    committed_steps,
    crc32_file,
    link_in,
    step_dir,
    write_atomic,
)


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


def prune(root: Path, keep: int) -> None:
    """Keeps the newest ``keep`` committed checkpoints; drops older torn ones and old trash.

    Nothing is deleted through a symbolic link (:func:`rundir.link_in`): a ``checkpoints`` that
    links elsewhere, or a ``step_*`` that is a link, is left alone.
    """
    if link_in(root, root.parent) is not None:
        return
    committed = committed_steps(root)
    for step in committed[keep:]:
        _discard(step_dir(root, step))
    if committed:
        oldest_kept = step_dir(root, committed[:keep][-1]).name
        for p in root.glob(f"{STEP_PREFIX}*"):
            if not (p / COMMIT_MARKER).exists() and p.name < oldest_kept:
                _discard(p)
    for p in root.glob(".trash-*"):  # left by an earlier incarnation
        _discard(p)


def _remover_name(trash: Path) -> str:
    return f"ckpt-prune:{trash}"


def _discard(path: Path) -> None:
    """Deletes a checkpoint directory off the training loop's critical path.

    The directory is renamed first (atomic: resume never sees it half-deleted), then removed by a
    daemon thread: unlinking a multi-GB file can take seconds, and the commit must not wait for it.
    The removing threads are named after their directory, so a directory already being removed
    by this process is recognised without a registry.
    """
    if any(t.name == _remover_name(path) for t in threading.enumerate()):
        return
    if link_in(path, path.parent.parent) is not None:  # <run_dir>/checkpoints/<path>
        return
    trash = path
    if not path.name.startswith(".trash-"):
        trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.replace(path, trash)
        except OSError:
            return
    threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True},
                     daemon=True, name=_remover_name(trash)).start()
