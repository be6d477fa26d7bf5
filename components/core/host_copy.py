"""Where a run's node-local host copy lives (torch-free, for the trainer and the fault drills).

The trainer keeps the newest committed state of each rank in files under
``/dev/shm/kfp-nvrx-<uid>/<run key>/`` (see ``trainer.checkpoint.hostcopy``); the run key is the
hash of the run directory's absolute path, so every worker of a run on a node finds the same one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

SHM_ROOT = Path("/dev/shm")


def host_copy_base(root: Path = SHM_ROOT) -> Path:
    """This user's directory of host copies."""
    return Path(root) / f"kfp-nvrx-{os.getuid()}"


def host_copy_dir(run_dir: str | os.PathLike, root: Path = SHM_ROOT) -> Path:
    """The host copy directory of the run in ``run_dir``."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return host_copy_base(root) / key


class HostCopyUnavailable(RuntimeError):
    """The host copy directory cannot be used (missing, not ours, or open to others)."""


def private_dir(path: Path, create: bool = True) -> None:
    """``path`` is a real directory of this user closed to others (created 0700 if ``create``)."""
    try:
        if create:
            path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
    except OSError as err:
        raise HostCopyUnavailable(f"{path}: {err}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise HostCopyUnavailable(f"{path} is not a private directory of this user "
                                  f"(uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})")


def remove_copy(d: Path) -> bool:
    """Deletes host copy directory ``d`` when it and the base holding it are private and ours.

    Both are checked (never following a link): a private ``d`` under a linked base would be a
    folder somewhere else.
    """
    try:
        private_dir(d.parent, create=False)
        private_dir(d, create=False)
    except HostCopyUnavailable:
        return False
    shutil.rmtree(d, ignore_errors=True)  # rmtree never follows links inside
    return not d.exists()


def remove_run_copy(run_dir: str | os.PathLike[str], root: Path = SHM_ROOT) -> bool:
    """Deletes a run's host copy on this machine (its launcher, when the run is over)."""
    base = host_copy_base(root)
    try:
        private_dir(base, create=False)
    except HostCopyUnavailable:
        return False
    d = host_copy_dir(run_dir, root)
    return os.path.lexists(d) and remove_copy(d)
