"""What we may delete or overwrite: only what we provably created.

Every command that replaces a directory (``prepare-data --out``, ``export --out``, the demo and the
drills) or writes into one (``launch-local --run-dir``) asks here first. Proof of ownership is a
file of ours in the directory: ``index.json`` of a dataset, ``export.json`` of an export, the
:data:`RUN_MARKER` of a run dir, the :data:`OUT_MARKER` of a demo/drill output folder. Entries
next to them that we did not write are *foreign*; a directory with foreign entries is never
replaced. The working directory, the home directory, ``/`` and any source being read (or a folder
holding one) are never an output directory at all.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import stat
from collections.abc import Collection, Iterable
from pathlib import Path

from kfp_nvrx.components.core.atomic import fsync_dir
from kfp_nvrx.components.core.ckpt_store import open_store
from kfp_nvrx.components.core.store_kinds import DEFAULT_KIND
from kfp_nvrx.components.errors import UserError

#: Written into every run dir we create; proves the folder is a kfp-nvrx run dir.
RUN_MARKER = ".kfp-nvrx-run"
#: Written into the output folder of ``demo`` and ``drill``, whose subfolders they recreate.
OUT_MARKER = ".kfp-nvrx-out"


def _real(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.realpath(os.path.abspath(path)))


def check_output_dir(out: str | os.PathLike[str], field: str,
                     sources: Iterable[str | os.PathLike[str]] = ()) -> None:
    """Refuse an output directory whose replacement would destroy what is not ours.

    Raises:
        UserError: (naming ``field``) when ``out`` is ``/``, the home or working directory or a
            folder above them, or a source being read or a folder holding one.

    """
    real = _real(out)
    if real == Path(real.anchor):
        raise UserError(field, f"{out} is the root directory; give a new folder for the output")
    for name, path in (("working directory", Path.cwd()), ("home directory", Path.home())):
        mine = _real(path)
        if mine == real or mine.is_relative_to(real):
            raise UserError(field, f"{out} is the {name} or a folder above it; give a new "
                            "folder for the output (e.g. ./out)")
    for src in sources:
        s = _real(src)
        if s == real or s.is_relative_to(real):
            raise UserError(field, f"{out} is the source {src} or a folder holding it; "
                            "write the output somewhere else")


def foreign_entries(directory: str | os.PathLike[str], ours: Collection[str]) -> list[str]:
    """Names in ``directory`` that are not in ``ours`` (sorted; empty when it does not exist)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.name not in ours)


def refuse_foreign(directory: str | os.PathLike[str], ours: Collection[str], field: str,
                   what: str) -> None:
    """Raise a one-line UserError when ``directory`` holds anything not in ``ours``."""
    extra = foreign_entries(directory, ours)
    if extra:
        shown = ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        raise UserError(field, f"{directory} holds files that are not part of the {what} "
                        f"({shown}); they are never deleted: move them away or choose another "
                        "directory")


def _write_marker(path: Path, kind: str) -> bool:
    """Claim the folder holding ``path``: create the marker in one step, or find it there.

    The marker is created with ``O_CREAT | O_EXCL``, never through a temporary file: the
    folder goes from empty (or without a marker) to holding the marker in one atomic step, so a
    rank checking the shared run dir at any moment sees either no entry of ours or the marker
    (a temporary file of ours, seen by a rank that is checking, read as a stranger's file and
    refused the run dir). Many ranks claim the same run dir at once: the one whose create
    succeeds writes the record, the others find the marker and have nothing to do. Its
    presence is the proof; the JSON inside is for people (an empty one, from a writer killed
    between the create and the write, proves the same).

    Returns:
        True when this call created the marker.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, (json.dumps({"kind": kind, "created": dt.datetime.now(
            dt.timezone.utc).isoformat(timespec="seconds"), "pid": os.getpid()}) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    return True


def _marked(d: Path, names: Collection[str]) -> bool:
    """Whether the listing ``names`` of ``d`` holds our marker as a regular file."""
    if RUN_MARKER not in names:
        return False
    try:
        return stat.S_ISREG(os.lstat(d / RUN_MARKER).st_mode)
    except FileNotFoundError:  # listed, then gone: only ``rm`` by a person removes it
        return False


def is_run_dir(run_dir: str | os.PathLike[str], sections: Collection[str] = (),
               names: Collection[str] | None = None) -> bool:
    """Whether ``run_dir`` is a kfp-nvrx run dir.

    Proof: our marker, or (runs made before the marker existed) a config.yaml of only trainer
    ``sections`` next to ``checkpoints/`` or ``events.jsonl``. ``names``: the folder's listing
    the caller already read (the marker is looked for in that one listing, so an entry and
    the proof of it come from the same read; see :func:`check_run_dir_owned`).
    """
    d = Path(run_dir)
    if names is None:
        try:
            names = os.listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            return False
    if _marked(d, names):
        return True
    if not sections or "config.yaml" not in names or not (d / "config.yaml").is_file():
        return False
    # Runs from before the marker predate checkpoint.store: their store is the volume (and the
    # config.yaml of a stranger's folder is not read as a record here).
    if not (Path(open_store(d, DEFAULT_KIND).where).is_dir() or (d / "events.jsonl").is_file()):
        return False
    from kfp_nvrx.components.core.bounded import CONFIG_LIMIT, read_text
    from kfp_nvrx.components.core.config_text import load_yaml

    try:
        raw = load_yaml(read_text(d / "config.yaml", "run_dir", CONFIG_LIMIT), "run_dir",
                        d / "config.yaml")
    except UserError:
        return False
    return isinstance(raw, dict) and bool(raw) and set(map(str, raw)) <= set(sections)


def check_run_dir_owned(run_dir: str | os.PathLike[str], sections: Collection[str] = (),
                        field: str = "run_dir") -> None:
    """Refuse a run dir that is not new, empty or ours.

    We would overwrite its ``config.yaml`` and write checkpoints into a stranger's folder. The
    folder is listed once, and that listing says both whether it is empty and whether it holds
    our marker: ranks claim the shared run dir while others check it, and a second read could
    see entries the first did not (the claim itself is one atomic create, :func:`claim_run_dir`).
    """
    d = Path(run_dir)
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return
    if names and not is_run_dir(d, sections, names):
        raise UserError(field, f"{run_dir} is not empty and is not a kfp-nvrx run dir (no "
                        f"{RUN_MARKER}); give a new or empty directory")


def claim_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Create ``run_dir`` (parents too) and mark it ours in one atomic create; returns it.

    Every rank of a job calls this on the same shared folder (and the local launcher before
    them): one create wins, the others find the marker (see :func:`_write_marker`).
    """
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    _write_marker(d / RUN_MARKER, "run")
    return d


def reset_out_dir(out: str | os.PathLike[str], subdirs: Collection[str], field: str) -> Path:
    """Recreate ``subdirs`` of a demo/drill output folder, which must be new, empty or ours.

    Only the named subfolders are removed, and only in a folder holding :data:`OUT_MARKER`.
    """
    d = Path(out)
    check_output_dir(d, field)
    if d.is_dir() and any(d.iterdir()) and not (d / OUT_MARKER).is_file():
        raise UserError(field, f"{out} is not empty and was not made by kfp-nvrx (no "
                        f"{OUT_MARKER}); give a new or empty directory")
    d.mkdir(parents=True, exist_ok=True)
    _write_marker(d / OUT_MARKER, "out")
    for sub in subdirs:
        shutil.rmtree(d / sub, ignore_errors=True)
    return d
