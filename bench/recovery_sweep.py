"""Recovery as a user meets it: every fault kind at fault steps spread over long runs.

``bench.recovery`` times one geometry per fault kind; a figure that holds only there is not met.
This sweep draws, from a recorded seed, several fault steps per kind spread over a run of at least
``min_steps`` steps, with saves at a realistic interval and at least ``lead`` steps after every
restart (so a start-up stall of the restarted worker, or its next save, happens inside the run),
plus a two-fault run (a kill, then a hang that the restarted worker's own learned timeouts must
catch). Per run it reports the state, restarts against faults, the worst recovery (fault -> end
of the next step, split as ``bench.recovery`` splits it), hang detection, the steps redone, where
the state came from (host memory, disk, or nothing) and the save -> commit lag.

``python -m bench.recovery_sweep --preset 1b --out recovery_sweep_1b.json [--seed 29]
[--only kill,hang] [--budget 560] [--skip-runs N] [--max-runs N] [--pick 6,3] [--set k=v]``: runs stop
being started when fewer than ``--budget`` seconds would be left for one, or after ``--max-runs``;
the JSON is rewritten after every run, so a sweep split over several machine leases is merged from
its parts (``--merge``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import log, machine_info, make_dataset, newest_step_done, write_json
from bench.recovery import _DETECT, split
from bench.runs import Training, run_trainer

#: Per preset: checkpoint interval, steps after every restart, least run length, where hangs may
#: start (after the first incarnation learned its timeouts), the expected seconds of one run.
PRESETS = {
    "1b": {"interval": 40, "lead": 60, "min_steps": 100, "hang_from": 45, "run_s": 105},
    "125m": {"interval": 20, "lead": 60, "min_steps": 100, "hang_from": 30, "run_s": 45},
    "tiny": {"interval": 10, "lead": 60, "min_steps": 100, "hang_from": 20, "run_s": 60},
}
KINDS = {
    "kill": {"set": [], "layer": "in-job"},
    "hang": {"set": [], "layer": "in-job"},
    "raise": {"set": ["resilience.in_process=true"], "layer": "in-process"},
    "kill-in-ckpt": {"set": [], "layer": "in-job"},
}

#: Per fault, the recovery's parts kept in the report (``bench.recovery.split``'s names).
SPLIT_KEYS = ("total_s", "detection_s", "launcher_s", "start_s", "load_s", "first_step_s",
              "from_memory", "resumed_from", "error")

#: Planned runs with a geometry of their own rather than steps drawn per kind (:func:`plan`).
OWN_GEOMETRY_KINDS = ("kill+hang", "hang-start", "kill+hang-restart")


def plan(preset: str, seed: int, per_kind: int, kinds: list[str]) -> list[dict[str, Any]]:
    """The runs: ``per_kind`` fault steps per kind, one drawn from each of equal strata.

    In round-robin order (one run of each kind, the two-fault run, then the next of each), so
    that a sweep cut short by its budget still samples every kind; ``index`` is that order.
    """
    p = PRESETS[preset]
    rng = random.Random(seed)
    by_kind: list[list[dict[str, Any]]] = []
    for kind in kinds:
        if kind == "kill-in-ckpt":  # a save step: its write is in flight when the kill lands
            saves = list(range(p["interval"], 4 * p["interval"] + 1, p["interval"]))
            steps = sorted(rng.sample(saves, min(per_kind, len(saves))))
            steps += [rng.choice(saves) for _ in range(per_kind - len(steps))]
        else:
            low = p["hang_from"] if kind == "hang" else 5
            high = max(low + per_kind, p["min_steps"] - 10)
            width = (high - low) / per_kind
            steps = [int(low + i * width + rng.random() * width) for i in range(per_kind)]
        by_kind.append([{"kind": kind, "faults": [f"{kind}@{s}"], "fault_steps": [s]}
                        for s in steps])
    first = rng.randrange(5, p["interval"] * 2)
    second = first + p["lead"] + rng.randrange(0, p["interval"])
    two = {"kind": "kill+hang", "faults": [f"kill@{first}", f"hang@{second}"],
           "fault_steps": [first, second]}
    runs = [run for i in range(per_kind) for runs_of in by_kind for run in runs_of[i:i + 1]]
    runs[len(by_kind):len(by_kind)] = [two, *_start_up_hangs(p["interval"], rng)]
    for i, run in enumerate(runs):
        run["steps"] = max(p["min_steps"], max(run["fault_steps"]) + p["lead"])
        run["index"] = i
    return runs


def _start_up_hangs(interval: int, rng: random.Random) -> list[dict[str, Any]]:
    """Issue 37: a hang in a run's first 10 steps, and one within 10 steps after a restart.

    The kill lands 3-5 steps past the first snapshot, once its copies (beside the next step) are
    done and it is sealed: a kill as the step after a snapshot begins resumes from the snapshot
    before (1b on an H100: a kill at 62 resumed from 44, not 61). The restart resumes from that
    first snapshot and the hang comes 4-10 steps into the restarted incarnation.
    """
    early = rng.randint(3, 10)
    kill = interval + rng.randint(3, 5)
    hang = rng.randint(kill + 1, interval + 10)
    return [{"kind": "hang-start", "faults": [f"hang@{early}"], "fault_steps": [early]},
            {"kind": "kill+hang-restart", "faults": [f"kill@{kill}", f"hang@{hang}"],
             "fault_steps": [kill, hang]}]


def _steps_redone(events: list[dict[str, Any]]) -> list[int]:
    """Per restart: the newest step completed before it minus the step it resumed from."""
    out = []
    for i, start in enumerate(e for e in events if e["type"] == "start"):
        if i == 0:
            continue
        out.append(newest_step_done(events, start["time"]) - (start.get("resumed_from") or 0))
    return out


def _per_fault(events: list[dict[str, Any]], lines: list, in_process: bool) -> list[dict]:
    """``bench.recovery``'s split for each fault of the run (its events cut at that fault)."""
    faults = [i for i, e in enumerate(events) if e["type"] == "fault"]
    return [split(events[i:], lines, in_process) for i in faults]


def measure(run: dict[str, Any], result: dict[str, Any], interval: int) -> dict[str, Any]:
    """One row of the report from a finished run."""
    events = result["events"]
    in_process = run["kind"] == "raise"
    splits = _per_fault(events, result["lines"], in_process)
    starts = [e for e in events if e["type"] == "start"]
    commits = [e["total_s"] for e in events if e["type"] == "checkpoint"]
    totals = [s["total_s"] for s in splits if "total_s" in s]
    hangs = [s["detection_s"] for s, f in zip(splits, run["faults"], strict=False)
             if f.startswith("hang") and "detection_s" in s]
    after = starts[1:]
    row = {
        "kind": run["kind"], "fault_steps": run["fault_steps"], "faults": len(run["faults"]),
        "steps": run["steps"], "interval": interval, "state": result["state"],
        "restarts": len([e for e in events if e["type"] == "restart"]),
        "restart_layers": [e["kind"] for e in events if e["type"] == "restart"],
        "recovery_s": round(max(totals), 3) if totals else None,
        "detect_s": round(max(hangs), 3) if hangs else None,
        "steps_redone": max(_steps_redone(events), default=0),
        "from": ["memory" if s.get("from_memory") else "disk" if s.get("resumed_from") is not None
                 else "scratch" for s in after],
        "resumed_from": [s.get("resumed_from") for s in after],
        "commit_lag_s": {"median": round(statistics.median(commits), 2),
                         "max": round(max(commits), 2)} if commits else None,
        "wall_s": round(result["wall_s"], 1),
        "split": [{"fault": f, **{k: (round(v, 3) if isinstance(v, float) else v)
                                  for k, v in s.items() if k in SPLIT_KEYS}}
                  for f, s in zip(run["faults"], splits, strict=False)],
        "slowest_steps_after_restart": _slowest_after(events),
    }
    row["detect_lines"] = [ln[-200:] for _, ln in result["lines"] if _DETECT.search(ln)][:6]
    return row


def _slowest_after(events: list[dict[str, Any]]) -> list[list[Any]]:
    """The three slowest steps of each restarted incarnation: [steps after its start, seconds],
    and the step's parts when the run recorded them (``--set train.step_parts=true``; the
    diagnostic costs time itself, so the sweep runs without it)."""
    out: list[list[Any]] = []
    starts = [e for e in events if e["type"] == "start"][1:]
    for start in starts:
        mine = [e for e in events if e["type"] == "step" and e["start"] >= start["time"]
                and e.get("incarnation") == start.get("incarnation")
                and e.get("iteration") == start.get("iteration")]
        ranked = sorted(mine, key=lambda e: e["start"] - e["end"])[:3]
        first = mine[0]["step"] if mine else 0
        out += [[e["step"] - first, round(e["end"] - e["start"], 3),
                 *([e["parts"]] if e.get("parts") else [])] for e in ranked]
    return out


def fault_rows(runs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(fault kind, run, that fault's split with its ``fault`` text) for every fault of every run.

    Each split names its fault (``kill@44``). Runs recorded before it did name their faults by the
    run's kind: a two-fault run is a kill, then a hang; ``hang-start`` is a hang.
    """
    out = []
    for run in runs:
        kinds = (["kill", "hang"] if run["kind"].startswith("kill+hang")
                 else ["hang"] if run["kind"] == "hang-start" else [run["kind"]])
        for kind, step, s in zip(kinds, run["fault_steps"], run.get("split", []), strict=False):
            fault = s.get("fault") or f"{kind}@{step}"
            out.append((fault.split("@")[0], run, {**s, "fault": fault}))
    return out


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst per fault kind, and whether every run met one restart per fault."""
    out: dict[str, Any] = {"all_succeeded": all(r["state"] == "Succeeded" for r in rows),
                           "restarts_equal_faults": all(r["restarts"] == r["faults"] for r in rows)}
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        rec = [r["recovery_s"] for r in mine if r["recovery_s"] is not None]
        det = [r["detect_s"] for r in mine if r["detect_s"] is not None]
        out[kind] = {"runs": len(mine),
                     "recovery_s": {"median": round(statistics.median(rec), 2),
                                    "worst": round(max(rec), 2)} if rec else None,
                     "detect_s": {"median": round(statistics.median(det), 2),
                                  "worst": round(max(det), 2)} if det else None,
                     "steps_redone_worst": max(r["steps_redone"] for r in mine),
                     "interval": mine[0]["interval"]}
    return out


def merge(paths: list[str], out: str) -> None:
    """One report from the parts of a sweep (same preset and seed), runs in plan order.

    The first part's top-level fields (machine, commit, note) head the report; ``parts`` lists
    every part's, and each row its ``part``.
    """
    parts = [json.loads(Path(p).read_text()) for p in paths]
    # Each row keeps its part (1-based): parts run from other plans or commits may share indices.
    rows = sorted(({**r, "part": i + 1} for i, p in enumerate(parts) for r in p["runs"]),
                  key=lambda r: (r["index"], r["part"]))
    res = {**parts[0], "runs": rows, "summary": summarise(rows),
           "parts": [{**p["machine"], "commit": p.get("commit"), "note": p.get("note"),
                      "set": p.get("set")} for p in parts]}
    write_json(out, res)


def main(argv: list[str] | None = None) -> int:
    """Runs the planned runs (or those left) and writes one JSON file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=29)
    p.add_argument("--per-kind", type=int, default=4)
    p.add_argument("--only", default=",".join([*KINDS, *OWN_GEOMETRY_KINDS]))
    p.add_argument("--skip-runs", type=int, default=0, help="plan indices already run")
    p.add_argument("--budget", type=float, default=0, help="seconds; 0: no limit")
    p.add_argument("--max-runs", type=int, default=0, help="the first N runs of the plan; 0: all")
    p.add_argument("--pick", default="", help="only these plan indices, in this order (e.g. 6,3)")
    p.add_argument("--merge", nargs="*", help="merge these part files into --out and exit")
    p.add_argument("--set", action="append", default=[], dest="sets",
                   help="a config override for every run (key=value), e.g. resilience.warm_start=true")
    args = p.parse_args(argv)
    if args.merge:
        merge(args.merge, args.out)
        return 0
    from kfp_nvrx.components.core.config import load_config

    t0, pre = time.time(), PRESETS[args.preset]
    only = args.only.split(",")
    runs = [r for r in plan(args.preset, args.seed, args.per_kind, [k for k in KINDS if k in only])
            if r["kind"] in only and r["index"] >= args.skip_runs]
    if args.pick:  # a sweep split over leases: the runs an earlier part did not sample
        by_index = {r["index"]: r for r in runs}
        runs = [by_index[int(i)] for i in args.pick.split(",") if int(i) in by_index]
    runs = runs[:args.max_runs] if args.max_runs else runs
    work = Path(tempfile.mkdtemp(prefix="kfp-nvrx-bench-"))
    data = make_dataset(work, load_config(args.preset).data.seq_len)
    res: dict[str, Any] = {"bench": "recovery sweep", "preset": args.preset, "seed": args.seed,
                           "machine": {**machine_info(), "date": time.strftime("%Y-%m-%d")},
                           "plan": "bench.recovery_sweep.plan", "set": args.sets, "runs": []}
    for run in runs:
        left = args.budget - (time.time() - t0)
        # A run's length: the longest so far per planned step (or the preset's guess), + 30 %.
        per_step = max([r["wall_s"] / r["steps"] for r in res["runs"]] or [pre["run_s"] / 100])
        need = per_step * run["steps"] * 1.3
        if args.budget and left < need:
            log(f"sweep: {left:.0f}s left, run {run['index']} needs ~{need:.0f}s: stopping")
            break
        run_dir = work / f"run_{run['index']}"
        # Snapshots by steps (the presets' interval_s would take over): the plan's fault steps
        # are placed against them (a kill during a save's write, a kill past the first one).
        base = [f"data.path={data}", f"train.steps={run['steps']}",
                f"checkpoint.interval={pre['interval']}", "checkpoint.interval_s=0",
                "checkpoint.keep=1", "checkpoint.save_final=false",
                "resilience.workers_stop_timeout=5"]
        layer_set = [*KINDS.get(run["kind"], {"set": []})["set"], *args.sets]
        timeout = left - 5 if args.budget else pre["run_s"] * 4
        result = run_trainer("ft", Training(args.preset, [*base, *layer_set], run["faults"]),
                             run_dir, timeout=timeout)
        row = {"index": run["index"], **measure(run, result, pre["interval"])}
        shutil.rmtree(run_dir, ignore_errors=True)  # a 1b save is 13 GB; the disk is 64 GB
        res["runs"].append(row)
        res["summary"] = summarise(res["runs"])
        log(f"sweep {run['index']} {run['faults']}: {row['state']} restarts={row['restarts']} "
            f"recovery={row['recovery_s']} detect={row['detect_s']} redone={row['steps_redone']} "
            f"from={row['from']} slowest={row['slowest_steps_after_restart']}")
        write_json(args.out, res)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
