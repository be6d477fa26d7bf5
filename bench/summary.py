"""Turns the benchmark JSON into ``summary.json``, ``README.md`` (tables, :mod:`.readme`) and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import ratio, write_json
from bench.keys import round_two_keys, run_records, throughput_rows
from bench.projection import best_interval, goodput, job_mtbf_s, young_daly
from bench.readme import markdown
from bench.recovery_report import peer_figures, projection, sweep_lines
from bench.recovery_sweep import fault_rows
from bench.snapshots import snapshot_lines

NODES, NODE_MTBF_DAYS = 16, 30.0


def _load(out: Path, name: str) -> dict[str, Any]:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _mode(c: dict[str, Any], mode: str) -> dict[str, Any]:
    return c.get("modes", {}).get(mode) or (c.get("shipped", {}) if mode == "blocking" else {})


def ckpt_figures(c: dict[str, Any], stretch: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per-method blocking seconds and the ratios the issue asks for.

    ``c`` holds the peers and the plain (``blocking``) path; ``stretch`` (a later run of the
    shipped modes alone, when given) the ``overlap`` figures, each against its own run's floor.
    """
    if not c:
        return {}
    sh = _mode(c, "blocking")
    ours = sh["steady_s"]
    stager = c.get("stager", {})
    # What a correct loop pays for the stager: the call, the next forward/backward's slowdown
    # while staging runs beside it (against a whole quiet step, so an underestimate), and the
    # wait for staging before the optimizer may change the state.
    quiet = sh["step_quiet_median_s"]
    vis = [r["return_s"] + r["wait_after_fwd_bwd_s"] + max(0.0, r["fwd_bwd_s"] - quiet)
           for r in stager.get("runs", []) if r.get("wait_after_fwd_bwd_s") is not None]
    fig = {
        "state_gb": c["state_bytes"] / 1e9, "d2h_floor_s": c["d2h"]["floor_s"], "ours_s": ours,
        "ours_first_s": sh["first_s"], "ours_visible_s": sh.get("steady_visible_s", ours),
        "torch_save_s": c.get("torch_save", {}).get("blocking_s"),
        "dcp_save_s": c.get("dcp_save", {}).get("blocking_s"),
        "dcp_async_s": c.get("dcp_async", {}).get("steady_s"),
        "stager_s": stager.get("steady_s"), "stager_first_s": stager.get("first_s"),
        "stager_visible_s": min(vis) if vis else None,
        "slowdown_median": sh["slowdown_median"], "slowdown_max": sh["slowdown_max"],
        "blocking_all_s": sh["blocking_s"], "load": c.get("load", {}),
    }
    fig["stall_over_d2h_floor"] = ratio(ours, fig["d2h_floor_s"])
    fig["torch_save_over_stall"] = ratio(fig["torch_save_s"], ours)
    fig["dcp_async_over_stall"] = ratio(fig["dcp_async_s"], ours)
    fig["stager_over_stall"] = ratio(fig["stager_s"], ours)
    for name, src in (("overlap", c), ("overlap_b", stretch or {})):
        ov = _mode(src, "overlap")
        if not ov:
            continue
        fig[name] = {
            "run": "main" if src is c else "second", "d2h_floor_s": src["d2h"]["floor_s"],
            "blocking_s": ov["steady_s"], "visible_s": ov["steady_visible_s"],
            "blocking_all_s": ov["blocking_s"], "visible_all_s": ov["visible_s"],
            "next_step_s": ov["next_step_s"], "quiet_s": ov["step_quiet_median_s"],
            "next_step_slowdown_max": ov["next_step_slowdown_max"],
            "slowdown_median": ov["slowdown_median"], "slowdown_max": ov["slowdown_max"],
            "visible_over_d2h_floor": ratio(ov["steady_visible_s"], src["d2h"]["floor_s"])}
    if "overlap" in fig or "overlap_b" in fig:
        fig["ours_overlap_visible_s"] = min(fig[k]["visible_s"] for k in ("overlap", "overlap_b")
                                            if k in fig)
    return fig


def save_overhead_pct(ck: dict[str, Any], step_s: float, interval_steps: float) -> float | None:
    """Visible cost of one async save spread over ``interval_steps`` steps, % of step time."""
    if not ck or not step_s or not interval_steps:
        return None
    return 100 * ck["ours_visible_s"] / (interval_steps * step_s)


def build_report(out: Path) -> dict[str, Any]:
    """Writes summary.json, README.md and the plots from the JSON files in ``out``."""
    c, t, r = _load(out, "ckpt_stall"), _load(out, "throughput"), _load(out, "recovery")
    ck = ckpt_figures(c, _load(out, "ckpt_stall_overlap"))
    overheads = _overheads(t)
    sc = r.get("scenarios", {})
    load = c.get("load", {})
    step_1b = _mode(c, "blocking").get("step_quiet_median_s")
    summary = {
        "stall_over_d2h_floor": ck.get("stall_over_d2h_floor"),
        "torch_save_over_stall": ck.get("torch_save_over_stall"),
        "stager_over_stall": ck.get("stager_over_stall"),
        "dcp_async_over_stall": ck.get("dcp_async_over_stall"),
        "overhead_pct": max((o["wall_pct"] for o in overheads.values()), default=None),
        "recovery_inprocess_s": sc.get("raise", {}).get("total_s"),
        "recovery_injob_s": sc.get("kill", {}).get("total_s"),
        "ckpt_load_over_disk_read": load.get("load_over_disk_read"),
        "overlap_visible_over_d2h_floor": min(
            (ck[k]["visible_over_d2h_floor"] for k in ("overlap", "overlap_b") if k in ck),
            default=None),
        "mfu_1b": _best_mfu(t, "1b"), "mfu_125m": _best_mfu(t, "125m"),
        "save_overhead_pct_every_100_steps": save_overhead_pct(ck, step_1b, 100),
        "recovery_preset": r.get("preset"), "ckpt_preset": c.get("config"),
        "machine": (c or t or r).get("machine", {}),
    }
    r1b = _load(out, "recovery_1b")
    loaded = {"ckpt_stall": c, "throughput": t, "recovery": r,
              "recovery_2gpu": _load(out, "recovery_2gpu"), "recovery_1b": r1b}
    summary.update(round_two_keys(loaded, ck))
    summary["runs"] = run_records(loaded)
    mtbf = job_mtbf_s(NODES, NODE_MTBF_DAYS)
    gp = _goodput_projection(ck, sc, r1b.get("scenarios", {}).get("kill", {}), load, mtbf)
    proj = gp["methods"] if gp else {}
    if gp:
        summary["goodput_projection"] = gp
        if "ours" in proj and step_1b:
            summary["save_overhead_pct_at_young_daly"] = save_overhead_pct(
                ck, step_1b, proj["ours"]["best_interval_s"] / step_1b)
    sweeps = {p: _load(out, f"recovery_sweep_{p}") for p in ("1b", "125m")}
    for preset, sweep in sweeps.items():
        summary.update(sweep_keys(preset, sweep))
    state_gb = ck.get("state_gb") if c.get("config") == "1b" else None
    snaps = _load(out, "snapshots_1b")
    costs = snapshot_costs(snaps)
    summary["goodput_projection_p5"] = projection(
        r1b.get("scenarios", {}).get("kill"), state_gb,
        costs or ck.get("ours_overlap_visible_s") or ck.get("ours_visible_s"),
        peer=peer_figures(_load(out, "peer_restore")))
    write_json(out / "summary.json", summary)
    text = markdown(summary, ck, t, overheads, {"1b": r1b, "125m": r}, proj)
    text += "\n".join(snapshot_lines(snaps)) + "\n"
    text += "\n".join(sweep_lines(sweeps, _load(out, "drill_125m"))) + "\n"
    (out / "README.md").write_text(text)
    _plots(out, ck, {**{f"{k} (125m)": v for k, v in sc.items()},
                     **{f"{k} (1b)": v for k, v in r1b.get("scenarios", {}).items()}},
           proj, mtbf, summary.get("goodput_projection", {}).get("recovery_s"))
    return summary


def snapshot_costs(snaps: dict[str, Any]) -> dict[float, float]:
    """Seconds one snapshot cost its run, by interval (``bench.snapshots``): the median excess of
    the saving step and the next one (which runs beside its copies).

    What an incarnation pays once, pinning its banks at start-up, is not spread over its
    snapshots: it depends on how long the incarnation runs, not on the interval (the bench's
    runs are short, so spread over their few snapshots it would read as a per-snapshot cost
    that grows with the interval).
    """
    costs = {}
    for row in snaps.get("runs", {}).values():
        median = (row.get("stall_per_snapshot_s") or {}).get("median")
        if row.get("interval_s") and median is not None and not row.get("faults"):
            at = float(row["interval_s"])  # runs at one interval: the costlier counts
            costs[at] = max(costs.get(at, 1e-3), float(median))
    return costs


def _best_mfu(t: dict[str, Any], preset: str) -> float | None:
    """The best MFU of ``preset``'s one-GPU throughput runs."""
    return max((x["mfu"] for x in throughput_rows(t, preset, 1)), default=None)


def _overheads(t: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per overhead variant: its median and wall step time over the plain 1b run's, in %."""
    runs = {x["name"]: x for x in t.get("runs", [])}
    base = runs.get("1b compile=off", {})
    overheads = {}
    for x in t.get("runs", []):
        if x["kind"] == "overhead" and base.get("wall_per_step_s"):
            overheads[x["name"]] = {
                "median_pct": 100 * (x["step_median_s"] / base["step_median_s"] - 1),
                "wall_pct": 100 * (x["wall_per_step_s"] / base["wall_per_step_s"] - 1)}
    return overheads


def _goodput_projection(ck: dict[str, Any], sc: dict[str, Any], kill_1b: dict[str, Any],
                        load: dict[str, Any], mtbf: float) -> dict[str, Any] | None:
    """Goodput of each checkpointing method at its best interval (None: nothing to project).

    Args:
        ck: :func:`ckpt_figures` (the methods' visible costs).
        sc: The 125m recovery scenarios.
        kill_1b: The 1b kill recovery scenario.
        load: The checkpoint load's figures.
        mtbf: The job's MTBF, seconds.
    """
    if not (ck and (kill_1b.get("total_s") or sc.get("kill", {}).get("total_s"))):
        return None
    # Recovery of the 1b state: the measured 1b kill recovery (from the host copy); without
    # one, the 125m kill recovery with its load replaced by the 1b checkpoint's cold load.
    rec = kill_1b.get("total_s") or (sc["kill"]["total_s"] - sc["kill"].get("load_s", 0.0)
                                     + load.get("cold_load_s", 0.0))
    ours = ck.get("ours_overlap_visible_s") or ck["ours_visible_s"]
    proj = {}
    for label, delta in (("ours", ours), ("torch.save", ck["torch_save_s"]),
                         ("dcp.async_save", ck["dcp_async_s"]), ("dcp.save", ck["dcp_save_s"])):
        if delta:
            tau, g = best_interval(delta, rec, mtbf)
            proj[label] = {"delta_s": delta, "young_daly_s": young_daly(delta, mtbf),
                           "best_interval_s": tau, "best_goodput": g,
                           "goodput_at_30min": goodput(1800, delta, rec, mtbf)}
    return {"nodes": NODES, "node_mtbf_days": NODE_MTBF_DAYS, "job_mtbf_s": mtbf,
            "recovery_s": rec, "methods": proj,
            "recovery_source": "1b kill" if kill_1b.get("total_s") else "125m kill + 1b cold load"}


def sweep_keys(preset: str, sweep: dict[str, Any]) -> dict[str, Any]:
    """The recovery sweep's figures (``bench.recovery_sweep``): the worst of each fault kind,
    taken per fault (a two-fault run's kill is a kill, its hang a hang), and whether every run
    ended Succeeded with one restart per fault and redid at most an interval."""
    runs = sweep.get("runs", [])
    key = f"sweep_{preset}"
    if not runs:
        return {f"{key}_runs": 0}
    faults = fault_rows(runs)

    def worst(kinds: tuple[str, ...], field: str) -> float | None:
        vals = [s[field] for kind, _, s in faults if kind in kinds and s.get(field) is not None]
        return round(max(vals), 3) if vals else None

    return {
        f"{key}_runs": len(runs), f"{key}_faults": len(faults),
        f"{key}_one_restart_per_fault": all(r["state"] == "Succeeded"
                                            and r["restarts"] == r["faults"] for r in runs),
        f"{key}_redone_within_interval": all(r["steps_redone"] <= r["interval"] for r in runs),
        f"{key}_inprocess_worst_s": worst(("raise",), "total_s"),
        f"{key}_injob_kill_worst_s": worst(("kill", "kill-in-ckpt"), "total_s"),
        f"{key}_hang_detect_worst_s": worst(("hang",), "detection_s"),
        f"{key}_hang_to_step_worst_s": worst(("hang",), "total_s"),
        f"{key}_date": sweep.get("machine", {}).get("date"),
    }


def _plots(out: Path, ck, sc, proj, mtbf, rec_s) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib not installed; plots skipped")
        return
    if ck:
        names = ["D2H floor", "ours: overlap (visible)", "ours: blocking", "DefaultStager (return)",
                 "dcp.async_save", "dcp.save", "torch.save"]
        vals = [ck["d2h_floor_s"], ck.get("ours_overlap_visible_s"), ck["ours_s"], ck["stager_s"],
                ck["dcp_async_s"], ck["dcp_save_s"], ck["torch_save_s"]]
        pairs = [(n, v) for n, v in zip(names, vals, strict=True) if v]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.barh([n for n, _ in pairs], [v for _, v in pairs], color="tab:blue")
        ax.set_xscale("log")
        ax.set_xlabel(f"seconds the training loop is blocked per save ({ck['state_gb']:.1f} GB)")
        fig.tight_layout()
        fig.savefig(out / "ckpt_stall.png", dpi=110)
        plt.close(fig)
    done = {k: v for k, v in sc.items() if "total_s" in v}
    if done:
        parts = ["detection_s", "launcher_s", "start_s", "load_s", "first_step_s"]
        fig, ax = plt.subplots(figsize=(7, 1 + 0.35 * len(done)))
        left = [0.0] * len(done)
        for part in parts:
            vals = [max(0.0, v.get(part) or 0.0) for v in done.values()]
            ax.barh(list(done), vals, left=left, label="restart" if part == "launcher_s" else part[:-2])
            left = [a + b for a, b in zip(left, vals, strict=True)]
        ax.set_xlabel("seconds from fault to the end of the first step after it")
        ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.3))
        fig.tight_layout()
        fig.savefig(out / "recovery.png", dpi=110)
        plt.close(fig)
    if proj:
        import numpy as np

        taus = np.logspace(0, 4.5, 300)
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, p in proj.items():
            ax.plot(taus / 60, [goodput(x, p["delta_s"], rec_s, mtbf) for x in taus], label=label)
            ax.axvline(p["best_interval_s"] / 60, ls=":", lw=0.8, color=ax.lines[-1].get_color())
        ax.set_xscale("log")
        ax.set_ylim(0.9, 1.0)
        ax.set_xlabel("checkpoint interval, minutes (dotted: Young/Daly optimum)")
        ax.set_ylabel("goodput")
        ax.set_title(f"{NODES} nodes, node MTBF {NODE_MTBF_DAYS:.0f} d, recovery {rec_s:.1f} s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "goodput.png", dpi=110)
        plt.close(fig)
