"""A damaged checkpoint at resume is said in one clear line (issue 30 item 17).

The drills' corrupt-newest and truncate-newest scenarios logged ``checkpoint step 8 is damaged
(__1_3.distcp is 141208 bytes, expected 282416 (truncated or corrupt)); falling back to an older
one``: parentheses in parentheses, a file without its folder, and no step named to fall back to.
Now: which step, which file (its path), what is wrong, and the step resumed from instead.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.core.rundir import (
    COMMIT_MARKER,
    DCP_METADATA,
    checkpoints_dir,
    step_dir,
    verify,
)
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.local.run import free_port
from kfp_nvrx.components.training.checkpoint.recovery import Recovery
from kfp_nvrx.components.training.export.checkpoint_read import select_checkpoint

DATA = "__0_0.distcp"


@pytest.fixture()
def pg():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _commit(run: Path, step: int) -> Path:
    """A committed step with sizes and CRC32s in its marker, as the writer leaves it."""
    path = step_dir(checkpoints_dir(run), step)
    path.mkdir(parents=True)
    (path / DCP_METADATA).write_bytes(b"meta")
    (path / DATA).write_bytes(bytes(range(256)) * 4)
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    crcs = {p.name: zlib.crc32(p.read_bytes()) for p in path.iterdir()}
    (path / COMMIT_MARKER).write_text(json.dumps({"step": step, "world_size": 1, "files": files,
                                                  "crc32": crcs}))
    return path / DATA


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(bytes(raw))


def _select(run: Path, *overrides: str) -> tuple[int | None, list[str]]:
    cfg = load_config("tiny", list(overrides)).checkpoint
    lines: list[str] = []
    found = Recovery(run, cfg, torch.device("cpu"), None, log=lines.append).select(log=lines.append)
    return found, lines


def test_a_corrupt_newest_step_is_one_line_naming_file_problem_and_fallback(tmp_path, pg):
    run = tmp_path / "run"
    _commit(run, 4)
    _commit(run, 8)
    _flip(_commit(run, 12))
    found, lines = _select(run)
    assert found == 8
    assert lines == [f"checkpoint step 12 is damaged: {step_dir(checkpoints_dir(run), 12) / DATA} "
                     "fails its CRC32 check, so its bytes changed after the commit; falling back "
                     "to step 8"]


def test_each_damaged_step_names_the_step_resumed_from(tmp_path, pg):
    run = tmp_path / "run"
    _commit(run, 4)
    _flip(_commit(run, 8))
    data = _commit(run, 12)
    os.truncate(data, 512)
    found, lines = _select(run)
    assert found == 4 and len(lines) == 2
    assert lines[0] == (f"checkpoint step 12 is damaged: {data} has 512 bytes where its commit "
                        "recorded 1024, so it was truncated or overwritten; falling back to step 4")
    assert lines[1].startswith("checkpoint step 8 is damaged: ")
    assert lines[1].endswith("; falling back to step 4")
    assert all("(" not in line and "\n" not in line for line in lines)


def test_no_intact_step_left_is_said(tmp_path, pg):
    run = tmp_path / "run"
    data = _commit(run, 4)
    data.unlink()
    found, lines = _select(run)
    assert found is None
    assert lines == [f"checkpoint step 4 is damaged: {data} is missing; no older intact "
                     "checkpoint to fall back to"]


def test_a_damaged_load_step_is_refused_in_one_line(tmp_path, pg):
    run = tmp_path / "run"
    _commit(run, 4)
    data = _commit(run, 8)
    _flip(data)
    with pytest.raises(UserError) as err:
        _select(run, "checkpoint.load_step=8")
    assert err.value.field == "checkpoint.load_step"
    assert err.value.message == (f"step 8 is damaged: {data} fails its CRC32 check, so its "
                                 "bytes changed after the commit; give another step, or -1 for "
                                 "the newest intact one")


def test_verify_and_the_disk_only_selection_say_it_the_same_way(tmp_path):
    run = tmp_path / "run"
    _commit(run, 4)
    data = _commit(run, 8)
    _flip(data)
    assert verify(data.parent) == (f"{data} fails its CRC32 check, so its bytes changed after "
                                   "the commit")
    lines: list[str] = []
    assert select_checkpoint(run, log=lines.append).step == 4
    assert lines == [f"skipping damaged checkpoint step_00000008: {verify(data.parent)}"]


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_a_fifo_or_folder_in_place_of_a_checkpoint_file_is_said_as_what_it_is(tmp_path,
                                                                               kind) -> None:
    """Issue 38 item 4: a FIFO where a committed file belongs was reported as "missing"."""
    run = tmp_path / "run"
    _commit(run, 4)
    data = _commit(run, 8)
    data.unlink()
    os.mkfifo(data) if kind == "fifo" else data.mkdir()
    what = "a FIFO (named pipe)" if kind == "fifo" else "a directory"
    assert verify(data.parent) == f"{data} is {what}, not the file its commit recorded"
    assert select_checkpoint(run, log=lambda _l: None).step == 4
