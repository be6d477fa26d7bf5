"""Reading events back: each line checked against the schema, the run put in time order."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.bounded import EVENT_LINE_LIMIT, EVENTS_LIMIT, iter_lines
from kfp_nvrx.components.core.events.schema import (
    ANY,
    COUNT,
    LATEST,
    LOSS,
    TEXT,
    TIME,
    TYPES,
    Event,
    Other,
    Queued,
    Start,
    Step,
)
from kfp_nvrx.components.core.rundir import EVENTS_FILE

#: Seconds an event may lie before the latest one read so far without being reported out of order
#: (ranks write their own lines, a moment apart). A start carries the time its incarnation began,
#: before the lines its set-up wrote: it is exempt.
_ORDER_SLACK_S = 1.0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(name: str, kind: str, value: Any) -> str | None:
    """What is wrong with ``value`` of a field of ``kind``, or None."""
    if kind == TEXT:
        return None if isinstance(value, str) else f"no {name}"
    if kind == ANY:
        return None
    if not _is_number(value):
        return f"{name} is {type(value).__name__} {str(value)[:40]!r}, not a number"
    if not math.isfinite(value):
        # A diverged loss is a fact of the run (read as None); anything else is damage.
        return None if kind == LOSS else f"{name} is {value}, not a finite number"
    if kind == TIME and not 0 <= value <= LATEST:
        return f"{name} {value:g} is no time of a run (Unix seconds up to 2100)"
    if kind == COUNT and (value != int(value) or not -1 <= value <= 2**31 - 1):
        # -1 is "no rank" (a drill's fault).
        return f"{name} {value:g} is no count of a run (a whole number below 2^31)"
    return None


def parse_event(obj: Any) -> Event:
    """The typed event of one decoded line.

    Raises:
        ValueError: What makes the line unusable for the readers (goodput, timeline): no type or
            time, a required field missing, a string or a time no run has where a number belongs.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an event object")
    if not isinstance(obj.get("type"), str):
        raise ValueError("no event type")
    cls = TYPES.get(obj["type"], Other)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "unnamed":
            continue
        value = obj.get(f.name)
        if value is None:
            if f.metadata["required"]:
                raise ValueError(f"no {f.name}")
            continue  # absent or null: the field's default
        problem = _check(f.name, f.metadata["kind"], value)
        if problem:
            raise ValueError(problem)
        if f.metadata["kind"] == LOSS and not math.isfinite(value):
            value = None
        values[f.name] = value
    event = cls(**values, unnamed={k: v for k, v in obj.items() if k not in values
                                   and k not in ("type", "time") and not hasattr(cls, k)})
    if isinstance(event, (Step, Queued)) and event.end < event.start:
        raise ValueError(f"{obj['type']} ends before it starts")
    return event


def in_time_order(events: Iterable[Event],
                  disorder: Callable[[int, Event, float], None] | None = None) -> list[Event]:
    """``events`` in the order they happened (stable), each one out of order reported.

    Args:
        events: Events in the order they were written.
        disorder: Called with (index, event, seconds it lies before an earlier one).
    """
    out, latest, disordered = list(events), -math.inf, False
    for i, event in enumerate(out):
        if isinstance(event, Queued):
            # The launcher's line, written when it learns of a wait, while a rank's step (logged
            # at its end, timed from its start) may be under way: no order to keep with those.
            continue
        if not isinstance(event, Start) and event.when < latest - _ORDER_SLACK_S:
            disordered = True
            if disorder is not None:
                disorder(i, event, latest - event.when)
        latest = max(latest, event.when)
    if disordered:
        out.sort(key=lambda e: e.when)
    return out


def parse_events(objs: Iterable[Mapping[str, Any]]) -> list[Event]:
    """Typed events, in time order, of decoded lines held in memory (tests, summaries).

    Raises:
        ValueError: One of them is no usable event (see :func:`parse_event`).
    """
    return in_time_order(parse_event(dict(obj)) for obj in objs)


def read_events(run_dir: str | os.PathLike,
                warn: Callable[[str], None] | None = None) -> list[Event]:
    """All well-formed events of a run, in time order.

    Read line by line with a cap per line and in all (:mod:`.bounded`); no file is no events,
    anything but a regular file (a FIFO, a device, a folder) is refused. A line that is not a
    usable event (torn by a killed writer, edited, damaged, not UTF-8, NaN or a string where a
    number belongs, a time no run has) is skipped with one ``warn`` line naming it; a line out of
    time order is reported and put in its place (stable sort by when each event happened).
    """
    path = Path(run_dir) / EVENTS_FILE
    if not os.path.lexists(path):
        return []
    say = warn or (lambda _msg: None)
    events: list[Event] = []
    lines: list[int] = []
    # A FIFO, device or folder in its place is refused by iter_lines (UserError naming run_dir),
    # never waited on: "no events" would hide a run dir someone tampered with.
    for lineno, raw in enumerate(iter_lines(path, "run_dir", EVENT_LINE_LIMIT, EVENTS_LIMIT),
                                 start=1):
        if raw is not None and not raw.strip():
            continue
        try:
            if raw is None:
                raise ValueError(f"longer than {EVENT_LINE_LIMIT >> 10} KiB")
            try:
                obj = json.loads(raw.decode("utf-8", errors="strict"))
            except (ValueError, RecursionError) as err:
                raise ValueError(f"not JSON ({' '.join(str(err).split())[:80]})") from None
            events.append(parse_event(obj))
            lines.append(lineno)
        except ValueError as err:
            say(f"{path} line {lineno}: {err}; skipped")

    def disorder(i: int, event: Event, early: float) -> None:
        say(f"{path} line {lines[i]}: {event.to_dict()['type']} at {event.when:.3f} is "
            f"{early:.1f} s before an earlier line; taken in time order")

    return in_time_order(events, disorder)
