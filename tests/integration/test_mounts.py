"""Full and read-only mounts: real tmpfs file systems, the real commands (root only).

A run dir on a tmpfs too small for its checkpoints: the launcher says "disk full" in one line
(no ``inline_container.cc ... unexpected pos``, no traceback from its log threads), and the same
command resumes cleanly once there is room. An export to a read-only mount fails before the
checkpoint is read, naming ``--out``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "kfp_nvrx.components.cli"]


def _mount(path: Path, *options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "kfp-nvrx-test",
                           str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"tmpfs mount not permitted here ({proc.stderr.strip()[:100]})")


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    mounted: list[Path] = []
    yield mounted
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from kfp_nvrx.components.data.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("data") / "sample"
    prepare_dataset("sample:200", out, seq_len=64)
    return out


def _launch(run_dir: Path, dataset: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "launch-local", "--run-dir", str(run_dir), "--set", f"data.path={dataset}",
         "--set", "train.steps=24", "--set", "checkpoint.interval=4", "--set",
         "checkpoint.keep=10", "--set", "resilience.max_restarts=1",
         # Every snapshot written (the durable tier's own pace would write only some, and the
         # small volume might never fill): the writer takes each one it is free for.
         "--set", "checkpoint.persist_duty=1", "--set", "train.step_sleep=0.3"],
        capture_output=True, text=True, timeout=400)


def test_disk_full_during_a_checkpoint_is_one_clear_line_and_resumes_once_space_returns(
        tmp_path, dataset, mounts) -> None:
    run_dir = tmp_path / "run"
    _mount(run_dir, "size=3m")  # room for the config, the events and a few tiny checkpoints
    mounts.append(run_dir)
    full = _launch(run_dir, dataset)
    out = full.stdout + full.stderr
    assert full.returncode == 1, out[-3000:]
    assert "disk full: No space left on device" in full.stderr.splitlines()[0], full.stderr
    assert "Traceback" not in out and "_pump" not in out, out[-3000:]
    assert "inline_container" not in out and "unexpected pos" not in out, out[-3000:]
    # Said once per incarnation of the workers, not once per relayed line.
    said = [ln for ln in full.stdout.splitlines() if "disk full:" in ln]
    assert 1 <= len(said) <= 2, said

    subprocess.run(["mount", "-o", "remount,size=64m", str(run_dir)], check=True)
    again = _launch(run_dir, dataset)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["type"] == "start"]
    assert starts[-1]["resumed_from"] is not None  # resumed, not restarted from scratch
    assert any(e["type"] == "end" and e["status"] == "completed" for e in events)
    assert (run_dir / "checkpoints" / "step_00000024" / "COMMITTED").is_file()
    assert not list(run_dir.glob(".*.tmp"))


def _small_run(run_dir: Path) -> None:
    """A run dir with one committed step of the tiny model (DCP, written in-process)."""
    import torch.distributed.checkpoint as dcp
    import yaml

    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.core.rundir import COMMIT_MARKER, step_dir, write_commit_marker
    from kfp_nvrx.components.training.model import build_model

    cfg = load_config("tiny")
    path = step_dir(run_dir / "checkpoints", 2)
    path.mkdir(parents=True)
    dcp.save({"model": build_model(cfg.model).state_dict()},
             storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    write_commit_marker(path, 2, 1)
    assert (path / COMMIT_MARKER).is_file()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))


def test_export_to_a_read_only_mount_fails_before_reading_the_checkpoint(tmp_path,
                                                                        mounts) -> None:
    run_dir = tmp_path / "run"
    _small_run(run_dir)
    ro = tmp_path / "ro"
    _mount(ro, "ro", "size=1m")
    mounts.append(ro)
    proc = subprocess.run([*CLI, "export", "--run-dir", str(run_dir), "--out", str(ro / "model"),
                           "--eval-batches", "0"], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "--out" in lines[0] and str(ro / "model") in lines[0] and ".tmp-" not in lines[0]
    assert "Read-only file system" in lines[0]
    assert "loading model tensors" not in proc.stderr + proc.stdout


def test_export_onto_a_full_mount_names_out_and_its_room_before_reading(tmp_path,
                                                                       mounts) -> None:
    """It read the checkpoint first, then blamed the working dir's file system (issue 30.15)."""
    run_dir = tmp_path / "run"
    _small_run(run_dir)
    small = tmp_path / "small"
    _mount(small, "size=64k")  # the tiny model's weights alone are larger
    mounts.append(small)
    proc = subprocess.run([*CLI, "export", "--run-dir", str(run_dir), "--out",
                           str(small / "model"), "--eval-batches", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("kfp-nvrx export: error: --out: not enough room"), lines[0]
    assert str(small / "model") in lines[0] and "free" in lines[0] and ".tmp-" not in lines[0]
    assert "checkpoint.keep" not in lines[0]  # the trainer's advice does not apply here
    assert "loading model tensors" not in proc.stderr + proc.stdout
    assert list(small.iterdir()) == []


def test_export_onto_a_mount_that_fills_while_writing_names_out(tmp_path, mounts,
                                                               monkeypatch) -> None:
    from kfp_nvrx.components.errors import UserError
    from kfp_nvrx.components.training.export import consolidate

    run_dir = tmp_path / "run"
    _small_run(run_dir)
    small = tmp_path / "small"
    _mount(small, "size=64k")
    mounts.append(small)
    monkeypatch.setattr(consolidate, "free_bytes", lambda _p: 1 << 40)  # the check was fooled
    with pytest.raises(UserError) as err:
        consolidate.export_checkpoint(run_dir, small / "model", eval_batches=0)
    assert err.value.field == "out_dir" and "filled up while the export was written" in str(
        err.value) and str(small / "model") in str(err.value)
    assert list(small.iterdir()) == []


def test_a_log_file_on_a_full_device_is_given_up_once_and_the_stream_goes_on(tmp_path) -> None:
    from kfp_nvrx.components.launch.local.agent_log import AgentLog

    said: list[str] = []
    full = AgentLog(Path("/dev/full"), "[node0]", said.append)  # every write: ENOSPC
    for i in range(5):
        full.write(f"line {i}")
    full.close()
    assert len(said) == 1 and "No space left on device" in said[0], said
    (tmp_path / "target").write_text("keep")
    (tmp_path / "node0.log").symlink_to(tmp_path / "target")
    linked = AgentLog(tmp_path / "node0.log", "[node0]", said.append)
    linked.write("through the link?")
    linked.close()
    assert (tmp_path / "target").read_text() == "keep" and len(said) == 2


def test_the_disk_full_notice_is_said_once_per_incarnation_and_only_for_a_full_disk(
        tmp_path) -> None:
    from kfp_nvrx.components.launch.local.agent_log import DiskFullNotice

    torn = "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    roomy = DiskFullNotice(tmp_path)  # a file system with space: a torn write of another cause
    assert roomy.check(torn) is None and roomy.line is None
    notice = DiskFullNotice(tmp_path)
    first = notice.check("OSError: [Errno 28] No space left on device: 'x'")
    assert first and first.startswith("disk full: No space left on device")
    assert notice.check("[Errno 28] No space left on device") == ""
    assert notice.check("[trainer] start: world_size=1 incarnation=1.0") is None
    assert notice.check("Disk quota exceeded")
    assert notice.clean(["[trainer] step 5", "[Errno 28] No space left on device"]) == \
        ["[trainer] step 5"]
