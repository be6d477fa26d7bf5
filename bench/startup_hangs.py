"""Hangs in an incarnation's first steps: how long until the rank monitor sees them (issue 37).

Two runs of the shipped trainer through ``launch-local`` (one ``ft_launcher`` agent): a hang in
the fourth step of a fresh run, and a kill followed by a hang in the fifth step of the restarted
incarnation. Per fault, ``bench.recovery``'s split (fault -> the launcher's detection line ->
restart -> load -> first step) and the trainer's "hang bounds" lines.

``python -m bench.startup_hangs --preset 1b --out startup_hangs_1b.json [--budget 300]``
"""

from __future__ import annotations

import argparse
import shutil
import time
from typing import Any

from bench.common import log, start_bench, write_json
from bench.recovery import split
from bench.runs import Training, run_trainer

#: name -> faults; snapshots every 10 steps, so the restart resumes from step 30.
RUNS = {"fresh-run": ["hang@4"], "after-restart": ["kill@32", "hang@35"]}
STEPS = 60


def measure(result: dict[str, Any]) -> dict[str, Any]:
    """Per fault: the recovery split; the run's state, restarts and hang-bound lines."""
    events, lines = result["events"], result["lines"]
    faults = [i for i, e in enumerate(events) if e["type"] == "fault"]
    return {"state": result["state"], "wall_s": round(result["wall_s"], 1),
            "restarts": sum(1 for e in events if e["type"] == "restart"),
            "faults": [{"fault": f"{events[i]['kind']}@{events[i]['step']}",
                        **split(events[i:], lines, False)} for i in faults],
            "bounds": [ln[-240:] for _, ln in lines if "hang bounds" in ln][:6]}


def main(argv: list[str] | None = None) -> int:
    """Runs both runs and writes one JSON file (rewritten after each run)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="1b")
    p.add_argument("--budget", type=float, default=0, help="seconds; 0: no limit")
    args = p.parse_args(argv)
    t0 = time.time()
    work, data, res = start_bench("startup hangs", args.preset)
    for name, faults in RUNS.items():
        left = args.budget - (time.time() - t0)
        if args.budget and left < 120:
            log(f"startup hangs: {left:.0f}s left, not starting {name}")
            break
        training = Training(args.preset, [f"data.path={data}", f"train.steps={STEPS}",
                                          "checkpoint.interval=10", "checkpoint.interval_s=0",
                                          "checkpoint.keep=1", "checkpoint.save_final=false",
                                          "resilience.workers_stop_timeout=5"], faults)
        run_dir = work / name
        row = measure(run_trainer("ft", training, run_dir, timeout=left - 5 if args.budget else 600))
        shutil.rmtree(run_dir, ignore_errors=True)  # a 1b checkpoint is 13 GB; the disk is 64 GB
        res["runs"][name] = row
        log(f"startup hangs {name}: {row['state']} restarts={row['restarts']} "
            + " ".join(f"{f['fault']}: detect {f.get('detection_s')} total {f.get('total_s')}"
                       for f in row["faults"]))
        write_json(args.out, res)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
