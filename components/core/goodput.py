"""Goodput and recovery figures computed from ``events.jsonl``.

Definitions:
- *kept* steps are the last execution of each step number (an earlier execution of the same step
  was rolled back by a restart and is *redone* work);
- goodput = time inside kept steps / wall time (first event to last event);
- lost work = time inside redone steps;
- recovery = fault (or the last step before a restart) -> first step of the next incarnation;
- checkpoint stall = sum of the blocking seconds of every save.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from kfp_nvrx.components.core.events import read_events


@dataclass
class GoodputReport:
    """Summary of one run."""

    wall_s: float = 0.0
    productive_s: float = 0.0
    goodput: float = 0.0
    steps_final: int = 0
    steps_run: int = 0
    steps_redone: int = 0
    lost_work_s: float = 0.0
    restarts: dict[str, int] = field(default_factory=dict)
    recovery_s: list[float] = field(default_factory=list)
    recovery_mean_s: float = 0.0
    recovery_max_s: float = 0.0
    checkpoint_stall_s: float = 0.0
    checkpoints: int = 0
    final_loss: float | None = None
    faults: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return asdict(self)


def _incarnation(ev: dict[str, Any]) -> tuple[int, int]:
    return int(ev.get("incarnation", 0)), int(ev.get("iteration", 0))


def summarize_events(events: list[dict[str, Any]]) -> GoodputReport:
    """Computes the report from a list of events (see :mod:`events` for the schema)."""
    rep = GoodputReport()
    if not events:
        return rep
    times = [e["time"] for e in events] + [e["end"] for e in events if e["type"] == "step"]
    rep.wall_s = max(times) - min(e.get("start", e["time"]) for e in events)
    steps = [e for e in events if e["type"] == "step"]
    last_exec: dict[int, int] = {}
    for i, e in enumerate(steps):
        last_exec[e["step"]] = i
    for i, e in enumerate(steps):
        dur = e["end"] - e["start"]
        if last_exec[e["step"]] == i:
            rep.productive_s += dur
        else:
            rep.lost_work_s += dur
            rep.steps_redone += 1
    rep.steps_run = len(steps)
    rep.steps_final = max(last_exec) if last_exec else 0
    rep.goodput = rep.productive_s / rep.wall_s if rep.wall_s > 0 else 0.0
    if steps:
        final = steps[last_exec[rep.steps_final]]
        rep.final_loss = final.get("loss")
    for e in events:
        if e["type"] == "restart":
            rep.restarts[e["kind"]] = rep.restarts.get(e["kind"], 0) + 1
        elif e["type"] == "checkpoint":
            rep.checkpoints += 1
            rep.checkpoint_stall_s += float(e.get("blocking_s", 0.0))
        elif e["type"] == "fault":
            rep.faults += 1
    rep.recovery_s = _recoveries(events)
    if rep.recovery_s:
        rep.recovery_mean_s = sum(rep.recovery_s) / len(rep.recovery_s)
        rep.recovery_max_s = max(rep.recovery_s)
    return rep


def _recoveries(events: list[dict[str, Any]]) -> list[float]:
    """Fault -> first step of the next incarnation, one figure per restart."""
    out = []
    last_fault: float | None = None
    last_step_end: float | None = None
    current: tuple[int, int] | None = None
    for e in events:
        if e["type"] == "fault":
            last_fault = e["time"] if last_fault is None else last_fault
        elif e["type"] == "step":
            inc = _incarnation(e)
            if current is not None and inc != current:
                origin = last_fault if last_fault is not None else last_step_end
                if origin is not None:
                    out.append(round(e["end"] - origin, 3))
                last_fault = None
            current = inc
            last_step_end = e["end"]
    return out


def summarize(run_dir: str | os.PathLike) -> GoodputReport:
    """Reads ``<run_dir>/events.jsonl`` and summarises it."""
    return summarize_events(read_events(run_dir))
