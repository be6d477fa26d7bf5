"""The run directory: every name in it, and what makes a checkpoint committed.

One run directory is shared by every worker of a run, the launcher and the tools that read a run
afterwards (export, drills, goodput)::

    <run_dir>/
      config.yaml              the run's record: the resolved config of its first start (never
                               replaced; see :mod:`.run_record`)
      config.resumed.yaml      the resolved config of the newest start that differed from it
      dataset.json             the data the run trains on, by content (never replaced; see
                               :mod:`.dataset_record`)
      events.jsonl             run events (:mod:`.events`)
      faults/                  one marker per injected fault that fired (fires once per run)
      nccl_trace/rank_*        NCCL flight-recorder dumps
      checkpoints/
        step_00000040/         one DCP checkpoint; counts only with an intact COMMITTED marker
          COMMITTED            JSON: step, world_size, bytes, files {name: size}, crc32 {name: crc}

A checkpoint is committed when :func:`verify` finds nothing wrong with it; the trainer (resume),
export and the fault drills all decide with that one function.

Nothing is written or deleted through a symbolic link below the run dir (:func:`link_in`): a
``checkpoints`` that links elsewhere would make pruning delete a stranger's ``step_*`` folders.
:func:`.run_record.check_run_dir` refuses such a run dir before anything starts; the writer and the pruner
check again where they act. This module imports no torch.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

# link_in and write_atomic live in .atomic; they are imported from here too (one run-dir API).
from kfp_nvrx.components.core.atomic import link_in, write_atomic
from kfp_nvrx.components.core.bounded import kind_of, read_json
from kfp_nvrx.components.errors import UserError

CONFIG_FILE = "config.yaml"
RESUMED_CONFIG_FILE = "config.resumed.yaml"
DATASET_FILE = "dataset.json"
EVENTS_FILE = "events.jsonl"
FAULTS_DIR = "faults"
NCCL_TRACE_DIR = "nccl_trace"
#: Every line each local agent (ft_launcher and its workers) printed: ``node<i>.log``.
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"
COMMIT_MARKER = "COMMITTED"
#: DCP's global metadata file; a checkpoint without it cannot be loaded.
DCP_METADATA = ".metadata"
STEP_PREFIX = "step_"
#: Per-rank CRC32 sidecars the writer leaves next to its files; rank 0 folds them into the marker.
CRC_SIDECAR_PREFIX = ".crc32_rank"


def refuse_link(path: str | os.PathLike[str], top: str | os.PathLike[str],
                field: str = "run_dir") -> Path:
    """``path``, after checking that no link lies between it and ``top`` (:func:`link_in`).

    Raises:
        UserError: Naming ``field`` and the link.
    """
    link = link_in(path, top)
    if link is not None:
        raise UserError(field, f"{link} is a symbolic link (to {os.readlink(link)!r}); kfp-nvrx "
                        "never writes or deletes through a link inside a run dir: replace it "
                        "with a real directory or use a fresh `run_dir`")
    return Path(path)


#: Entries of a run dir whose own entries we create, delete or write (each checked for links).
_WRITTEN_DIRS = (CHECKPOINTS_DIR, LOGS_DIR, FAULTS_DIR, NCCL_TRACE_DIR)


#: Files of a run dir every start appends to or replaces: each must be a regular file.
_WRITTEN_FILES = (CONFIG_FILE, RESUMED_CONFIG_FILE, DATASET_FILE, EVENTS_FILE)


def _refuse_special(entry: Path, folder: bool) -> None:
    """Refuses ``entry`` unless it is a folder (``folder``) or a regular file.

    A FIFO at events.jsonl blocked every rank's first event forever; a folder there gave a
    traceback per restart.
    """
    mode = entry.lstat().st_mode
    if stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode):
        return
    what = "a file" if stat.S_ISREG(mode) else kind_of(mode)
    raise UserError("run_dir", f"{entry} is {what}, where kfp-nvrx writes a "
                    f"{'folder' if folder else 'file'}; remove it or use another `run_dir`")


def check_run_dir_links(run_dir: Path) -> None:
    """Refuses a run dir holding a link, FIFO, device or socket where we write (one line, exit 2).

    Also a folder where we write a file (events.jsonl, config.yaml) and a file where we write
    a folder (checkpoints, logs).
    """
    if not run_dir.is_dir():
        return
    for entry in run_dir.iterdir():  # config.yaml, events.jsonl, the lock, the marker, ...
        refuse_link(entry, run_dir)
        if entry.name in _WRITTEN_FILES or entry.name in _WRITTEN_DIRS:
            _refuse_special(entry, folder=entry.name in _WRITTEN_DIRS)
        if entry.name in _WRITTEN_DIRS:
            for child in entry.iterdir():  # step_* folders, node logs, NCCL dumps
                refuse_link(child, run_dir)
                if entry.name == LOGS_DIR:  # the launcher appends to them
                    _refuse_special(child, folder=False)


def remove_torn(path: Path, run_dir: Path) -> None:
    """Deletes a torn step folder an earlier incarnation left, never through a link."""
    refuse_link(path, run_dir)
    if path.exists():
        shutil.rmtree(path)


def checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dir(root: Path, step: int) -> Path:
    """``<root>/step_XXXXXXXX`` (``root`` is a :func:`checkpoints_dir`)."""
    return root / f"{STEP_PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a ``step_XXXXXXXX`` directory name, or None for any other name."""
    if not name.startswith(STEP_PREFIX):
        return None
    digits = name[len(STEP_PREFIX):]
    return int(digits) if digits.isdigit() else None


def committed_steps(root: Path) -> list[int]:
    """Steps whose directory holds a commit marker, newest first (not yet :func:`verify`-ed).

    Steps a pending ``checkpoint.load_step`` rollback abandons are not counted (:mod:`.timeline`).
    """
    from kfp_nvrx.components.core.timeline import committed_steps as in_timeline

    return in_timeline(root)


def crc32_file(path: Path) -> int:
    """CRC32 of a file's bytes, read in 16 MiB chunks."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


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
            return f"{path / name} is missing"
        if actual[name] != size:
            return (f"{path / name} has {actual[name]} bytes where its commit recorded {size}, "
                    "so it was truncated or overwritten")
    return None


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


def select_checkpoint(root: Path, wanted: int = -1, log: Callable[[str], None] = print) -> int | None:
    """The newest committed step (or ``wanted``) that passes :func:`verify`, logging the others."""
    for step in committed_steps(root):
        if wanted >= 0 and step != wanted:
            continue
        problem = verify(step_dir(root, step))
        if problem is None:
            return step
        log(f"checkpoint step {step} is damaged: {problem}; trying the next older one")
    return None
