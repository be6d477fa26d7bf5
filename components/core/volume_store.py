"""The volume checkpoint store: DCP checkpoints under ``<run_dir>/checkpoints`` on a POSIX path.

Local disk or FSx for Lustre. The layout is :mod:`.volume_layout`'s, the rollback journal
:mod:`.timeline`'s; this class is what the rest of kfp-nvrx holds (through
:class:`.ckpt_store.CheckpointStore`). We delete only what we created: pruning renames a step we
committed (or an older torn one of ours) out of the way and deletes it off the training loop;
nothing is deleted through a symbolic link (:func:`.atomic.link_in`): a ``checkpoints`` that links
elsewhere, or a ``step_*`` that is a link, is left alone. Imports no torch.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core import timeline
from kfp_nvrx.components.core.atomic import link_in, write_atomic
from kfp_nvrx.components.core.volume_layout import (
    COMMIT_MARKER,
    STEP_PREFIX,
    TRASH_PREFIX,
    checkpoints_dir,
    iteration_file,
    parse_step,
    read_commit_marker,
    remove_torn,
    step_dir,
    verify,
    write_checksums,
    write_commit_marker,
)

__all__ = ["VolumeStore", "prune"]


class VolumeStore:
    """The checkpoints of one run dir on a file system (:class:`.ckpt_store.CheckpointStore`).

    Args:
        run_dir: The run directory.
    """

    kind = "volume"

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.root = checkpoints_dir(run_dir)
        self.where = str(self.root)
        self.progress_file = iteration_file(run_dir)

    # ------------------------------------------------------------------ listing
    def committed_steps(self) -> list[int]:
        """Steps whose entry holds a commit marker, newest first, minus abandoned ones."""
        return timeline.committed_steps(self.root)

    def entries(self) -> list[int]:
        """Every ``step_*`` directory's step, committed or torn, oldest first."""
        if not self.root.is_dir():
            return []
        steps = (parse_step(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(s for s in steps if s is not None)

    def name(self, step: int) -> str:
        """``step_XXXXXXXX``."""
        return step_dir(self.root, step).name

    def location(self, step: int) -> str:
        """The step's directory (what DCP's file-system reader and writer take)."""
        return str(step_dir(self.root, step))

    def files(self, step: int) -> list[Path]:
        """The files of the step's directory, by name (the drills damage one, the bench reads)."""
        return [f for f in sorted(step_dir(self.root, step).iterdir()) if f.is_file()]

    def record(self, step: int) -> dict[str, Any] | None:
        """The step's commit marker; None when torn (ValueError when unreadable)."""
        return read_commit_marker(step_dir(self.root, step))

    def problem(self, step: int, share: tuple[int, int] = (0, 1), crc: bool = True) -> str | None:
        """What :func:`.volume_layout.verify` finds wrong with the step (None: committed)."""
        return verify(step_dir(self.root, step), share=share, crc=crc)

    def torn_entry_holds(self, path: Path) -> bool:
        """Whether ``path`` lies in a step directory without a commit marker (a cut save)."""
        for folder in path.parents:
            if folder.parent == self.root and parse_step(folder.name) is not None:
                return not (folder / COMMIT_MARKER).exists()
        return False

    # ------------------------------------------------------------------ writing
    def begin(self, step: int) -> str:
        """Rank 0: a fresh directory for ``step`` (a torn leftover goes; never through a link)."""
        path = step_dir(self.root, step)
        if path.is_dir() and not path.is_symlink():
            # The torn leftover of a write a fault cut: renamed aside at once and deleted on a
            # thread (a cut 13 GB write took seconds to delete here, on the training loop).
            _discard(path)
        remove_torn(path, self.run_dir)  # what could not be renamed aside; refuses a link
        path.mkdir(parents=True)
        return str(path)

    def seal_rank(self, step: int, rank: int) -> None:
        """CRC32 sidecar of ``rank``'s DCP files (``__<rank>_*``) of a synchronous save."""
        path = step_dir(self.root, step)
        write_checksums(sorted(str(p) for p in path.glob(f"__{rank}_*")), rank)

    def spool(self, step: int) -> str:
        """The step's directory: an asynchronous save writes its files in place."""
        return self.location(step)

    def seal_files(self, step: int, rank: int, files: list[str]) -> None:
        """CRC32 sidecar of ``rank``'s files just written (NVRx's writer process)."""
        write_checksums(files, rank)

    def commit(self, step: int, world_size: int) -> int:
        """Writes the commit marker (rank 0, after ``.metadata``); returns the bytes."""
        return write_commit_marker(step_dir(self.root, step), step, world_size)

    def record_progress(self, step: int) -> None:
        """The progress file ft_launcher reads (NVRx >= 0.7), replaced atomically."""
        # FT: ft_launcher's progress tracking reads the newest committed step from here.
        # A restore from host memory may come before the first durable write made the folder.
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.progress_file, f"{step}\n".encode())

    # ------------------------------------------------------------------ withdrawing
    def withdraw_newer(self, step: int) -> tuple[list[int], str | None]:
        """A ``checkpoint.load_step`` rollback: newer commits move to ``abandoned-*`` (kept)."""
        moved, into = timeline.roll_back(self.root, step)
        return moved, (str(into) if into is not None else None)

    def finish_withdraw(self) -> None:
        """Completes an interrupted rollback (:func:`.timeline.finish_rollback`)."""
        timeline.finish_rollback(self.root)

    def prune(self, keep: int) -> None:
        """Keeps the newest ``keep`` committed checkpoints (:func:`prune`)."""
        prune(self.root, keep)


def prune(root: Path, keep: int) -> None:
    """Keeps the newest ``keep`` committed checkpoints; drops older torn ones and old trash.

    Nothing is deleted through a symbolic link (:func:`.atomic.link_in`): a ``checkpoints`` that
    links elsewhere, or a ``step_*`` that is a link, is left alone.
    """
    if link_in(root, root.parent) is not None:
        return
    committed = timeline.committed_steps(root)
    for step in committed[keep:]:
        _discard(step_dir(root, step))
    if committed:
        oldest_kept = step_dir(root, committed[:keep][-1]).name
        for p in root.glob(f"{STEP_PREFIX}*"):
            if not (p / COMMIT_MARKER).exists() and p.name < oldest_kept:
                _discard(p)
    for p in root.glob(f"{TRASH_PREFIX}*"):  # left by an earlier incarnation
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
    if not path.name.startswith(TRASH_PREFIX):
        trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.replace(path, trash)
        except OSError:
            return
    threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True},
                     daemon=True, name=_remover_name(trash)).start()
