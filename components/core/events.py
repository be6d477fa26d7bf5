"""Run events: one JSON object per line in ``<run_dir>/events.jsonl``.

Types and their fields (every line also has ``type`` and ``time``, Unix seconds):
``start`` (incarnation, iteration, world_size, resumed_from, load_s; ``layer`` = the restart's
kind when it is one), ``step`` (step, start, end,
incarnation, iteration, loss, tokens), ``checkpoint`` (step, blocking_s, total_s, bytes),
``fault`` (kind, step, rank), ``restart`` (kind ``in-job``/``in-process``/``pod``, incarnation,
iteration),
``end`` (step, status). Rank 0 writes everything except ``fault``, which the faulting rank writes.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.bounded import EVENT_LINE_LIMIT, EVENTS_LIMIT, iter_lines
from kfp_nvrx.components.core.rundir import EVENTS_FILE


class EventLog:
    """Appends events; each line is written with one ``write`` call on an O_APPEND file.

    The file is opened with ``O_NOFOLLOW``: an ``events.jsonl`` that is a symbolic link (out of
    the run dir) is never written through. Numbers that are not finite (a diverged loss) are
    written as ``null``: ``NaN`` is no JSON, and every reader after us would choke on it.
    """

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.enabled = enabled

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        """Writes one event and returns it."""
        event = {"type": type_, "time": fields.pop("time", time.time()), **fields}
        if self.enabled:
            line = (json.dumps(_finite(event), separators=(",", ":")) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return event


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (nested dicts and lists too)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


#: Fields each event type must carry as numbers for the readers (goodput, timeline) to use it.
_NUMERIC = {"step": ("step", "start", "end"), "checkpoint": ("step",)}
#: Fields that, when present, must be numbers (the readers do arithmetic on them).
_OPTIONAL_NUMERIC = ("incarnation", "iteration", "world_size", "blocking_s", "total_s", "bytes",
                     "tokens", "load_s")
#: Fields that may also be null.
_NULLABLE_NUMERIC = ("resumed_from", "rank", "loss")
#: Fields that count (steps, restarts, ranks): whole numbers; -1 is "no rank" (a drill's fault).
_COUNTS = ("step", "incarnation", "iteration", "world_size", "resumed_from", "rank")
#: Fields that are Unix times: 0 .. 2100-01-01 (a time of -1e18 or 1e300 is damage, not a run).
_TIMES = ("time", "start", "end")
_LATEST = 4_102_444_800.0
#: Seconds an event may lie before the latest one already read before it is reported out of
#: order (ranks write their own lines, a moment apart). ``start`` events carry the time their
#: incarnation began, before the lines its set-up wrote: they are exempt.
_ORDER_SLACK_S = 1.0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def event_problem(event: Any) -> str | None:
    """What makes ``event`` unusable for the readers (goodput, timeline), or None."""
    if not isinstance(event, dict):
        return f"a JSON {type(event).__name__}, not an event object"
    if not isinstance(event.get("type"), str):
        return "no event type"
    need = ("time", *_NUMERIC.get(event["type"], ()))
    for key in need:
        if key not in event or event[key] is None:
            return f"no {key}"
    for key in (*need, *_OPTIONAL_NUMERIC, *_NULLABLE_NUMERIC):
        value = event.get(key)
        if key not in event or (value is None and key in _NULLABLE_NUMERIC):
            continue
        if not _is_number(value):
            return f"{key} is {type(value).__name__} {str(value)[:40]!r}, not a number"
        if not math.isfinite(value):
            if key == "loss":
                continue  # a diverged loss is a fact of the run; reported as null
            return f"{key} is {value}, not a finite number"
    for key in _TIMES:
        if key in event and not 0 <= event[key] <= _LATEST:
            return f"{key} {event[key]:g} is no time of a run (Unix seconds up to 2100)"
    for key in _COUNTS:
        value = event.get(key)
        if value is not None and (value != int(value) or not -1 <= value <= 2**31 - 1):
            return f"{key} {value:g} is no count of a run (a whole number below 2^31)"
    if event["type"] == "step" and event["end"] < event["start"]:
        return "step ends before it starts"
    if event["type"] in ("restart", "fault") and not isinstance(event.get("kind"), str):
        return "no kind"
    return None


def _usable(event: Any) -> bool:
    """A well-formed event: see :func:`event_problem`."""
    return event_problem(event) is None


def _order_key(event: dict[str, Any]) -> float:
    """When an event happened: a step's start, any other event's time."""
    return float(event["start"] if event["type"] == "step" else event["time"])


def read_events(run_dir: str | os.PathLike,
                warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """All well-formed events of a run, in time order.

    Read line by line with a cap per line and in all (:mod:`.bounded`). A line that is not a
    usable event (torn by a killed writer, edited, damaged, not UTF-8, NaN or a string where a
    number belongs, a time no run has) is skipped with one ``warn`` line naming it; a line out of
    time order is reported and put in its place (stable sort by when each event happened).
    """
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    say = warn or (lambda _msg: None)
    events: list[dict[str, Any]] = []
    latest, disordered = -math.inf, False
    for lineno, raw in enumerate(iter_lines(path, "--run-dir", EVENT_LINE_LIMIT, EVENTS_LIMIT),
                                 start=1):
        if raw is not None and not raw.strip():
            continue
        if raw is None:
            problem = f"longer than {EVENT_LINE_LIMIT >> 10} KiB"
        else:
            try:
                event = json.loads(raw.decode("utf-8", errors="strict"))
                problem = event_problem(event)
            except (ValueError, RecursionError) as err:
                problem = f"not JSON ({' '.join(str(err).split())[:80]})"
        if problem is not None:
            say(f"{path} line {lineno}: {problem}; skipped")
            continue
        if event.get("loss") is not None and not math.isfinite(event["loss"]):
            event["loss"] = None
        key = _order_key(event)
        if event["type"] != "start" and key < latest - _ORDER_SLACK_S:
            say(f"{path} line {lineno}: {event['type']} at {key:.3f} is {latest - key:.1f} s "
                "before an earlier line; taken in time order")
            disordered = True
        latest = max(latest, key)
        events.append(event)
    if disordered:
        events.sort(key=_order_key)
    return events
