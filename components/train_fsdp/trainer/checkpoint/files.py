"""Checkpoints on disk: layout, commit markers, verification, checksums and pruning.

A step directory counts only once its commit marker exists; the marker records each file's size and
CRC32, which :func:`verify` checks. Deletion renames first and removes off the training loop.
:class:`~.checkpointer.Checkpointer` (the collective save/load logic) builds on these; export and
drills use them too.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import zlib
from pathlib import Path

COMMIT_MARKER = "COMMITTED"
_PREFIX = "step_"
_CRC_PREFIX = ".crc32_rank"


def step_dir(root: Path, step: int) -> Path:
    """``<root>/step_XXXXXXXX``."""
    return root / f"{_PREFIX}{step:08d}"


def _dir_files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir())
            if p.is_file() and p.name != COMMIT_MARKER}


def committed_steps(root: Path) -> list[int]:
    """Steps with a commit marker, newest first."""
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        if p.name.startswith(_PREFIX) and (p / COMMIT_MARKER).is_file():
            try:
                steps.append(int(p.name[len(_PREFIX):]))
            except ValueError:
                continue
    return sorted(steps, reverse=True)


def _crc32(path: Path) -> int:
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
        sums = {Path(name).name: _crc32(Path(name)) for name in files}
        _write_atomic(Path(files[0]).parent / f"{_CRC_PREFIX}{rank}.json", json.dumps(sums).encode())
    except OSError:  # the write itself failed (e.g. disk full): finalisation reports that error
        return


def verify(path: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """Checks a committed checkpoint's files against its marker; returns a problem or None.

    Sizes are always checked; CRC32s (when the marker has them) only for this ``(index, count)``
    share of the files, so ranks can split that work.
    """
    try:
        marker = json.loads((path / COMMIT_MARKER).read_text())
    except (OSError, json.JSONDecodeError) as err:
        return f"unreadable commit marker ({err})"
    expected = marker.get("files", {})
    try:
        actual = _dir_files(path)
    except OSError as err:
        return f"cannot list files ({err})"
    for name, size in expected.items():
        if name not in actual:
            return f"missing file {name}"
        if actual[name] != size:
            return f"{name} is {actual[name]} bytes, expected {size} (truncated or corrupt)"
    for i, (name, crc) in enumerate(sorted(marker.get("crc32", {}).items())):
        if i % share[1] != share[0]:
            continue
        try:
            if _crc32(path / name) != crc:
                return f"{name} fails its CRC32 check (corrupt)"
        except OSError as err:
            return f"cannot read {name} ({err})"
    return None


def write_commit_marker(path: Path, step: int, world_size: int) -> int:
    """Commits the step directory ``path`` (rank 0, once every rank's files and ``.metadata`` exist).

    The marker lists every file's size and the CRC32s the ranks recorded in their sidecars; it is
    written atomically (tmp + fsync + rename). Returns the checkpoint's size in bytes.
    """
    files = _dir_files(path)
    sums: dict[str, int] = {}
    for sidecar in path.glob(f"{_CRC_PREFIX}*.json"):
        sums.update(json.loads(sidecar.read_text()))
    if (path / ".metadata").is_file():
        sums[".metadata"] = _crc32(path / ".metadata")
    nbytes = sum(files.values())
    marker = {"step": step, "world_size": world_size, "time": time.time(), "bytes": nbytes,
              "files": files, "crc32": sums}
    _write_atomic(path / COMMIT_MARKER, json.dumps(marker).encode())
    return nbytes


def prune(root: Path, keep: int) -> None:
    """Keeps the newest ``keep`` committed checkpoints; drops older torn ones and old trash."""
    committed = committed_steps(root)
    for step in committed[keep:]:
        _discard(step_dir(root, step))
    if committed:
        oldest_kept = step_dir(root, committed[:keep][-1]).name
        for p in root.glob(f"{_PREFIX}*"):
            if not (p / COMMIT_MARKER).exists() and p.name < oldest_kept:
                _discard(p)
    for p in root.glob(".trash-*"):  # left by an earlier incarnation
        _discard(p)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
