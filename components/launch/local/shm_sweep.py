"""What a run killed whole (its launcher and its watchdog SIGKILLed) left in /dev/shm and /tmp.

A local run's launcher removes the run's host copy and the semaphores its processes leaked
(:mod:`kfp_nvrx.components.core.shm_leftovers`) when it ends; its watchdog does when the launcher
dies. When both are SIGKILLed (an OOM killer, ``kill -9`` of the process group) nobody does: the
host copy (up to two banks of each rank's state), every ``sem.mp-*`` the killed processes made,
and the launcher's stop folder in /tmp (with the snapshot of /dev/shm taken at the run's start)
stay. The next owner is the next launch of that run dir: it holds the run dir's lock, so no
launcher, watchdog or agent of that run lives, and :func:`~.lifetime.stop_leftovers` has ended
the run's last processes; the run's lock record names its stop folder (:func:`sweep_previous`).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.host_copy import remove_run_copy
from kfp_nvrx.components.core.shm_leftovers import read_snapshot, remove_new_semaphores

#: How the launcher names its stop folder in the temporary directory (``tempfile.mkdtemp``).
STOPS_PREFIX = "kfp-nvrx-stop-"
#: The file in it that holds the /dev/shm snapshot of the run's start.
SNAPSHOT_FILE = "shm-before.json"


def stops_folder(previous: Mapping[str, Any]) -> Path | None:
    """The stop folder the run before recorded, when it is one of ours still there.

    The record is in the run dir, which others may write: only a real folder of this user,
    directly in this machine's temporary directory and named as the launcher names it, is
    taken (never a link): anything else is no stop folder, and nothing in it is touched.
    """
    path = previous.get("stops")
    if not isinstance(path, str) or previous.get("host") != socket.gethostname():
        return None
    return Path(path) if is_stops_folder(Path(path)) else None


def is_stops_folder(folder: Path) -> bool:
    """A real folder of this user, in the temporary directory, named as the launcher names it."""
    if folder.parent != Path(tempfile.gettempdir()) or not folder.name.startswith(STOPS_PREFIX):
        return False
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def remove_stops_folder(folder: Path) -> None:
    """Deletes a stop folder (nothing that is not one: :func:`is_stops_folder`)."""
    if is_stops_folder(folder):
        shutil.rmtree(folder, ignore_errors=True)  # rmtree never follows a link inside


def sweep_previous(previous: Mapping[str, Any], run_dir: str | os.PathLike[str]) -> str:
    """Removes what the run before left, if it was killed whole; says what ('' for nothing).

    Call it holding the run dir's lock, after :func:`~.lifetime.stop_leftovers`: every process
    of that run is gone. Its stop folder is still there only when neither its launcher nor its
    watchdog finished (each removes it, or the launcher does after the watchdog's sweep).
    """
    folder = stops_folder(previous)
    if folder is None:
        return ""
    before = read_snapshot(folder / SNAPSHOT_FILE)
    copy = remove_run_copy(run_dir)
    sems = remove_new_semaphores(before) if before is not None else []
    remove_stops_folder(folder)
    parts = (["its host copy"] if copy else []) + (
        [f"{len(sems)} leaked semaphore(s)"] if sems else [])
    return " and ".join(parts)
