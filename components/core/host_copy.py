"""Where a run's node-local host copy lives (torch-free, for the trainer and the fault drills).

The trainer keeps the newest snapshots of each rank in files under
``/dev/shm/kfp-nvrx-<uid>/<run key>/`` (see ``trainer.checkpoint.hostcopy``); the run key is the
hash of the run directory's absolute path, so every worker of a run on a node finds the same one.
Where several simulated nodes share one machine's ``/dev/shm`` (the local launcher's agents, the
test cluster's nodes), each is given a name in :data:`NODE_ENV` and keeps its files in a folder of
its own under the run's, ``node-<name>/``: what one node loses, the others still hold.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
from pathlib import Path

SHM_ROOT = Path("/dev/shm")
#: The name of this (simulated) node's host memory, where several share one machine.
NODE_ENV = "KFP_NVRX_HOST_NODE"
_NODE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,63}$")


def node_name(env: dict[str, str] | None = None) -> str:
    """This node's name from :data:`NODE_ENV` ('' for a real node: its own ``/dev/shm``).

    A name that is not a plain file-name word ('..', a slash) names no folder of ours: ''.
    """
    name = (os.environ if env is None else env).get(NODE_ENV, "")
    return name if _NODE_NAME.match(name) and name not in (".", "..") else ""


#: Linux's largest pid (``PID_MAX_LIMIT``, 2^22): a bigger number in a record names no process
#: (``os.kill`` would raise OverflowError on one past a C int).
PID_MAX = 4_194_304


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts as alive)."""
    if not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def host_copy_base(root: Path = SHM_ROOT) -> Path:
    """This user's directory of host copies."""
    return Path(root) / f"kfp-nvrx-{os.getuid()}"


def host_copy_dir(run_dir: str | os.PathLike, root: Path = SHM_ROOT) -> Path:
    """The host copy directory of the run in ``run_dir``."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return host_copy_base(root) / key


def node_copy_dir(run_dir: str | os.PathLike, node: str, root: Path = SHM_ROOT) -> Path:
    """The folder of one node's files in the run's host copy (the run's own for node '')."""
    run = host_copy_dir(run_dir, root)
    return run / f"node-{node}" if node else run


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


def node_workers(folder: Path) -> set[int]:
    """The worker processes whose owner records are in a node's host copy ``folder``.

    Only from a private directory of ours (a record elsewhere names nobody we may signal).
    """
    from kfp_nvrx.components.core.bounded import JSON_LIMIT, parse_json, read_bytes
    from kfp_nvrx.components.errors import UserError

    try:
        private_dir(folder, create=False)
    except HostCopyUnavailable:
        return set()
    pids = set()
    for record in folder.glob("rank*.owner"):
        try:
            owner = parse_json(read_bytes(record, "faults", JSON_LIMIT, "owner record"), "faults",
                               record)
        except (OSError, UserError):
            continue
        pid = owner.get("pid") if isinstance(owner, dict) else None
        if type(pid) is int and 0 < pid <= PID_MAX:
            pids.add(pid)
    return pids
