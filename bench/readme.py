"""The benchmark results' ``README.md``: the figures against their targets, then a section each.

:func:`markdown` renders what :func:`bench.summary.build_report` computed; nothing here measures
or derives a figure that ``summary.json`` lacks, only ratios of two figures for one table row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.common import ratio
from bench.recovery_report import projection_lines, recovery_lines

#: One row of the targets table: (figure, measured value, target, whether met, value format).
Row = Callable[..., None]


def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return "—" if x is None else fmt.format(x) if isinstance(x, (int, float)) else str(x)


def c_blocking(ck: dict[str, Any]) -> list[float]:
    """Every save's blocking seconds after the first."""
    return ck.get("blocking_all_s", [])[1:]


def markdown(s: dict[str, Any], ck: dict[str, Any], t: dict[str, Any],
             overheads: dict[str, Any], sc: dict[str, Any], proj: dict[str, Any]) -> str:
    """``README.md`` from the summary ``s`` and what it was computed from.

    Args:
        s: The summary (``summary.json``).
        ck: :func:`bench.summary.ckpt_figures` (its ``load`` is the checkpoint load's figures).
        t: The throughput JSON.
        overheads: Per overhead variant, its step time over the plain run's, in %.
        sc: The recovery JSON per preset (``1b``, ``125m``).
        proj: The goodput projection per checkpointing method.
    """
    m = s.get("machine", {})
    lines = [
        "# Benchmarks", "",
        f"Measured by `make bench` (`python -m bench.run`) on {m.get('gpu', '?')} "
        f"(driver {m.get('driver', '?')}, CUDA {m.get('cuda', '?')}, NCCL {m.get('nccl', '?')}), "
        f"torch {m.get('torch', '?')}, nvidia-resiliency-ext {m.get('nvidia_resiliency_ext', '?')}, "
        f"Python {m.get('python', '?')}, {m.get('cpus', '?')} CPUs, {m.get('date', '')}. "
        "Every ratio is taken within one run. Raw figures: the JSON files beside this one.", "",
        "## Figures against targets", "", "| figure | measured | target | met |", "|---|---|---|---|"]

    def row(name, val, target, ok, fmt="{:.2f}"):
        met = "—" if val is None or target == "—" else ("yes" if ok(val) else "**no**")
        lines.append(f"| {name} | {_f(val, fmt)} | {target} | {met} |")

    _stall_targets(row, s, ck)
    _run_targets(row, s)
    _sweep_rows(s, row)
    for key, reason in s.get("null_reasons", {}).items():
        lines.append(f"| {key}: not measured | {reason} | | — |")
    lines += _stall_lines(ck)
    lines += _load_lines(ck.get("load", {}))
    lines += _throughput_lines(t, overheads)
    lines += recovery_lines(sc)
    lines += _projection_lines(s, proj)
    lines += projection_lines(s.get("goodput_projection_p5") or {})
    lines += ["", "![checkpoint stall](ckpt_stall.png) ![recovery](recovery.png)", "",
              "Analysis of each missed target, the profile and the NVRx 0.7.0 fixes: NOTES.md.", ""]
    return "\n".join(lines)


def _stall_targets(row: Row, s: dict[str, Any], ck: dict[str, Any]) -> None:
    """The checkpoint stall's rows of the targets table."""
    row("stall / D2H floor (plain NVRx path)", s["stall_over_d2h_floor"], "≤ 1.3×", lambda v: v <= 1.3)
    row("torch.save / stall", s["torch_save_over_stall"], "≥ 50×", lambda v: v >= 50, "{:.0f}")
    row("dcp.async_save (default stager) / stall", s["dcp_async_over_stall"], "≥ 20×",
        lambda v: v >= 20, "{:.1f}")
    row("DefaultStager (process) call return / stall", s["stager_over_stall"],
        "> 1× (stretch: beat every peer)", lambda v: v > 1, "{:.3f}")
    if ck:
        row("DefaultStager visible cost in a loop / stall", ratio(ck["stager_visible_s"], ck["ours_s"]),
            "> 1×", lambda v: v > 1, "{:.1f}")
        for key, label in (("overlap", "main run"), ("overlap_b", "second run")):
            ov = ck.get(key)
            if not ov:
                continue
            row(f"visible stall / D2H floor, staging=overlap ({label}; stretch)",
                ov["visible_over_d2h_floor"], "≤ 0.25×", lambda v: v <= 0.25)
            row(f"worst step while a write is in flight, overlap ({label}; stretch)",
                100 * ov["slowdown_max"], "≤ +2 %", lambda v: v <= 2, "{:+.1f} %")
            row(f"worst slowdown of the step the D2H overlaps ({label}; stretch)",
                100 * ov["next_step_slowdown_max"], "≤ +2 %", lambda v: v <= 2, "{:+.1f} %")


def _run_targets(row: Row, s: dict[str, Any]) -> None:
    """The rows of the targets table from the training runs: overheads, recovery, MFU."""
    row("NVRx overhead: monitor + wrapper (worst variant, % of step)", s["overhead_pct"], "≤ 1 %",
        lambda v: v <= 1, "{:.2f} %")
    row("NVRx overhead: async save every 100 steps (1b, % of step)",
        s["save_overhead_pct_every_100_steps"], "≤ 1 %", lambda v: v <= 1, "{:.2f} %")
    row("NVRx overhead: async save at the Young/Daly interval (% of step)",
        s.get("save_overhead_pct_at_young_daly"), "≤ 1 %", lambda v: v <= 1, "{:.3f} %")
    row("recovery in-process (raise), s", s["recovery_inprocess_s"], "≤ 3 s", lambda v: v <= 3)
    row("recovery in-job (kill), s", s["recovery_injob_s"], "≤ 15 s", lambda v: v <= 15)
    row("checkpoint load / disk read bandwidth", s["ckpt_load_over_disk_read"], "≥ 0.8",
        lambda v: v >= 0.8)
    row("MFU 1b", s["mfu_1b"], "≥ 45 %", lambda v: v >= 0.45, "{:.1%}")
    row("MFU 125m", s["mfu_125m"], "—", lambda v: True, "{:.1%}")
    row("recovery in-job (kill), 2 GPUs, s", s["recovery_injob_s_2gpu"], "≤ 10 s",
        lambda v: v <= 10)
    row("recovery in-process (raise), 2 GPUs, s", s["recovery_inprocess_s_2gpu"], "≤ 3 s",
        lambda v: v <= 3)
    row("hang detection (fault → monitor kill), 125m, s", s["hang_detect_s"], "≤ 5 s",
        lambda v: v <= 5)
    row("recovery in-process (raise), 1b, s", s["recovery_inprocess_s_1b"], "≤ 2 s",
        lambda v: v <= 2)
    row("recovery in-job (kill), 1b, s", s["recovery_injob_s_1b"], "≤ 12 s", lambda v: v <= 12)
    row("hang detection (fault → monitor kill), 1b, s", s["hang_detect_s_1b"], "≤ 5 s",
        lambda v: v <= 5)
    row("weak scaling 1→2 GPUs (1b eager, tokens/s/GPU)", s["scaling_efficiency_2gpu"], "≥ 0.95",
        lambda v: v >= 0.95, "{:.3f}")
    row("MFU 1b, 2 GPUs", s["mfu_1b_2gpu"], "≥ 55 %", lambda v: v >= 0.55, "{:.1%}")
    row("worst step while a write is in flight (overlap)", s["worst_inflight_step_pct"], "≤ +5 %",
        lambda v: v <= 5, "{:+.1f} %")


def _sweep_rows(s: dict[str, Any], row: Row) -> None:
    """The recovery sweep's rows of the targets table (issue 37's), per preset that ran it."""
    for preset in ("1b", "125m"):
        k = f"sweep_{preset}"
        if not s.get(f"{k}_runs"):
            continue
        n = f"{s[f'{k}_runs']} runs, {s.get(f'{k}_faults', '?')} faults, {s.get(f'{k}_date')}"
        row(f"recovery sweep {preset} ({n}): one restart per fault, all Succeeded",
            s[f"{k}_one_restart_per_fault"], "every run", bool, "{}")
        row(f"recovery sweep {preset}: steps redone within the interval",
            s[f"{k}_redone_within_interval"], "every run", bool, "{}")
        row(f"recovery sweep {preset}: in-process, worst s", s[f"{k}_inprocess_worst_s"],
            "≤ 1.5 s", lambda v: v <= 1.5)
        row(f"recovery sweep {preset}: in-job kill (fault → end of the next step), worst s",
            s[f"{k}_injob_kill_worst_s"], "≤ 6 s", lambda v: v <= 6)
        row(f"recovery sweep {preset}: hang detected (fault → monitor kill), worst s",
            s[f"{k}_hang_detect_worst_s"], "≤ 5 s", lambda v: v <= 5)
        row(f"recovery sweep {preset}: hang to the end of the next step, worst s",
            s[f"{k}_hang_to_step_worst_s"], "≤ 10 s", lambda v: v <= 10)


def _stall_lines(ck: dict[str, Any]) -> list[str]:
    """The checkpoint stall section: each method's blocking seconds per save."""
    if not ck:
        return []
    return ["", f"## Checkpoint stall ({ck['state_gb']:.2f} GB of state, seconds per save)", "",
            "| method | blocking s | note |", "|---|---|---|",
            f"| pinned D2H copy (floor) | {_f(ck['d2h_floor_s'])} | pre-allocated pinned buffers |",
            f"| **ours, staging=blocking (plain path)** | {_f(ck['ours_s'])} | median of saves "
            f"2..n ({', '.join(_f(x) for x in c_blocking(ck))}); first save "
            f"{_f(ck['ours_first_s'])} s; visible incl. the next step's slowdown "
            f"{_f(ck['ours_visible_s'])} s |",
            *_overlap_row(ck.get("overlap")), *_overlap_row(ck.get("overlap_b")),
            f"| torch dcp.async_save, default stager | {_f(ck['dcp_async_s'])} | thread |",
            f"| torch DefaultStager(StagingOptions(True×4)), process | {_f(ck['stager_s'])} | "
            f"call return; first {_f(ck['stager_first_s'])} s; return + wait for staging "
            f"after the next fwd/bwd {_f(ck['stager_visible_s'])} s |",
            f"| torch dcp.save (sync) | {_f(ck['dcp_save_s'])} | |",
            f"| torch.save (sync) | {_f(ck['torch_save_s'])} | |",
            "", f"Step time while a write is in flight (blocking run): median "
            f"{ck['slowdown_median']:+.1%}, worst {ck['slowdown_max']:+.1%} against steps "
            "with no write in flight."]


def _load_lines(load: dict[str, Any]) -> list[str]:
    """The checkpoint load's paragraph (disk, and the in-memory restore)."""
    if not load:
        return []
    lines = ["", f"Checkpoint load ({load.get('filesystem', '')}): raw cold read "
             f"{_f(load.get('raw_gb_per_s'), '{:.2f}')} GB/s, cold `Checkpointer.load` "
             f"{_f(load.get('cold_load_gb_per_s'), '{:.2f}')} GB/s "
             f"(ratio {_f(load.get('load_over_disk_read'), '{:.2f}')})."]
    if load.get("memory_restore_s"):
        lines += [f"In-process restarts restore from the staging buffer instead: "
                  f"{load['memory_restore_s']:.3f} s for the same state "
                  f"({load['bytes'] / load['memory_restore_s'] / 1e9:.0f} GB/s)."]
    return lines


def _throughput_lines(t: dict[str, Any], overheads: dict[str, Any]) -> list[str]:
    """The throughput and overhead section: one row per trainer run."""
    if not t.get("runs"):
        return []
    lines = ["", "## Throughput and overhead (real trainer runs, steady-state steps)", "",
             f"bf16 matmul measured here: {t.get('matmul_tflops', 0):.0f} TFLOP/s; MFU is "
             "against the 989 TFLOP/s dense bf16 datasheet peak.", "",
             "| run | state | step median s | tokens/s | MFU | overhead (median / wall) |",
             "|---|---|---|---|---|---|"]
    for x in t["runs"]:
        o = overheads.get(x["name"])
        ov = f"{o['median_pct']:+.2f} % / {o['wall_pct']:+.2f} %" if o else ""
        lines.append(f"| {x['name']} | {x['state'][:40]} | {x['step_median_s']:.4f} | "
                     f"{x['tokens_per_s']:,.0f} | {x['mfu']:.1%} | {ov} |")
    return lines


def _projection_lines(s: dict[str, Any], proj: dict[str, Any]) -> list[str]:
    """The goodput projection section: each checkpointing method at its best interval."""
    if not proj:
        return []
    gp = s["goodput_projection"]
    lines = ["", f"## Goodput projection ({gp['nodes']} nodes, one failure per node per "
             f"{gp['node_mtbf_days']:.0f} days: job MTBF {gp['job_mtbf_s'] / 3600:.1f} h; recovery "
             f"{gp['recovery_s']:.1f} s = {_rec_label(gp)}; cost per save = the visible stall "
             "of each method)", "",
             "| checkpointing | cost per save s | Young/Daly interval s | best goodput | "
             "goodput at 30 min |", "|---|---|---|---|---|"]
    for k, p in proj.items():
        lines.append(f"| {k} | {p['delta_s']:.3f} | {p['best_interval_s']:.0f} | "
                     f"{p['best_goodput']:.4%} | {p['goodput_at_30min']:.4%} |")
    lines += ["", "![goodput](goodput.png)"]
    return lines


def _rec_label(gp: dict[str, Any]) -> str:
    if gp.get("recovery_source") == "1b kill":
        return "the measured 1b in-job restart, loaded from the node-local host copy"
    return "the measured kill recovery with the 1b checkpoint's cold load"


def _overlap_row(ov: dict[str, Any] | None) -> list[str]:
    if not ov:
        return []
    return [f"| **ours, staging=overlap ({ov['run']} run)** | {_f(ov['blocking_s'])} | visible "
            f"{_f(ov['visible_s'])} s (return + the next step's excess over a quiet "
            f"{_f(ov['quiet_s'])} s step; per save {', '.join(_f(x) for x in ov['visible_all_s'])}); "
            f"floor of that run {_f(ov['d2h_floor_s'])} s |"]
