"""``kfp-nvrx goodput``: goodput, lost work, restarts and recovery of a run, from its events."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kfp_nvrx.components.core import argtypes
from kfp_nvrx.components.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the subcommand."""
    p = sub.add_parser("goodput", help="summarise a run's events.jsonl")
    p.add_argument("--run-dir", required=True, type=argtypes.path,
                   help="run directory holding events.jsonl")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--queued", default="", metavar="START-END[,START-END...]",
                   help="waits in a queue (Unix seconds) that `kfp-nvrx launch` printed for a "
                   "run dir it could not write: kept out of the wall time, and a re-admission "
                   "after a preemption counted as none of the restarts")
    p.set_defaults(handler=_run)


def parse_waits(text: str) -> list[tuple[float, float]]:
    """``--queued``: ``START-END`` pairs of Unix seconds, comma-separated ('' is none).

    Raises:
        UserError: A pair that is not two times of a run, or ends before it starts.
    """
    from kfp_nvrx.components.core.events.schema import LATEST

    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        a, sep, b = item.partition("-")
        try:
            start, end = float(a), float(b)
        except ValueError:
            start = end = -1.0
        if not sep or not 0 <= start <= end <= LATEST:
            raise UserError("--queued", f"{item[:60]!r} is not START-END, two Unix times "
                            "(seconds) with START <= END, e.g. 1790000000.5-1790000053.2")
        out.append((start, end))
    return out


def _run(args: argparse.Namespace) -> int:
    from kfp_nvrx.components.core.events import read_events
    from kfp_nvrx.components.core.goodput import summarize_events
    from kfp_nvrx.components.core.rundir import EVENTS_FILE

    waits = parse_waits(args.queued)  # bad input is said before the run dir is read
    events_file = Path(args.run_dir) / EVENTS_FILE
    if not os.path.lexists(events_file):
        raise UserError("--run-dir", f"{args.run_dir} has no {EVENTS_FILE} (not a training run)")

    skipped: list[str] = []  # one line per bad line of events.jsonl; the report still comes
    events = read_events(args.run_dir, skipped.append)  # a FIFO or folder: refused, not read
    if not events:  # goodput 0.0 would read as a run that wasted all its time
        why = (f"{len(skipped)} damaged line(s), the first: {skipped[0]}" if skipped else
               "the run has not started training yet")
        raise UserError("--run-dir", f"{events_file} holds no events ({why}): nothing to "
                        "summarise")
    for msg in skipped:
        sys.stderr.write(f"kfp-nvrx goodput: warning: {msg}\n")
    rep = summarize_events(events, waits).to_dict()
    if args.json:
        print(json.dumps(rep, indent=2, allow_nan=False))  # strict JSON: the events hold no NaN
        return 0
    width = max(len(k) for k in rep)
    for key, value in rep.items():
        if isinstance(value, float):
            value = f"{value:.4f}"
        print(f"{key:<{width}}  {value}")
    return 0
