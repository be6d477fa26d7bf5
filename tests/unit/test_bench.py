"""The benchmark package on a CPU machine: projection maths, report from recorded JSON, CUDA check.

No timing is asserted anywhere: the benchmarks themselves only run on a GPU (``make bench``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.projection import best_interval, goodput, job_mtbf_s, young_daly
from bench.summary import build_report

RECORDED = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
ISSUE_KEYS = ("stall_over_d2h_floor", "torch_save_over_stall", "stager_over_stall",
              "dcp_async_over_stall", "overhead_pct", "recovery_inprocess_s", "recovery_injob_s",
              "ckpt_load_over_disk_read", "mfu_1b", "mfu_125m", "overlap_visible_over_d2h_floor",
              "worst_inflight_step_pct")


@pytest.mark.parametrize("delta", [0.3, 10.0, 60.0])
def test_numeric_optimum_matches_young_daly(delta):
    mtbf = job_mtbf_s(16, 30)
    tau, best = best_interval(delta, 20.0, mtbf)
    assert tau == pytest.approx(young_daly(delta, mtbf), rel=0.05)
    assert all(goodput(t, delta, 20.0, mtbf) <= best + 1e-12 for t in (tau / 3, tau * 3, 60, 3600))
    assert 0 < best < 1


def test_cheaper_checkpoints_keep_more_goodput():
    mtbf = job_mtbf_s(16, 30)
    assert best_interval(0.5, 20, mtbf)[1] > best_interval(20, 20, mtbf)[1]
    assert goodput(1800, 0.5, 20, mtbf) > goodput(1800, 0.5, 600, mtbf)


def test_report_from_recorded_json_has_every_issue_key(tmp_path):
    for f in RECORDED.glob("*.json"):
        if f.name != "summary.json":
            shutil.copy(f, tmp_path / f.name)
    if not (tmp_path / "ckpt_stall.json").exists():
        pytest.skip("no recorded benchmark JSON in docs/benchmarks")
    summary = build_report(tmp_path)
    for key in ISSUE_KEYS:
        assert isinstance(summary[key], float), key
    assert summary["machine"]["gpu"] and summary["machine"]["nvidia_resiliency_ext"]
    text = (tmp_path / "README.md").read_text()
    assert "| figure | measured | target | met |" in text
    assert json.loads((tmp_path / "summary.json").read_text())["mfu_1b"] == summary["mfu_1b"]


def test_bench_refuses_without_cuda_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: bench.run would start measuring")
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        "bench: needs a CUDA GPU (torch.cuda.is_available() is False)"
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def _write(folder: Path, name: str, obj: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(obj))


def _machine(date: str, gpus: int) -> dict:
    return {"gpu": "NVIDIA H200", "gpu_count": gpus, "torch": "2.11", "date": date,
            "nvidia_resiliency_ext": "0.7.0"}


def _scenario(kind: str, total: float, detection: float, restart_kind: str) -> dict:
    return {"kind": kind, "state": "Succeeded", "total_s": total, "detection_s": detection,
            "restart_s": 1.0, "setup_s": 1.0, "load_s": 0.5, "first_step_s": 0.3,
            "restart_kind": restart_kind}


def _tp_row(preset: str, gpus: int, compile_on: bool, tok_per_gpu: float, mfu: float) -> dict:
    name = f"{preset} compile={'on' if compile_on else 'off'}" + (f" {gpus}gpu" if gpus > 1 else "")
    return {"name": name, "preset": preset, "mode": "direct", "kind": "throughput", "gpus": gpus,
            "compile": compile_on, "state": "Succeeded", "step_median_s": 0.3,
            "wall_per_step_s": 0.3, "tokens_per_s": tok_per_gpu * gpus,
            "tokens_per_s_per_gpu": tok_per_gpu, "mfu": mfu}


def test_summary_round_two_keys_from_synthetic_runs(tmp_path):
    _write(tmp_path, "recovery", {"preset": "125m", "gpus": 1, "machine": _machine("d1", 2),
                                  "scenarios": {"kill": _scenario("in-job", 9.0, 1.0, "in-job"),
                                                "hang": _scenario("in-job", 12.0, 4.5, "in-job")}})
    _write(tmp_path, "recovery_2gpu", {
        "preset": "125m", "gpus": 2, "machine": _machine("d2", 2),
        "scenarios": {"kill": _scenario("in-job", 11.0, 1.0, "in-job"),
                      # ft_launcher restarted the group: no in-process figure may come from it
                      "raise": _scenario("in-process", 20.0, 0.0, "in-job"),
                      "hang": {"kind": "in-job", "state": "Failed", "error": "no fault event"}}})
    _write(tmp_path, "throughput", {"machine": _machine("d3", 2), "runs": [
        _tp_row("1b", 1, False, 56000.0, 0.47), _tp_row("1b", 2, False, 53200.0, 0.445),
        _tp_row("1b", 2, True, 60000.0, 0.52), _tp_row("125m", 1, False, 9e5, 0.2)]})
    s = build_report(tmp_path)
    assert s["recovery_injob_s_2gpu"] == 11.0
    assert s["recovery_inprocess_s_2gpu"] is None
    assert "in-job restart" in s["null_reasons"]["recovery_inprocess_s_2gpu"]
    assert s["hang_detect_s"] == 4.5
    assert s["hang_detect_s_2gpu"] is None and "no fault event" in s["null_reasons"]["hang_detect_s_2gpu"]
    assert s["scaling_efficiency_2gpu"] == pytest.approx(53200 / 56000)
    assert s["mfu_1b_2gpu"] == 0.52
    assert s["worst_inflight_step_pct"] is None
    assert "ckpt_stall" in s["null_reasons"]["worst_inflight_step_pct"]
    assert s["overlap_visible_over_d2h_floor"] is None
    assert {k: v["date"] for k, v in s["runs"].items()} == {"recovery": "d1", "recovery_2gpu": "d2",
                                                           "throughput": "d3"}
    assert s["runs"]["recovery_2gpu"]["gpus"] == 2
    text = (tmp_path / "README.md").read_text()
    assert "| weak scaling 1→2 GPUs (1b eager, tokens/s/GPU) | 0.950 | ≥ 0.95 | yes |" in text
    assert "recovery_inprocess_s_2gpu: not measured" in text


def test_summary_without_two_gpu_runs_says_why(tmp_path):
    _write(tmp_path, "throughput", {"machine": _machine("d3", 1),
                                    "runs": [_tp_row("1b", 1, False, 56000.0, 0.47)]})
    s = build_report(tmp_path)
    for key in ("recovery_injob_s_2gpu", "recovery_inprocess_s_2gpu", "hang_detect_s",
                "scaling_efficiency_2gpu", "mfu_1b_2gpu", "worst_inflight_step_pct"):
        assert s[key] is None and s["null_reasons"][key], key
    assert "found 1 and 0" in s["null_reasons"]["scaling_efficiency_2gpu"]


def test_bench_run_adds_the_two_gpu_runs_only_with_two_gpus():
    from bench.run import jobs

    one = jobs(["throughput", "recovery"], quick=False, gpus=1)
    assert [(m, o) for m, o, _ in one] == [("throughput", "throughput"), ("recovery", "recovery"),
                                           ("recovery", "recovery_1b")]
    assert not any("--gpus" in a for _, _, a in one)
    two = jobs(["throughput", "recovery"], quick=False, gpus=2)
    assert [(m, o, a[-2:]) for m, o, a in two] == [
        ("throughput", "throughput", ["--gpus", "2"]),
        ("recovery", "recovery", ["--preset", "125m"]),
        ("recovery", "recovery_1b", ["--preset", "1b"]),
        ("recovery", "recovery_2gpu", ["--gpus", "2"])]


def test_throughput_variants_on_two_gpus_go_through_launch_local():
    from bench.throughput import _variants

    vs = _variants({"125m": 10, "1b": 10}, 5, 2, gpus=2)
    two = [v for v in vs if v.get("gpus") == 2]
    assert {v["name"] for v in two} == {"125m compile=off 2gpu", "125m compile=on 2gpu",
                                        "1b compile=off 2gpu", "1b compile=on 2gpu"}
    assert all(v["mode"] == "ft" and "resilience.monitor=off" in v["set"] for v in two)
    assert len(_variants({"125m": 10, "1b": 10}, 5, 2)) == len(vs) - 4


def test_recovery_split_keeps_every_restarts_boot_parts():
    from bench.recovery import split

    boot0 = {"imports": 3.0, "total": 5.0}
    boot1 = {"interpreter": 0.1, "imports": 3.1, "cuda_context": 0.4, "load": 0.5, "total": 6.0}
    events = [{"type": "start", "time": 0.0, "boot": boot0},
              {"type": "step", "step": 1, "start": 5.0, "end": 6.0},
              {"type": "fault", "time": 10.0, "step": 2},
              {"type": "restart", "kind": "in-job"},
              {"type": "start", "time": 12.0, "load_s": 0.5, "resumed_from": 1, "boot": boot1},
              {"type": "step", "step": 2, "start": 18.0, "end": 19.0}]
    lines = [(11.0, "Event: failure_detected"), (11.5, "Event: worker_start_completed")]
    out = split(events, lines, in_process=False)
    assert out["total_s"] == 9.0 and out["detection_s"] == 1.0 and out["launcher_s"] == 0.5
    # start: the worker's own start (spawned at 11.5, incarnation at 12.0) plus its setup
    # (12.0 -> first step 18.0, less the 0.5 s load)
    assert out["start_s"] == 0.5 + 5.5 and out["load_s"] == 0.5
    assert out["boot"] == boot1 and out["boots"] == [boot1]


def test_report_puts_1b_and_125m_recovery_side_by_side_with_the_p5_projection(tmp_path):
    from bench.projection import fsx_gb_per_s
    from bench.summary import build_report

    def rec(preset, kill_total, from_memory):
        return {"preset": preset, "gpus": 1, "machine": _machine("d", 1), "scenarios": {
            "raise": {"kind": "in-process", "total_s": 1.5, "detection_s": 0.0, "launcher_s": 0.5,
                      "start_s": 0.3, "load_s": 0.4, "first_step_s": 0.3, "from_memory": True,
                      "restart_kind": "in-process", "resumed_from": 20},
            "kill": {"kind": "in-job", "total_s": kill_total, "detection_s": 0.2,
                     "launcher_s": 2.0, "start_s": 6.0, "load_s": 1.0, "first_step_s": 0.8,
                     "from_memory": from_memory, "restart_kind": "in-job", "resumed_from": 20},
            "hang": {"kind": "in-job", "total_s": 14.0, "detection_s": 4.4, "launcher_s": 2.0,
                     "start_s": 6.0, "load_s": 1.0, "first_step_s": 0.6, "from_memory": True,
                     "restart_kind": "in-job", "resumed_from": 20}}}

    _write(tmp_path, "recovery", rec("125m", 9.0, True))
    _write(tmp_path, "recovery_1b", rec("1b", 11.0, True))
    s = build_report(tmp_path)
    assert s["recovery_injob_s_1b"] == 11.0 and s["recovery_inprocess_s_1b"] == 1.5
    assert s["hang_detect_s_1b"] == 4.4 and "recovery_injob_s_1b" not in s["null_reasons"]
    text = (tmp_path / "README.md").read_text()
    assert "| kill | 1b | in-job | **11.00** | 0.20 | 2.00 | 6.00 | 1.00 | 0.80 | memory | 20 |" in text
    assert "| kill | 125m | in-job | **9.00** |" in text
    assert "recovery in-job (kill), 1b, s | 11.00 | ≤ 12 s | yes" in text
    # No 1b checkpoint-stall run here: no state size to project with, so no projection.
    assert s["goodput_projection_p5"] == {}
    assert abs(fsx_gb_per_s(True) - 1.56) < 1e-9 and abs(fsx_gb_per_s(False) - 0.24) < 1e-9


def test_p5_projection_reads_every_nodes_state_from_fsx_only_without_the_host_copy():
    from bench.recovery_report import projection

    kill = {"total_s": 11.0, "load_s": 1.0}
    p = projection(kill, 13.25, 0.03)
    n16, n128 = p["nodes"]["16"]["paths"], p["nodes"]["128"]["paths"]
    memory, fsx = "node kept: host memory", "node replaced: every node reads FSx (burst)"
    assert n16[memory]["recovery_s"] == 11.0
    node_gb = 8 * 13.25
    assert abs(n16[fsx]["recovery_s"] - (10 + 16 * node_gb / 1.56)) < 1e-6
    assert abs(n128[fsx]["recovery_s"] - (10 + 128 * node_gb / 1.56)) < 1e-6
    assert n128[memory]["best_goodput"] > n128[fsx]["best_goodput"]
    # From host memory half a snapshot interval is redone; from FSx the durable tier's lag:
    # half its period (a write 25 % of the time) plus a write of every node's state.
    write_s = 128 * node_gb / 1.56
    assert abs(n128[fsx]["redone_s"] - (write_s / 0.25 / 2 + write_s)) < 1e-6
    assert n128[memory]["redone_s"] == n128[memory]["best_interval_s"] / 2


def test_p5_projection_restores_a_replaced_node_from_its_peer_at_the_measured_rate():
    from bench.recovery_report import peer_figures, projection

    kill = {"total_s": 11.0, "load_s": 1.0}
    peer = peer_figures({"transfer": {"gb_per_s": [0.9, 0.5, 0.8]},
                         "round_beside_training": {"excess_per_round_s": 0.1}})
    assert peer == {"rank_gb_per_s": 0.8, "round_cost_s": 0.1}  # the median rate
    p = projection(kill, 13.25, {10.0: 0.03}, peer=peer)
    n128 = p["nodes"]["128"]["paths"]
    from_peer, memory = "node replaced: restored from a peer", "node kept: host memory"
    # The replaced node's ranks fetch their copies in parallel, then load as the restart did.
    assert abs(n128[from_peer]["recovery_s"] - (11.0 + 13.25 / 0.8)) < 1e-6
    # Replication on: every snapshot also pays a round, on every path.
    assert abs(n128[memory]["cost_per_snapshot_s"] - 0.13) < 1e-9
    assert n128[from_peer]["redone_s"] == n128[from_peer]["best_interval_s"] / 2
    assert n128[memory]["best_goodput"] > n128[from_peer]["best_goodput"] > 0.99
    without = projection(kill, 13.25, {10.0: 0.03})["nodes"]["128"]["paths"]
    assert from_peer not in without and without[memory]["best_goodput"] > n128[memory]["best_goodput"]
    # A rate above AWS's per-flow TCP limit (10 Gbit/s) is capped by it.
    fast = projection(kill, 13.25, {10.0: 0.03}, peer={"rank_gb_per_s": 50.0, "round_cost_s": 0})
    assert abs(fast["nodes"]["16"]["paths"][from_peer]["recovery_s"] - (11.0 + 13.25 / 1.25)) < 1e-6
    assert peer_figures({}) == {}


def test_snapshot_bench_counts_the_steps_done_before_a_kill_as_redone_not_the_killed_one():
    """A kill at step 62 lands before step 62 runs: resumed from 44, steps 45-61 are redone (17)."""
    from bench.snapshots import _recovery

    events: list[dict] = [{"type": "start", "time": 0.0, "resumed_from": None}]
    events += [{"type": "step", "step": s, "start": s - 1.0, "end": float(s)} for s in range(1, 62)]
    events += [{"type": "fault", "kind": "kill", "step": 62, "time": 61.1},
               {"type": "start", "time": 66.0, "resumed_from": 44, "from_memory": True,
                "load_s": 1.0}]
    events += [{"type": "step", "step": s, "start": s + 21.0, "end": s + 22.0} for s in range(45, 70)]
    assert _recovery(events) == [{"fault": "kill@62", "resumed_from": 44, "steps_redone": 17,
                                  "from_memory": True, "load_s": 1.0}]


def test_snapshot_bench_splits_each_kind_of_steps_excess_by_the_steps_parts():
    from bench.snapshots import measure

    events: list[dict] = [{"type": "start", "time": 0.0}]
    for i in range(1, 21):
        slow_launch = 0.05 if i in (12, 13) else 0.0  # beside the write: the thread waited
        slow_gpu = 0.04 if i in (6, 7) else 0.0  # the snapshot's step and the next: kernels
        parts = {"data": 0.01, "forward_backward": 0.1 + slow_launch, "optimizer": 0.02,
                 "sync": 0.17 + slow_gpu, "tick": 0.0, "monitor": 0.0, "gpu": 0.28 + slow_gpu}
        start = float(i)
        events.append({"type": "step", "step": i, "start": start,
                       "end": start + 0.3 + slow_launch + slow_gpu, "parts": parts})
    events.append({"type": "snapshot", "step": 6, "time": 6.4, "stall_s": 0.01})
    events.append({"type": "checkpoint", "step": 6, "time": 13.9, "total_s": 2.0,
                   "blocking_s": 0.0})
    lines = [(5.0, "[trainer] staging bank 0 ready: 0.06 GB mapped and pinned (2 of 2 pieces "
                   "while the loop waited for the GPU) in 1.2 s (1 ready)")]
    row = measure(events, lines=lines)
    assert row["first_snapshot_step"] == 6 and row["banks_ready"] == [lines[0][1][10:]]
    got = row["parts_by_what_ran_beside_s"]
    assert got["snapshot"]["sync"] == 0.08 and got["snapshot"]["forward_backward"] == 0.0
    assert got["writing"]["forward_backward"] == 0.1 and got["writing"]["gpu"] == 0.0
    assert got["other"]["sync"] == 0.0


def test_a_snapshot_run_repeats_warm_for_the_ab():
    """Issue 37's open question: ``defaults+warm`` is ``defaults`` with warm worker starts."""
    from bench.snapshots import _training

    cold, warm = _training("1b", "defaults", "/d"), _training("1b", "defaults+warm", "/d")
    assert warm.overrides == [*cold.overrides, "resilience.warm_start=true"]
    assert warm.faults == cold.faults


def test_a_snapshot_run_name_adds_overrides_and_refuses_unknown_suffixes():
    """``defaults+train.step_parts=false``: the same run without the step-parts diagnostic."""
    from bench.snapshots import _training

    base = _training("1b", "defaults", "/d")
    off = _training("1b", "defaults+train.step_parts=false+warm", "/d")
    assert off.overrides == [*base.overrides, "train.step_parts=false",
                             "resilience.warm_start=true"]
    with pytest.raises(SystemExit, match=r"\+bogus"):
        _training("1b", "defaults+bogus", "/d")
