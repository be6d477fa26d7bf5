"""The recovery sweep's bench on a CPU machine (``bench.recovery_sweep`` and its report): the
plan, one row per run, the worst per fault, merged parts. No timing is asserted: the sweep runs on
a GPU (``round5_gpu.sh sweep``).
"""

from __future__ import annotations

import json


def test_make_bench_publishes_the_recovery_sweep_per_preset():
    from bench.run import jobs

    assert [(m, o, a) for m, o, a in jobs(["recovery_sweep"], quick=False, gpus=1)] == [
        ("recovery_sweep", "recovery_sweep_1b", ["--preset", "1b"]),
        ("recovery_sweep", "recovery_sweep_125m", ["--preset", "125m"])]


def test_the_sweep_samples_fault_steps_as_the_issue_asks():
    """Issue 29: >= 4 steps per kind spread over >= 100-step runs, >= 60 steps after each
    restart, saves at the preset's interval, a two-fault run; the same seed, the same plan."""
    from bench.recovery_sweep import KINDS, OWN_GEOMETRY_KINDS, PRESETS, plan

    for preset in ("1b", "125m"):
        runs = plan(preset, 29, 4, list(KINDS))
        assert runs == plan(preset, 29, 4, list(KINDS)) and runs != plan(preset, 30, 4, list(KINDS))
        p = PRESETS[preset]
        for kind in KINDS:
            steps = sorted(r["fault_steps"][0] for r in runs if r["kind"] == kind)
            assert len(set(steps)) == 4, (kind, steps)
            assert steps[-1] - steps[0] >= p["min_steps"] / 3, (kind, steps)  # spread out
            if kind == "kill-in-ckpt":
                assert all(s % p["interval"] == 0 for s in steps)
        [two] = [r for r in runs if r["kind"] == "kill+hang"]
        assert two["fault_steps"][1] - two["fault_steps"][0] >= p["lead"]
        # Issue 37: a hang in the first 10 steps, and one 4-10 steps after a restart that
        # resumes from the first snapshot (the kill lands past its copies and seal).
        [early] = [r["fault_steps"] for r in runs if r["kind"] == "hang-start"]
        assert 3 <= early[0] <= 10
        [(kill, hang)] = [r["fault_steps"] for r in runs if r["kind"] == "kill+hang-restart"]
        assert p["interval"] + 3 <= kill < hang and 4 <= hang - p["interval"] <= 10
        for r in runs:
            assert r["steps"] >= max(p["min_steps"], max(r["fault_steps"]) + p["lead"])
        assert [r["index"] for r in runs] == list(range(len(runs)))
        assert [r["kind"] for r in runs[:7]] == [*KINDS, *OWN_GEOMETRY_KINDS]  # every kind early


def test_a_sweep_row_counts_restarts_redone_steps_and_the_source():
    from bench.recovery_sweep import measure, summarise

    events = [
        {"type": "start", "time": 0.0, "resumed_from": None, "incarnation": 0, "iteration": 0},
        *[{"type": "step", "step": s, "start": s - 1.0, "end": float(s), "incarnation": 0,
           "iteration": 0} for s in range(1, 15)],
        {"type": "checkpoint", "step": 10, "total_s": 20.0, "bytes": 1},
        {"type": "fault", "kind": "kill", "step": 15, "rank": 0, "time": 14.5},
        {"type": "restart", "kind": "in-job", "incarnation": 1, "iteration": 0, "time": 20.0},
        {"type": "start", "time": 20.0, "resumed_from": 10, "from_memory": True, "load_s": 1.0,
         "incarnation": 1, "iteration": 0},
        *[{"type": "step", "step": s, "start": 21.0 + s - 11, "end": 22.0 + s - 11,
           "incarnation": 1, "iteration": 0} for s in range(11, 20)],
    ]
    lines = [(15.0, "[node0] failed (exitcode: -9)")]
    run = {"kind": "kill", "faults": ["kill@15"], "fault_steps": [15], "steps": 19}
    row = measure(run, {"events": events, "lines": lines, "state": "Succeeded", "wall_s": 30.0},
                  interval=10)
    assert row["restarts"] == 1 and row["faults"] == 1 and row["from"] == ["memory"]
    assert row["steps_redone"] == 4  # step 14 was done, the restart took 10
    assert row["recovery_s"] == 22.0 - 14.5 and row["commit_lag_s"] == {"median": 20.0, "max": 20.0}
    s = summarise([{**row, "index": 0}])
    assert s["restarts_equal_faults"] and s["kill"]["steps_redone_worst"] == 4


def _sweep_row(index: int, kind: str, faults: list[str], splits: list[dict], **kw) -> dict:
    return {"index": index, "kind": kind, "faults": len(faults), "state": "Succeeded",
            "restarts": len(faults), "interval": 40, "steps_redone": 5,
            "fault_steps": [int(f.split("@")[1]) for f in faults],
            "split": [{"fault": f, **s} for f, s in zip(faults, splits, strict=True)],
            "recovery_s": max(s["total_s"] for s in splits), "detect_s": None, **kw}


def test_the_sweeps_worst_is_taken_per_fault_and_each_fault_is_a_row(tmp_path):
    """A two-fault run's kill counts as a kill and its hang as a hang (issue 37's targets), and
    the report lists every fault's recovery in its parts; merged parts keep their origin."""
    from bench.recovery_report import sweep_lines
    from bench.recovery_sweep import fault_rows, merge
    from bench.summary import sweep_keys

    kill = {"total_s": 4.5, "detection_s": 1.3, "launcher_s": 0.04, "start_s": 1.4, "load_s": 1.0,
            "first_step_s": 0.66, "from_memory": True, "resumed_from": 40}
    hang = {**kill, "total_s": 8.7, "detection_s": 4.1}
    old = {"kind": "hang", "faults": 1, "state": "Succeeded", "restarts": 1, "interval": 40,
           "steps_redone": 9, "fault_steps": [50], "index": 1, "recovery_s": 16.2, "detect_s": 4.2,
           "split": [{**hang, "total_s": 16.2, "detection_s": 4.2}]}  # before splits named faults
    parts = []
    for i, runs in enumerate([[_sweep_row(0, "kill+hang", ["kill@41", "hang@50"], [kill, hang])],
                              [old, _sweep_row(0, "raise", ["raise@7"], [{**kill, "total_s": 0.6}])]]):
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps({"preset": "1b", "seed": 29, "runs": runs, "set": [],
                                         "commit": f"c{i}", "machine": {"gpu": "G", "date": "d"}}))
    merge([str(p) for p in parts], str(tmp_path / "sweep.json"))
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [(r["index"], r["part"]) for r in sweep["runs"]] == [(0, 1), (0, 2), (1, 2)]
    assert [p["commit"] for p in sweep["parts"]] == ["c0", "c1"]
    assert [(k, x["fault"]) for k, _, x in fault_rows(sweep["runs"])] == [
        ("kill", "kill@41"), ("hang", "hang@50"), ("raise", "raise@7"), ("hang", "hang@50")]
    k = sweep_keys("1b", sweep)
    assert (k["sweep_1b_injob_kill_worst_s"], k["sweep_1b_hang_to_step_worst_s"]) == (4.5, 16.2)
    assert k["sweep_1b_hang_detect_worst_s"] == 4.2 and k["sweep_1b_inprocess_worst_s"] == 0.6
    assert k["sweep_1b_faults"] == 4
    table = [ln for ln in sweep_lines({"1b": sweep}, {}) if ln.startswith("| 1:0 | kill@41")]
    assert table and "**4.50** | 1.30 | 0.04 | 1.40 | 1.00 | 0.66 | memory | 40 |" in table[0]
