"""The run directory layout and the one check of what a committed checkpoint is."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kfp_nvrx.components.core import rundir
from kfp_nvrx.components.core.rundir import (
    COMMIT_MARKER,
    checkpoints_dir,
    committed_steps,
    step_dir,
    verify,
    write_commit_marker,
)
from kfp_nvrx.components.training.export.checkpoint_read import select_checkpoint


def _checkpoint(run: Path, step: int) -> Path:
    """A checkpoint as the trainer leaves it: data files, DCP metadata, CRC sidecar, marker."""
    path = step_dir(checkpoints_dir(run), step)
    path.mkdir(parents=True)
    data = {"__0_0.distcp": os.urandom(2048), ".metadata": b"meta" * 8}
    for name, blob in data.items():
        (path / name).write_bytes(blob)
    sums = {"__0_0.distcp": rundir.crc32_file(path / "__0_0.distcp")}
    (path / f"{rundir.CRC_SIDECAR_PREFIX}0.json").write_text(json.dumps(sums))
    write_commit_marker(path, step, world_size=1)
    return path


@pytest.mark.parametrize("marker", [
    {"files": {}},
    {},
    [],
    {"files": {"__0_0.distcp": 2048}},  # no DCP metadata listed
    {"files": {".metadata": "32"}},
    {"files": {".metadata": 32}, "crc32": {".metadata": "x"}},
])
def test_forged_or_incomplete_marker_is_not_committed(tmp_path: Path, marker) -> None:
    run = tmp_path / "run"
    good = _checkpoint(run, 4)
    assert verify(good) is None
    forged = step_dir(checkpoints_dir(run), 8)
    forged.mkdir()
    (forged / ".metadata").write_bytes(b"meta" * 8)
    (forged / COMMIT_MARKER).write_text(json.dumps(marker))
    assert committed_steps(checkpoints_dir(run)) == [8, 4]  # has a marker ...
    assert verify(forged) is not None  # ... but is not committed
    logged: list[str] = []
    assert select_checkpoint(run, log=logged.append).step == 4
    assert len(logged) == 1 and "step_00000008" in logged[0]


def test_forged_marker_is_skipped_by_export_and_reported_by_drills(tmp_path: Path) -> None:
    from kfp_nvrx.components.drills.measure import run_dir_problems
    from kfp_nvrx.components.training.export.consolidate import list_checkpoints

    run = tmp_path / "run"
    _checkpoint(run, 4)
    forged = step_dir(checkpoints_dir(run), 8)
    forged.mkdir()
    (forged / COMMIT_MARKER).write_text('{"files": {}}')
    by_step = {c.step: c for c in list_checkpoints(run)}
    assert by_step[4].committed and not by_step[8].committed
    assert by_step[8].problem == verify(forged)
    problems = run_dir_problems(run)
    assert len(problems) == 1 and "committed step 8" in problems[0]


def test_marker_records_sizes_and_crcs_and_catches_damage(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "run", 2)
    marker = json.loads((path / COMMIT_MARKER).read_text())
    assert marker["step"] == 2 and marker["bytes"] == sum(marker["files"].values())
    assert {"__0_0.distcp", ".metadata"} <= set(marker["files"]) and marker["files"][".metadata"] == 32
    assert set(marker["crc32"]) == {"__0_0.distcp", ".metadata"}
    assert not list(path.glob(".*.tmp"))
    blob = bytearray((path / "__0_0.distcp").read_bytes())
    blob[7] ^= 0xFF
    (path / "__0_0.distcp").write_bytes(bytes(blob))
    assert "CRC32" in verify(path)
    (path / COMMIT_MARKER).write_bytes(b"\xff\xfe")
    assert "unreadable commit marker" in verify(path)


def test_step_names_round_trip(tmp_path: Path) -> None:
    assert step_dir(tmp_path, 40).name == "step_00000040"
    assert rundir.parse_step("step_00000040") == 40
    assert rundir.parse_step("step_x") is None and rundir.parse_step(".trash-step_1") is None


@pytest.mark.parametrize("entry, make, says", [
    ("events.jsonl", "fifo", "a FIFO (named pipe), where kfp-nvrx writes a file"),
    ("events.jsonl", "dir", "a directory, where kfp-nvrx writes a file"),
    ("config.yaml", "fifo", "a FIFO (named pipe), where kfp-nvrx writes a file"),
    ("checkpoints", "file", "a file, where kfp-nvrx writes a folder"),
    ("logs/node0.log", "fifo", "a FIFO (named pipe), where kfp-nvrx writes a file"),
])
def test_a_special_file_where_we_write_is_refused_before_the_run(
        tmp_path: Path, entry: str, make: str, says: str) -> None:
    """A FIFO at events.jsonl hung the run; a folder there gave a traceback per restart (30.14)."""
    from kfp_nvrx.components.errors import UserError

    run = tmp_path / "run"
    path = run / entry
    path.parent.mkdir(parents=True)
    {"fifo": os.mkfifo, "dir": os.mkdir, "file": lambda p: Path(p).write_text("x")}[make](path)
    with pytest.raises(UserError) as err:
        rundir.check_run_dir_links(run)
    assert err.value.field == "run_dir" and says in err.value.message, err.value.message
    assert str(path) in err.value.message
