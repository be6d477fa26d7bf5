"""Goodput and recovery figures computed from ``events.jsonl``.

Definitions:
- *kept* steps are the last execution of each step number (an earlier execution of the same step
  was rolled back by a restart and is *redone* work);
- goodput = time inside kept steps / wall time (first event to last event);
- lost work = time inside redone steps;
- recovery = fault (or the last step before a restart) -> first step of the next incarnation;
- checkpoint stall = sum of the blocking seconds of every save;
- what happened = one sentence per restart: the fault (or failure), where training resumed, how
  long recovery took and how many steps were redone (:func:`narrate`).
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
    what_happened: list[str] = field(default_factory=list)

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
    rep.what_happened = narrate(events)
    return rep


#: How a fault kind reads in a sentence ("rank 1 killed at step 20").
_FAULT_VERBS = {"kill": "killed", "raise": "raised an exception", "hang": "hung",
                "kill-in-ckpt": "killed while checkpointing", "stall": "stalled"}


def narrate(events: list[dict[str, Any]]) -> list[str]:
    """Return one sentence per restart.

    E.g. "rank 1 killed at step 20, resumed from step 10 in 4.1 s, 9 steps redone": redone counts
    the stopped incarnation's executions past the resumed step (as ``steps_redone`` does),
    recovery runs from the fault (or the last step) to the next incarnation's first step.
    """
    out: list[str] = []
    fault: dict[str, Any] | None = None
    current: tuple[int, int] | None = None
    done: list[int] = []  # steps the current incarnation executed
    last_end: float | None = None
    pending: dict[str, Any] | None = None  # a restart waiting for its first step (recovery)
    for e in events:
        if e["type"] == "fault" and fault is None:
            fault = e
        elif e["type"] == "start":
            inc = _incarnation(e)
            if current is not None and inc != current:
                if fault is not None:
                    rank = f"rank {fault['rank']}" if fault.get("rank") is not None else "a rank"
                    what = (f"{rank} {_FAULT_VERBS.get(fault['kind'], fault['kind'] + ' fault')}"
                            f" at step {fault['step']}")
                else:
                    what = f"workers failed after step {max(done, default=0)}"
                base = e.get("resumed_from")
                where = "restarted from scratch" if base is None else f"resumed from step {base}"
                if e.get("from_memory"):
                    where += " (host memory)"
                redone = sum(1 for s in done if s > (base or 0))
                origin = fault["time"] if fault is not None else last_end
                pending = {"text": f"{what}, {where}", "origin": origin,
                           "redone": f"{redone} step{'s' if redone != 1 else ''} redone"}
                fault, done = None, []
            current = inc
        elif e["type"] == "step":
            if current is None or _incarnation(e) != current:  # a log without start events
                current, done = _incarnation(e), []
            if pending is not None:
                took = ("" if pending["origin"] is None
                        else f" in {e['end'] - pending['origin']:.1f} s")
                out.append(f"{pending['text']}{took}, {pending['redone']}")
                pending = None
            done.append(int(e["step"]))
            last_end = e["end"]
    if pending is not None:
        out.append(f"{pending['text']}, {pending['redone']}")
    return out


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
