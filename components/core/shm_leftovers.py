"""What a local run leaves in ``/dev/shm`` is removed with the run: host copies and semaphores.

Python's ``multiprocessing`` (NVRx's checkpoint writer processes, ft_launcher's rank monitors,
torch) creates a named POSIX semaphore (``/dev/shm/sem.mp-<random>``) for each lock, queue and
event, and unlinks it when its creator finalizes, or its ``resource_tracker`` does at exit. A
run whose processes are SIGKILLed (a fault drill, a stopped run's stragglers, the watchdog's
last resort) kills the trackers too: the names stay, 19 per faulted run, until reboot (57 after
13 runs on the GPU machine).

Which names a run made is not written in them, so they are known by what is true of the run's
leftovers once every process of the run is gone (the local launcher and its watchdog hold the
run dir's lock: none of them lives): a semaphore name of this user that was not in ``/dev/shm``
when the run started (:func:`snapshot`) and that no live process has mapped (a semaphore in use
is mapped by every process using it: ``/proc/<pid>/maps``, by inode) is one nobody can be using: the
run's. A pod's ``/dev/shm`` goes with the pod; this is for ``launch-local``.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from kfp_nvrx.components.core.host_copy import SHM_ROOT, remove_run_copy

#: How ``multiprocessing`` names its semaphores in ``/dev/shm`` (``/mp-XXXXXXXX``, ``sem.`` added).
SEM_PREFIX = "sem.mp-"
#: Bytes read of one process's memory map (a big one lists some 10^4 mappings, ~1 MiB).
MAPS_LIMIT = 8 << 20


def semaphores(root: Path = SHM_ROOT) -> set[str]:
    """Names of this user's ``multiprocessing`` semaphores in ``root`` (regular files only)."""
    out: set[str] = set()
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in names:
        if not name.startswith(SEM_PREFIX):
            continue
        try:
            st = os.lstat(root / name)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            out.add(name)
    return out


def mapped(root: Path = SHM_ROOT) -> set[int]:
    """Inodes of the semaphore files some live process has mapped (all we may read of /proc).

    By inode, not by name: glibc's ``sem_open`` maps a temporary file (``sem.XXXXXX``) and then
    links it under the semaphore's name, so a map names the temporary file ``(deleted)``.
    """
    prefix = f"{root}/sem.".encode()
    out: set[int] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", "rb") as fh:
                text = fh.read(MAPS_LIMIT)
        except OSError:
            continue  # gone, or another user's
        for line in text.splitlines():
            fields = line.split(None, 5)  # address perms offset dev inode path
            if len(fields) == 6 and fields[5].startswith(prefix) and fields[4].isdigit():
                out.add(int(fields[4]))
    return out


def snapshot(path: Path, root: Path = SHM_ROOT) -> None:
    """Records which semaphores exist before the run starts (read by :func:`read_snapshot`)."""
    path.write_text(json.dumps(sorted(semaphores(root))))


def read_snapshot(path: str | os.PathLike[str]) -> set[str] | None:
    """The names :func:`snapshot` recorded; None when it cannot be read (nothing is removed)."""
    try:
        names = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else None


def remove_new_semaphores(before: set[str], root: Path = SHM_ROOT) -> list[str]:
    """Unlinks this user's semaphores made since ``before`` that no live process maps.

    Call it once every process of the run is gone (see the module docstring).

    Returns:
        The names removed.
    """
    removed = []
    in_use = mapped(root)
    for name in sorted(semaphores(root) - before):
        path = root / name
        try:
            if os.lstat(path).st_ino in in_use:
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(name)
    return removed


def sweep_run(run_dir: str | os.PathLike[str], before: set[str] | None,
              root: Path = SHM_ROOT) -> None:
    """The run's host copy and its leaked semaphores (``before``: the start's snapshot)."""
    remove_run_copy(run_dir, root)
    if before is not None:
        remove_new_semaphores(before, root)
