"""The volume store's layout: every name under ``<run_dir>/checkpoints`` and what makes a commit.

Private to the volume store (:mod:`.volume_store`, its rollback journal :mod:`.timeline`, and the
run dir's own checks in :mod:`.rundir`); every other module reaches checkpoints through the
checkpoint-store interface (:mod:`.ckpt_store`)::

    <run_dir>/checkpoints/
      step_00000040/           one DCP checkpoint; counts only with an intact COMMITTED marker
        COMMITTED              JSON: step, world_size, bytes, files {name: size}, crc32 {name: crc}
        .crc32_rank<R>.json    rank R's CRC32s, folded into the marker by rank 0
      latest_committed_step    the newest committed step, for ft_launcher's progress tracking
      ROLLBACK.json, abandoned-<N>-<time>/   a ``checkpoint.load_step`` rollback (:mod:`.timeline`)
      .trash-step_*            a pruned step being deleted

A checkpoint is committed when :func:`verify` finds nothing wrong with it; the trainer (resume),
export and the fault drills all decide with that one function. Imports no torch.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.atomic import refuse_link, write_atomic
from kfp_nvrx.components.core.bounded import kind_of, read_json
from kfp_nvrx.components.errors import UserError

CHECKPOINTS_DIR = "checkpoints"
COMMIT_MARKER = "COMMITTED"
#: DCP's global metadata file; a checkpoint without it cannot be loaded.
DCP_METADATA = ".metadata"
STEP_PREFIX = "step_"
#: Per-rank CRC32 sidecars the writer leaves next to its files; rank 0 folds them into the marker.
CRC_SIDECAR_PREFIX = ".crc32_rank"
#: The newest committed step (one integer), written by the trainer's rank 0 at every commit.
ITERATION_FILE = "latest_committed_step"
#: A pruned step renamed out of the timeline before its files are deleted.
TRASH_PREFIX = ".trash-"


def checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / CHECKPOINTS_DIR


def iteration_file(run_dir: str | os.PathLike[str]) -> Path:
    """Where the trainer writes the newest committed step and ft_launcher reads it."""
    return checkpoints_dir(run_dir) / ITERATION_FILE


def step_dir(root: Path, step: int) -> Path:
    """``<root>/step_XXXXXXXX`` (``root`` is a :func:`checkpoints_dir`)."""
    return root / f"{STEP_PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a ``step_XXXXXXXX`` directory name, or None for any other name."""
    if not name.startswith(STEP_PREFIX):
        return None
    digits = name[len(STEP_PREFIX):]
    return int(digits) if digits.isdigit() else None


def remove_torn(path: Path, run_dir: Path) -> None:
    """Deletes a torn step folder an earlier incarnation left, never through a link."""
    refuse_link(path, run_dir)
    if path.exists():
        shutil.rmtree(path)


def crc32_file(path: Path) -> int:
    """CRC32 of a file's bytes, read in 16 MiB chunks."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_checksums(files: list[str], rank: int) -> None:
    """Records the CRC32 of this rank's checkpoint files in a sidecar next to them.

    Runs in NVRx's writer process after the write (or inline for synchronous saves); rank 0 folds
    every sidecar into the commit marker.
    """
    if not files:
        return
    try:
        sums = {Path(name).name: crc32_file(Path(name)) for name in files}
        write_atomic(Path(files[0]).parent / f"{CRC_SIDECAR_PREFIX}{rank}.json",
                     json.dumps(sums).encode())
    except OSError:  # the write itself failed (e.g. disk full): finalisation reports that error
        return


def _dir_files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir())
            if p.is_file() and p.name != COMMIT_MARKER}


def write_commit_marker(path: Path, step: int, world_size: int) -> int:
    """Commits the checkpoint in ``path`` (rank 0, after every rank's write and the metadata).

    Records every file's size and the CRC32s from the writers' sidecars plus the metadata's, so
    :func:`verify` can tell a complete checkpoint from a torn or altered one.

    Returns:
        The checkpoint's size in bytes.
    """
    files = _dir_files(path)
    sums: dict[str, int] = {}
    for sidecar in path.glob(f"{CRC_SIDECAR_PREFIX}*.json"):
        sums.update(read_json(sidecar, "checkpoint"))
    if (path / DCP_METADATA).is_file():
        sums[DCP_METADATA] = crc32_file(path / DCP_METADATA)
    nbytes = sum(files.values())
    marker = {"step": step, "world_size": world_size, "time": time.time(), "bytes": nbytes,
              "files": files, "crc32": sums}
    write_atomic(path / COMMIT_MARKER, json.dumps(marker).encode())
    return nbytes


def read_commit_marker(path: Path) -> dict[str, Any] | None:
    """The commit marker of the checkpoint in ``path``; None when there is none (torn).

    Raises:
        ValueError: The marker exists but is not a readable JSON object.
    """
    marker_path = path / COMMIT_MARKER
    if not marker_path.is_file():
        return None
    try:
        marker = read_json(marker_path, "checkpoint")
    except UserError as err:
        raise ValueError(f"unreadable commit marker ({err.message})") from None
    if not isinstance(marker, dict):
        raise ValueError("commit marker is not a JSON object")
    return marker


def _marker_problem(marker: dict[str, Any]) -> str | None:
    """What makes a marker one the trainer cannot have written (forged, truncated, hand-made)."""
    files, sums = marker.get("files"), marker.get("crc32", {})
    if not isinstance(files, dict) or not files:
        return "commit marker lists no files"
    if DCP_METADATA not in files:
        return f"commit marker does not list the DCP {DCP_METADATA} file"
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in files.values()):
        return "commit marker has a non-integer file size"
    if not isinstance(sums, dict) or not all(isinstance(v, int) for v in sums.values()):
        return "commit marker has malformed CRC32s"
    return None


def verify(path: Path, share: tuple[int, int] = (0, 1), crc: bool = True) -> str | None:
    """Decides whether the checkpoint in ``path`` is committed; returns the problem or None.

    Committed means: a marker the trainer could have written (a JSON object listing a non-empty
    set of files that includes the DCP metadata), every listed file present with its recorded
    size, and the recorded CRC32s matching. Sizes are always checked; CRC32s (unless not
    ``crc``) only for this ``(index, count)`` share of the files, so ranks can split that work.
    """
    try:
        marker = read_commit_marker(path)
    except ValueError as err:
        return str(err)
    if marker is None:
        return "no commit marker (torn or still being written)"
    problem = _marker_problem(marker)
    if problem:
        return problem
    # Each problem names the file by its full path and says what is wrong, in one clause: the
    # callers put it in one line ("checkpoint step 8 is damaged: ...; falling back to step 4").
    try:
        actual = _dir_files(path)
    except OSError as err:
        return f"cannot list {path}: {err.strerror or err}"
    return (_size_problem(path, marker["files"], actual)
            or (_crc_problem(path, marker.get("crc32", {}), share) if crc else None))


def _size_problem(path: Path, files: dict[str, int], actual: dict[str, int]) -> str | None:
    """The first file of ``files`` missing from ``path`` or not of its recorded size."""
    for name, size in files.items():
        if name not in actual:
            return _not_there(path / name)
        if actual[name] != size:
            return (f"{path / name} has {actual[name]} bytes where its commit recorded {size}, "
                    "so it was truncated or overwritten")
    return None


def _not_there(file: Path) -> str:
    """Why a committed file is not among the step's files: missing, or something else there.

    A FIFO, device, socket or folder in its place is said as what it is (it was reported as
    "missing" although ``ls`` shows it).
    """
    try:
        mode = file.lstat().st_mode
    except FileNotFoundError:
        return f"{file} is missing"
    except OSError as err:
        return f"cannot stat {file}: {err.strerror or err}"
    return f"{file} is {kind_of(mode)}, not the file its commit recorded"


def _crc_problem(path: Path, crcs: dict[str, int], share: tuple[int, int]) -> str | None:
    """The first file of this ``(index, count)`` share of ``crcs`` whose CRC32 differs."""
    for i, (name, want) in enumerate(sorted(crcs.items())):
        if i % share[1] != share[0]:
            continue
        try:
            if crc32_file(path / name) != want:
                return f"{path / name} fails its CRC32 check, so its bytes changed after the commit"
        except OSError as err:
            return f"cannot read {path / name}: {err.strerror or err}"
    return None
