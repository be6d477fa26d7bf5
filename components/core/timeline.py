"""A ``checkpoint.load_step`` rollback: the steps after it leave the run's timeline, for good.

A start with ``checkpoint.load_step=N`` in a run dir holding newer commits trains a new timeline
from N. Those newer commits belong to the timeline it abandons: a later start (an in-job restart,
which takes the newest commit, or the next launch without ``load_step``, as the README advises)
must never resume them. So the rollback moves them out of the way, into
``checkpoints/abandoned-<N>-<time>/`` (kept, not deleted: they are the user's work; delete the
folder when it is not needed), and it does so crash-safely: a journal (``ROLLBACK.json``, written
atomically first) lists the steps, :func:`committed_steps` never reports a step the journal lists,
and any later start finishes an interrupted move (:func:`finish_rollback`) before it reads the
checkpoints. Part of the volume store (:mod:`.volume_store`: its listing of committed steps and
its ``withdraw_newer``); nothing else imports it. Imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from kfp_nvrx.components.core.atomic import refuse_link, write_atomic
from kfp_nvrx.components.core.bounded import read_json
from kfp_nvrx.components.core.volume_layout import COMMIT_MARKER, parse_step, step_dir
from kfp_nvrx.components.errors import UserError

ROLLBACK_FILE = "ROLLBACK.json"
ABANDONED_PREFIX = "abandoned-"


def _journal(root: Path) -> dict | None:
    path = root / ROLLBACK_FILE
    if not os.path.lexists(path):
        return None
    try:
        data = read_json(path, "checkpoint")
    except UserError:
        return None
    ok = (isinstance(data, dict) and isinstance(data.get("steps"), list)
          and isinstance(data.get("into"), str) and data["into"].startswith(ABANDONED_PREFIX)
          and "/" not in data["into"])
    return data if ok else None


def abandoned_steps(root: Path) -> set[int]:
    """Steps a pending rollback journal lists (not part of the run's timeline)."""
    journal = _journal(root)
    return {int(s) for s in journal["steps"] if isinstance(s, int)} if journal else set()


def committed_steps(root: Path) -> list[int]:
    """Steps whose directory holds a commit marker, newest first, minus abandoned ones."""
    if not root.is_dir():
        return []
    gone = abandoned_steps(root)
    steps = [parse_step(p.name) for p in root.iterdir() if (p / COMMIT_MARKER).is_file()]
    return sorted((s for s in steps if s is not None and s not in gone), reverse=True)


def roll_back(root: Path, to: int) -> tuple[list[int], Path | None]:
    """Moves the commits newer than ``to`` out of the timeline (rank 0, before a resume).

    Returns:
        The steps moved (newest first) and the folder they went to (None when nothing moved).
    """
    finish_rollback(root)
    newer = [s for s in committed_steps(root) if s > to]
    if not newer:
        return [], None
    into = f"{ABANDONED_PREFIX}{to:08d}-{time.strftime('%Y%m%dT%H%M%S')}"
    refuse_link(root / ROLLBACK_FILE, root.parent, field="checkpoint")
    write_atomic(root / ROLLBACK_FILE, json.dumps({"to": to, "steps": newer, "into": into}))
    finish_rollback(root)
    return newer, root / into


def finish_rollback(root: Path) -> None:
    """Completes an interrupted rollback: moves the listed steps, then drops the journal."""
    journal = _journal(root)
    if journal is None:
        return
    into = root / journal["into"]
    refuse_link(into, root.parent, field="checkpoint")
    into.mkdir(exist_ok=True)
    for step in journal["steps"]:
        src = step_dir(root, int(step))
        if os.path.lexists(src) and not src.is_symlink():
            os.replace(src, into / src.name)
    with contextlib.suppress(FileNotFoundError):
        (root / ROLLBACK_FILE).unlink()
