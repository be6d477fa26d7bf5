"""What snapshots cost a user: host snapshots every few seconds, the durable write behind them.

Runs the shipped trainer through ``launch-local`` (one ``ft_launcher`` agent, as a pod runs it) at
several snapshot intervals (``checkpoint.interval_s``), the preset's defaults among them, plus a
run without snapshots (the quiet step time of the same machine) and a run with kills during and
between durable writes. Every figure is computed from the run's ``events.jsonl``, as a user would
compute it, never from what the trainer says it cost:

- quiet step: the median step of the run (a snapshot every few seconds touches few steps);
- per-snapshot stall: the saving step's and the next step's excess over the quiet step (the next
  step runs beside the copies), and the trainer's own ``stall_s`` beside it;
- total stall: the run's steps (an incarnation's first two, its start-up, left out) against as
  many quiet steps, as a share: snapshots, write starts, commits and writes in flight together;
- commit lag: snapshot -> durable commit of the same step; superseded snapshots (never written);
- after a kill: the step resumed from, the steps redone, where the state came from.

``python -m bench.snapshots --preset 1b --out snapshots_1b.json [--only 2,5,defaults,30,off,kills]
[--budget 560]``; the JSON is rewritten after every run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from typing import Any

from bench.common import log, newest_step_done, start_bench, write_json
from bench.runs import Training, run_trainer

#: The runs: name -> (overrides, faults, steps per second of the preset's quiet step).
RUNS: dict[str, dict[str, Any]] = {
    "2": {"set": ["checkpoint.interval_s=2"], "seconds": 40},
    "5": {"set": ["checkpoint.interval_s=5"], "seconds": 45},
    "defaults": {"set": [], "seconds": 60},
    "30": {"set": ["checkpoint.interval_s=30"], "seconds": 100},
    "off": {"set": ["checkpoint.interval=0", "checkpoint.interval_s=0",
                    "checkpoint.save_final=false"], "seconds": 20},
    # Kills at ~1/4 (the first durable write is usually in flight) and ~3/4 of the run.
    "kills": {"set": ["checkpoint.interval_s=5"], "seconds": 70, "kills": (0.25, 0.75)},
}
#: Seconds per step of each preset's quiet step, to size the runs (measured; a guess is enough).
STEP_S = {"1b": 0.28, "125m": 0.06, "tiny": 0.05}
#: What ran beside a timed step, in the order :func:`attribute` tries them (the trace keeps the
#: first letter).
BESIDE = ("snapshot", "writing", "pinning", "other")
#: Steps of each incarnation left out as its start-up.
START_UP = 2


def steps_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step events with each incarnation's start-up steps marked (``"start_up"``)."""
    out, seen = [], 0
    for e in events:
        if e["type"] == "start":
            seen = 0
        elif e["type"] == "step":
            out.append({**e, "d": e["end"] - e["start"], "start_up": seen < START_UP})
            seen += 1
    return out


def _stats(xs: list[float]) -> dict[str, float | None]:
    return {"worst": round(max(xs), 4) if xs else None,
            "median": round(statistics.median(xs), 4) if xs else None, "n": len(xs)}


def attribute(steps: list[dict[str, Any]], quiet: float, events: list[dict[str, Any]],
              ready_at: list[float]) -> tuple[dict[str, float], list[list[Any]]]:
    """The run's excess over quiet steps by what ran beside each step, and a per-step trace.

    Each timed step goes to the first that applies: ``snapshot`` (the saving step or the next,
    which runs beside its copies), ``writing`` (a durable write in flight), ``pinning`` (banks of
    its incarnation still being pinned: a "bank ready" line came after it), ``other``.
    """
    snap = {e["step"] for e in events if e["type"] == "snapshot" and not e.get("skipped")}
    writes = [(c["time"] - c["total_s"], c["time"]) for c in events if c["type"] == "checkpoint"]
    starts = sorted(e["time"] for e in events if e["type"] == "start") + [float("inf")]
    parts = dict.fromkeys(BESIDE, 0.0)
    trace = []
    for s in steps:
        if s["start_up"]:
            trace.append([s["step"], round(s["d"], 4), "u"])
            continue
        until = next(t for t in starts if t > s["end"])
        if s["step"] in snap or s["step"] - 1 in snap:
            part = "snapshot"
        elif any(a < s["end"] and s["start"] < b for a, b in writes):
            part = "writing"
        elif any(s["end"] < t < until for t in ready_at):
            part = "pinning"
        else:
            part = "other"
        parts[part] += s["d"] - quiet
        trace.append([s["step"], round(s["d"], 4), part[0]])
    return {k: round(v, 3) for k, v in parts.items()}, trace


def parts_by_what_ran_beside(steps: list[dict[str, Any]],
                             trace: list[list[Any]]) -> dict[str, dict[str, float]]:
    """Each kind of step's excess split by the step's parts (``train.step_parts``).

    A part's baseline is its median over the ``other`` steps (nothing ran beside them): a
    step that grew because the loop's thread waited shows it in a launch part (``data``,
    ``forward_backward``, ``optimizer``) or ``tick``/``monitor``; one whose GPU work ran slower
    shows it in ``sync`` and ``gpu``.
    """
    # The trace has a row per step, in order (steps redone after a fault repeat their number).
    with_parts = [(s, row[2]) for s, row in zip(steps, trace, strict=True)
                  if s.get("parts") and row[2] != "u"]
    quiet = [s["parts"] for s, kind in with_parts if kind == "o"]
    if not quiet:
        return {}
    names = sorted({k for s, _ in with_parts for k in s["parts"]})
    base = {k: statistics.median(p.get(k, 0.0) for p in quiet) for k in names}
    out: dict[str, dict[str, float]] = {}
    for s, letter in with_parts:
        kind = next(k for k in BESIDE if k[0] == letter)
        row = out.setdefault(kind, dict.fromkeys(names, 0.0))
        for k in names:
            row[k] += s["parts"].get(k, 0.0) - base[k]
    return {kind: {k: round(v, 3) for k, v in row.items()} for kind, row in out.items()}


def measure(events: list[dict[str, Any]], quiet_s: float | None = None,
            lines: list[tuple[float, str]] = ()) -> dict[str, Any]:
    """The stall, lag and recovery figures of one run's events (see the module docstring)."""
    steps = steps_of(events)
    timed = [s for s in steps if not s["start_up"]]
    quiet = quiet_s or (statistics.median(s["d"] for s in timed) if timed else 0.0)
    snaps = [e for e in events if e["type"] == "snapshot"]
    taken = [e for e in snaps if not e.get("skipped")]
    by_step = {s["step"]: i for i, s in enumerate(steps)}
    excess = []
    for snap in taken:
        i = by_step.get(snap["step"])
        if i is None:
            continue
        nxt = steps[i + 1]["d"] - quiet if i + 1 < len(steps) else 0.0
        excess.append(max(0.0, steps[i]["d"] - quiet) + max(0.0, nxt))
    total = sum(s["d"] for s in timed)
    commits = [e for e in events if e["type"] == "checkpoint"]
    snap_time = {e["step"]: e["time"] for e in taken}
    lags = [c["time"] - snap_time[c["step"]] for c in commits if c["step"] in snap_time]
    out = {
        "steps": len(steps), "quiet_step_s": round(quiet, 4),
        "snapshots": len(taken), "skipped": [[e["step"], e["skipped"]] for e in snaps
                                             if e.get("skipped")],
        "stall_per_snapshot_s": _stats(excess),
        "recorded_stall_per_snapshot_s": _stats([e["stall_s"] for e in taken]),
        "total_stall_s": round(total - len(timed) * quiet, 3),
        "total_stall_share": round((total - len(timed) * quiet) / (len(timed) * quiet), 4)
        if timed and quiet else None,
        "snapshot_interval_s": _stats([b["time"] - a["time"]
                                       for a, b in zip(taken, taken[1:], strict=False)]),
        "commits": [c["step"] for c in commits], "commit_blocking_s": _stats(
            [c["blocking_s"] for c in commits]),
        "write_s": _stats([c["total_s"] for c in commits]), "commit_lag_s": _stats(lags),
        "superseded": sorted(set(snap_time) - {c["step"] for c in commits}),
        "recovery": _recovery(events),
        **dict(zip(("stall_by_what_ran_beside_s", "trace"), attribute(
            steps, quiet, events, [t for t, ln in lines if "staging bank" in ln and " ready:" in ln]),
            strict=True)),
    }
    out["parts_by_what_ran_beside_s"] = parts_by_what_ran_beside(steps, out["trace"])
    # When each bank became ready, the step of the first snapshot, and how much was pinned in the
    # loop's waits for the GPU (the trainer's "staging bank N ready: ..." lines).
    out["banks_ready"] = [ln.split("[trainer] ", 1)[-1][:200] for _, ln in lines
                          if "staging bank" in ln and " ready:" in ln]
    out["first_snapshot_step"] = taken[0]["step"] if taken else None
    return out


def _recovery(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fault: the step resumed from, steps redone, from memory or the volume.

    Steps redone are the steps done before the fault that the restart did again: the newest step
    completed before it minus the step resumed from (as ``bench.recovery_sweep`` counts them). A
    kill "at step N" lands before step N runs, so N itself is not among them.
    """
    out = []
    faults = [e for e in events if e["type"] == "fault"]
    starts = [e for e in events if e["type"] == "start"]
    for f in faults:
        nxt = next((s for s in starts if s["time"] > f["time"]), None)
        if nxt is None:
            continue
        resumed = nxt.get("resumed_from")
        out.append({"fault": f"{f['kind']}@{f['step']}", "resumed_from": resumed,
                    "steps_redone": newest_step_done(events, f["time"]) - (resumed or 0),
                    "from_memory": nxt.get("from_memory"),
                    "load_s": nxt.get("load_s")})
    return out


def snapshot_lines(snaps: dict[str, Any]) -> list[str]:
    """Markdown: one row per run of :func:`main`'s JSON (``snapshots_1b.json``)."""
    runs = snaps.get("runs", {})
    if not runs:
        return []
    m = snaps.get("machine", {})
    lines = ["", f"## Snapshots at {snaps.get('preset')}: two tiers, two paces ({m.get('gpu', '?')}, "
             f"{m.get('date', '')})", "",
             "From each run's `events.jsonl`: quiet step = the run's median step; stall per "
             "snapshot = the saving step's and the next step's excess over it; total = every "
             "timed step's excess (an incarnation's first two steps left out), as a share of as "
             "many quiet steps; commit lag = snapshot -> its durable commit.", "",
             "| run | interval s | steps | quiet step s | snapshots (skipped) | stall per snapshot "
             "s (median / worst) | total stall | commits | commit lag s (median) | after kills "
             "(resumed from, steps redone, from) |", "|---" * 10 + "|"]
    for name, r in runs.items():
        per = r["stall_per_snapshot_s"]
        rec = "; ".join(f"{x['fault']}: {x['resumed_from']}, {x['steps_redone']}, "
                        f"{'memory' if x['from_memory'] else 'volume/none'}" for x in r["recovery"])
        share = r.get("total_stall_share")
        lines.append(
            f"| {name} | {r.get('interval_s', '—')} | {r['steps']} | {r['quiet_step_s']} | "
            f"{r['snapshots']} ({len(r['skipped'])}) | {per['median']} / {per['worst']} | "
            f"{'—' if share is None else f'{share:.1%}'} | {r['commits']} | "
            f"{r['commit_lag_s']['median']} | {rec or '—'} |")
    return lines


#: A run name's suffixes change it: ``+warm`` runs it with warm worker starts (issue 37's zygote
#: against the cold start, back to back on one machine), ``+key=value`` adds that override
#: (``defaults+train.step_parts=true``: the same run split by step parts, a diagnostic that
#: itself made each step after a 1b snapshot 0.23 s longer on an H100: no figure comes from it).
WARM_SUFFIX = "warm"


def _spec(name: str) -> dict[str, Any]:
    return RUNS[name.split("+")[0]]


def _suffix_overrides(name: str) -> list[str]:
    """The overrides a run name's ``+`` suffixes add (see :data:`WARM_SUFFIX`)."""
    out = []
    for extra in name.split("+")[1:]:
        if extra == WARM_SUFFIX:
            out.append("resilience.warm_start=true")
        elif "=" in extra:
            out.append(extra)
        else:
            raise SystemExit(f"--only: unknown run suffix +{extra} (+warm or +key=value)")
    return out


def _training(preset: str, name: str, data: str, scale: float = 1.0) -> Training:
    spec = _spec(name)
    steps = max(20, int(spec["seconds"] * scale / STEP_S.get(preset, 0.1)))
    faults = [f"kill@{int(steps * k)}" for k in spec.get("kills", ())]
    base = [f"data.path={data}", f"train.steps={steps}", "checkpoint.keep=1",
            f"train.log_every={max(10, steps // 10)}"]
    return Training(preset, [*base, *spec["set"], *_suffix_overrides(name)], faults)


def main(argv: list[str] | None = None) -> int:
    """Runs the named runs and writes one JSON file (rewritten after each run)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="1b")
    p.add_argument("--only", default="off,defaults,2,5,30,kills")
    p.add_argument("--budget", type=float, default=0, help="seconds; 0: no limit")
    p.add_argument("--scale", type=float, default=1.0, help="run lengths x this (a quick look)")
    args = p.parse_args(argv)
    from kfp_nvrx.components.core.config import load_config

    t0 = time.time()
    work, data, res = start_bench("snapshots", args.preset)
    quiet = None
    for name in args.only.split(","):
        training = _training(args.preset, name, data, args.scale)
        left = args.budget - (time.time() - t0)
        need = _spec(name)["seconds"] + 60
        if args.budget and left < need:
            log(f"snapshots: {left:.0f}s left, run {name} needs ~{need:.0f}s: stopping")
            break
        run_dir = work / f"run_{name}"
        result = run_trainer("ft", training, run_dir, timeout=left - 5 if args.budget else 900)
        interval = load_config(args.preset, training.overrides[1:]).checkpoint.interval_s
        row = {"overrides": training.overrides[1:], "faults": training.faults,
               "interval_s": interval,
               "state": result["state"], "wall_s": round(result["wall_s"], 1),
               **measure(result["events"], None, result["lines"])}
        if name == "off":
            quiet = row["quiet_step_s"]
        elif quiet:  # the same figures against the quiet step of the run without snapshots
            row["against_off"] = {k: measure(result["events"], quiet)[k]
                                  for k in ("total_stall_s", "total_stall_share")}
        shutil.rmtree(run_dir, ignore_errors=True)  # a 1b checkpoint is 13 GB; the disk is 64 GB
        res["runs"][name] = row
        log(f"snapshots {name}: {row['state']} quiet={row['quiet_step_s']} "
            f"stall/snapshot={row['stall_per_snapshot_s']} share={row['total_stall_share']} "
            f"lag={row['commit_lag_s']} by={row['stall_by_what_ran_beside_s']} "
            f"recovery={row['recovery']}")
        write_json(args.out, res)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
