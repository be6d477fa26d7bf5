"""``kfp-nvrx drill``: the figures it computes, the checks it relies on, and ``drill --quick`` itself.

The quick drill runs real ft_launcher agents (2 local nodes x 1 process, gloo): a fault-free
reference, a kill followed by a byte-flipped newest checkpoint (must fall back to the previous
one, say so, and still end bitwise equal to the reference), SIGTERM to ``launch-local`` (exit 143,
nothing left running, every committed checkpoint intact) and more faults than
``resilience.max_restarts`` (Failed, with the reason). Recovery seconds are reported, not asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from kfp_nvrx.components.core.events import Checkpoint, Start
from kfp_nvrx.components.core.rundir import COMMIT_MARKER, verify
from kfp_nvrx.components.drills import measure
from kfp_nvrx.components.drills.results import Row, markdown, table
from kfp_nvrx.components.drills.scenarios import SCENARIOS, select
from kfp_nvrx.components.errors import UserError

QUICK = {"corrupt-newest", "launcher-sigterm", "max-restarts"}


def test_scenario_selection() -> None:
    assert {s.name for s in select(None, quick=True)} == QUICK
    assert len(select(None, quick=False)) == len(SCENARIOS) >= 10
    assert [s.name for s in select(["hang-rank", "kill-rank", "hang-rank"], False)] == \
        ["hang-rank", "kill-rank"]
    with pytest.raises(UserError) as err:
        select(["kill-rank", "nuke"], quick=False)
    assert err.value.field == "scenario" and "'nuke'" in err.value.message


def test_committed_steps_lost_counts_only_committed_progress_thrown_away() -> None:
    events = [
        Start(time=0, resumed_from=None),
        Checkpoint(time=0, step=4), Checkpoint(time=0, step=8),
        Start(time=0, resumed_from=8),  # newest: nothing lost
        Checkpoint(time=0, step=12),
        Start(time=0, resumed_from=8),  # step 12 damaged: 4 committed steps lost
        Start(time=0, resumed_from=None),  # started over: 12 lost
    ]
    assert measure.committed_steps_lost(events) == 16
    assert measure.committed_steps_lost(events[:4]) == 0
    # Killed after writing step 12's marker, before logging it: the drill saw the commit on disk.
    unlogged = [Start(time=0, resumed_from=None), Checkpoint(time=1, step=8),
                Start(time=5, resumed_from=8)]
    assert measure.committed_steps_lost(unlogged) == 0
    assert measure.committed_steps_lost(unlogged, seen=((3.0, 12),)) == 4
    assert measure.committed_steps_lost(unlogged, seen=((6.0, 12),)) == 0  # after the restart


def _fake_checkpoint(path: Path, files: dict[str, bytes]) -> None:
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    marker = {"files": {n: len(d) for n, d in files.items()},
              "crc32": {n: zlib.crc32(d) for n, d in files.items()}}
    (path / COMMIT_MARKER).write_text(json.dumps(marker))


def test_verify_catches_same_size_corruption_and_splits_the_crc_work(tmp_path) -> None:
    files = {"__0_0.distcp": os.urandom(4096), "__1_0.distcp": os.urandom(4096),
             ".metadata": b"meta"}
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000004"
    _fake_checkpoint(ckpt, files)
    assert verify(ckpt) is None and measure.run_dir_problems(run) == []
    with open(ckpt / "__1_0.distcp", "r+b") as fh:  # flip bytes, keep the size
        fh.seek(100)
        fh.write(bytes(b ^ 0xFF for b in files["__1_0.distcp"][100:164]))
    assert "__1_0.distcp fails its CRC32 check" in verify(ckpt)
    # Sorted files: .metadata, __0_0, __1_0 -> share (0, 2) checks .metadata and __1_0.
    assert verify(ckpt, share=(0, 2)) is not None and verify(ckpt, share=(1, 2)) is None
    os.truncate(ckpt / "__0_0.distcp", 10)
    assert "truncated" in verify(ckpt, share=(1, 2))
    (run / ".config.yaml.1.tmp").write_text("")
    # A writer SIGKILLed mid-save: its temp file in a torn step (no marker) is no leak, the
    # next start removes that folder; the same file in a committed step is one.
    torn = run / "checkpoints" / "step_00000006"
    torn.mkdir()
    (torn / "..crc32_rank1.json.7.ab.tmp").write_text("")
    problems = measure.run_dir_problems(run)
    assert len(problems) == 2 and "committed step 4" in problems[0] and ".tmp" in problems[1]
    (ckpt / "..crc32_rank1.json.7.ab.tmp").write_text("")
    assert any("step_00000004/..crc32" in p for p in measure.run_dir_problems(run))


def test_report_table_and_markdown() -> None:
    rows = [Row("kill-rank", "SIGKILL rank 1", "survive", state="Succeeded", survived=True,
                passed=True, restarts={"in-job": 1}, recovery_s=[3.14], bitwise=True),
            Row("disk-full", "fill it", "survive", state="skipped", passed=None,
                notes=["tmpfs mount not permitted"]),
            Row("max-restarts", "kills", "fail cleanly", state="Failed", passed=False,
                failures=["failed without a reason"])]
    text = table(rows)
    assert text.count("\n") == len(rows) + 1
    assert "| kill-rank | survive | Succeeded (in-job 1) | yes | 0 | 0 | 3.1 | yes | yes |" in text
    assert "| skipped |" in text and "| **NO** |" in text
    md = markdown(rows, {"mode": "full", "setup": "tiny"})
    assert md.startswith("# Fault drill (full)") and "FAILED: failed without a reason" in md


@pytest.mark.drill
def test_the_disk_full_drill_leaves_a_run_dir_launch_local_takes(tmp_path) -> None:
    """Its tmpfs mount point sits in the run dir, which launch-local takes only new, empty or ours."""
    from kfp_nvrx.components.core.ownership import check_run_dir_owned
    from kfp_nvrx.components.drills.actions import DiskFull, DrillSkipped

    run_dir = tmp_path / "runs" / "disk-full"
    action = DiskFull(run_dir, ckpt_bytes=1 << 20)
    try:
        action.setup()
    except DrillSkipped as err:  # no permission to mount a tmpfs here
        pytest.skip(str(err))
    try:
        assert (run_dir / "checkpoints" / "ballast").is_file()
        check_run_dir_owned(run_dir)  # raised "not empty and is not a kfp-nvrx run dir" before
    finally:
        action.teardown()
    assert not os.path.ismount(run_dir / "checkpoints")


@pytest.mark.timeout(900)
def test_drill_quick_end_to_end(tmp_path) -> None:
    out = tmp_path / "drill"
    proc = subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "drill", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=880)
    print(proc.stdout)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    report = json.loads((out / "drill.json").read_text())
    rows = {r["scenario"]: r for r in report["rows"]}
    assert set(rows) == QUICK and report["mode"] == "quick"
    assert all(r["passed"] and not r["failures"] for r in rows.values())

    corrupt = rows["corrupt-newest"]
    assert corrupt["survived"] and corrupt["bitwise"] is True
    assert corrupt["committed_steps_lost"] > 0 and corrupt["restarts"].get("in-job", 0) >= 1
    assert any("is damaged; falling back" in n for n in corrupt["notes"])

    sigterm = rows["launcher-sigterm"]
    assert sigterm["state"] == "Cancelled" and any("exit code 143" in n for n in sigterm["notes"])

    maxr = rows["max-restarts"]
    assert maxr["state"] == "Failed" and maxr["survived"] is False
    assert any("resilience.max_restarts=1 allows" in n for n in maxr["notes"])

    md = (out / "drill.md").read_text()
    assert all(f"| {name} |" in md for name in QUICK)
    assert (out / "logs" / "corrupt-newest.log").stat().st_size > 0
