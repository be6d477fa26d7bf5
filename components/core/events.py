"""Run events: one JSON object per line in ``<run_dir>/events.jsonl``.

Types and their fields (every line also has ``type`` and ``time``, Unix seconds):
``start`` (incarnation, iteration, world_size, resumed_from, load_s), ``step`` (step, start, end,
incarnation, iteration, loss, tokens), ``checkpoint`` (step, blocking_s, total_s, bytes),
``fault`` (kind, step, rank), ``restart`` (kind ``in-job``/``in-process``, incarnation, iteration),
``end`` (step, status). Rank 0 writes everything except ``fault``, which the faulting rank writes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.rundir import EVENTS_FILE


class EventLog:
    """Appends events; each line is written with one ``write`` call on an O_APPEND file."""

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.enabled = enabled

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        """Writes one event and returns it."""
        event = {"type": type_, "time": fields.pop("time", time.time()), **fields}
        if self.enabled:
            line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return event


#: Fields each event type must carry as numbers for the readers (goodput, timeline) to use it.
_NUMERIC = {"step": ("step", "start", "end"), "checkpoint": ("step",)}


def _usable(event: Any) -> bool:
    """A well-formed event: an object with a string type, a numeric time and its type's fields."""
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        return False
    need = ("time", *_NUMERIC.get(event["type"], ()))
    if any(isinstance(event.get(k), bool) or not isinstance(event.get(k), (int, float))
           for k in need):
        return False
    return event["type"] != "restart" or isinstance(event.get("kind"), str)


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All well-formed events of a run in file order.

    A torn last line (killed writer) and any line that is not a usable event (edited, damaged,
    not UTF-8) are skipped, so the readers never trip over the file.
    """
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    events = []
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if _usable(event):
            events.append(event)
    return events
