"""The node-local host copy: a restarted worker loads the newest snapshot every rank staged.

CPU, gloo, world size 1, the tiny preset. A "restarted worker" is a new ``Checkpointer`` with a new
``HostStaging`` (what a new process builds); the earlier one's banks stay as files in /dev/shm, as
they would after the worker died. Exactness against the files is checked tensor by tensor.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kfp_nvrx.components.core.rundir import COMMIT_MARKER, committed_steps, step_dir
from kfp_nvrx.components.core.volume_layout import iteration_file
from kfp_nvrx.components.training.checkpoint import Checkpointer
from kfp_nvrx.components.training.checkpoint.hostcopy import (
    HostCopyDir,
    decode_objects,
    encode_objects,
)
from kfp_nvrx.components.training.checkpoint.staging import flat_state
from kfp_nvrx.components.training.trainer.build import full_state


@pytest.fixture()
def pg(one_rank_env):
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture()
def run_dir(tmp_path):
    """A run dir with its config record (what names the run to its host copies)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    yield run
    HostCopyDir(run, 0, 1).remove_rank_files()


def _trainer():
    # unit/test_staging.py's tiny CPU trainer (tests/ is on sys.path), as (config, state(), step()).
    from unit.test_staging import _trainer as staging_trainer

    cfg, model, opt, sched, train, step = staging_trainer(["checkpoint.staging=blocking"])
    return cfg, (lambda: full_state(model, opt, sched, train, {"note": "ft"}, 0)), step


def _tensors(state):
    return {k: (v.to_local() if hasattr(v, "to_local") else v).clone()
            for k, v in flat_state(state).items() if isinstance(v, torch.Tensor)}


def _saved_run(run_dir, saves=2, cut_last=False):
    """Trains ``saves`` saves (the last one's write cut when ``cut_last``); returns its pieces."""
    cfg, state, step = _trainer()
    ckpt = Checkpointer(run_dir, cfg.checkpoint, torch.device("cpu"))
    want = None
    for i in range(saves):
        step()
        current = state()
        want = _tensors(current)
        ckpt.save(current["train"]["step"], current)
        if cut_last and i == saves - 1:
            ckpt.staging.sealer.wait()
            assert ckpt.writes.start(force=True)  # its durable write starts ...
            ckpt.abort()  # ... and the worker dies while the write is in flight
        else:
            ckpt.finalize(blocking=True)
    ckpt.staging.sealer.wait()
    if not cut_last:
        ckpt.close()  # the writer stops; the banks stay (a dead worker's files)
    return cfg, saves, ckpt, want


def _restart(run_dir, cfg, first_start=False):
    _, state, _ = _trainer()
    again = Checkpointer(run_dir, cfg.checkpoint, torch.device("cpu"))
    notes = []
    again.log = notes.append
    resumed, target = again.resume(state, first_start=first_start)
    return again, resumed, target, notes


def _disk(run_dir, step):
    _, state, _ = _trainer()
    target = state()
    dcp.load(target, checkpoint_id=str(step_dir(run_dir / "checkpoints", step)))
    return target


def _assert_equal(got, want):
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_restarted_worker_loads_the_newest_sealed_bank_and_skips_the_files(run_dir, pg, monkeypatch):
    cfg, newest, first, _ = _saved_run(run_dir)
    assert iteration_file(run_dir).read_text() == f"{newest}\n"
    home = first.staging.home
    manifests = sorted(json.loads(p.read_text())["step"] for p in home.path.glob("rank0.bank*.json"))
    assert manifests == [newest - 1, newest] and oct(home.path.stat().st_mode & 0o777) == "0o700"

    # No CRC pass over the files on this path: the store's check must not be called.
    from kfp_nvrx.components.core.volume_store import VolumeStore

    monkeypatch.setattr(VolumeStore, "problem", lambda *a, **k: pytest.fail("files verified"))
    again, resumed, target, _ = _restart(run_dir, cfg)
    assert resumed == newest and again.restored_from_memory
    assert again.staging.adopted_step == newest
    _assert_equal(_tensors(target), _tensors(_disk(run_dir, newest)))
    assert target["train"]["step"] == newest and target["ft"] == {"note": "ft"}
    # The older bank is withdrawn at adoption: one manifest left (its file is reused later).
    assert [p.name for p in home.path.glob("rank0.bank*.json")] == ["rank0.bank1.json"]

    # The adopted bank is kept while the next save goes to the other bank.
    again.save(newest + 1, target)
    again.finalize(blocking=True)
    assert sorted(b.step for b in again.staging.banks if b.step is not None) == [newest, newest + 1]
    again.close()
    again.discard_host_copy()
    assert not list(home.path.glob("rank0.*"))


def test_a_save_whose_write_was_cut_is_restored_from_host_memory(run_dir, pg):
    """Issue 29: the recovery point is the newest snapshot every rank staged, not the commit."""
    cfg, newest, _, want = _saved_run(run_dir, saves=3, cut_last=True)
    assert committed_steps(run_dir / "checkpoints") == [2, 1]
    assert not (step_dir(run_dir / "checkpoints", newest) / COMMIT_MARKER).exists()
    again, resumed, target, notes = _restart(run_dir, cfg)
    assert resumed == newest and again.restored_from_memory
    assert notes == [f"restoring step {newest} from host memory (newest committed on disk: 2)"]
    _assert_equal(_tensors(target), want)
    assert iteration_file(run_dir).read_text() == f"{newest}\n"  # ft_launcher's progress
    again.close()


def test_a_damaged_bank_is_caught_by_its_crc_and_never_taken_again(run_dir, pg):
    cfg, newest, first, _ = _saved_run(run_dir)
    bank = first.staging.home.bank_path(1)
    data = bytearray(bank.read_bytes())
    data[100] ^= 0x40  # one bit of the newest snapshot's first tensor
    bank.write_bytes(bytes(data))
    again, resumed, target, notes = _restart(run_dir, cfg)
    assert resumed == newest and not again.restored_from_memory
    assert any("host memory is damaged" in n and "CRC-32C" in n for n in notes), notes
    _assert_equal(_tensors(target), _tensors(_disk(run_dir, newest)))  # from the intact files
    again.close()
    # Its description is gone: the next restart does not trip over it again.
    assert not list(first.staging.home.path.glob("rank0.bank*.json"))


def test_copies_of_another_run_at_the_same_path_are_not_used(run_dir, pg):
    cfg, newest, _, _ = _saved_run(run_dir)
    record = run_dir / "config.yaml"
    record.unlink()
    record.write_text("model: {}\n")  # the run dir made again: another run
    again, resumed, _, _ = _restart(run_dir, cfg)
    assert resumed == newest and not again.restored_from_memory
    again.close()


def test_a_directory_open_to_others_is_not_trusted(run_dir, pg):
    cfg, newest, first, _ = _saved_run(run_dir)
    os.chmod(first.staging.home.path, 0o777)
    try:
        again, resumed, _, _ = _restart(run_dir, cfg)
        assert resumed == newest and not again.restored_from_memory
    finally:
        os.chmod(first.staging.home.path, 0o700)
    again.close()


def test_a_manifest_that_is_no_file_is_not_read(run_dir, pg):
    """A FIFO in a manifest's place (nobody writes to it) is refused, not waited on."""
    cfg, newest, first, _ = _saved_run(run_dir)
    for path in first.staging.home.path.glob("rank0.bank*.json"):
        path.unlink()
        os.mkfifo(path, 0o600)
    again, resumed, _, _ = _restart(run_dir, cfg)
    assert resumed == newest and not again.restored_from_memory
    again.close()


def test_load_step_pins_the_first_start_only_and_abandons_newer_commits(run_dir, pg):
    """Issue 29 item 4: a rollback start takes load_step; a restart after it takes the newest."""
    cfg, newest, _, _ = _saved_run(run_dir, saves=3)
    cfg.checkpoint.load_step = 1
    again, resumed, target, notes = _restart(run_dir, cfg, first_start=True)
    assert resumed == 1 and not again.restored_from_memory  # memory held 2 and 3: not taken
    assert committed_steps(run_dir / "checkpoints") == [1]
    [moved] = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("abandoned-")]
    assert sorted(p.name for p in moved.iterdir()) == ["step_00000002", "step_00000003"]
    assert any("leave this run's timeline" in n for n in notes), notes
    assert not list(again.staging.home.path.glob("rank0.bank*.json"))  # stale copies withdrawn
    # The new timeline saves step 2 again; a restart (not a first start) takes the newest.
    again.save(2, target)
    again.finalize(blocking=True)
    again.staging.sealer.wait()
    again.close()
    later, resumed, _, _ = _restart(run_dir, cfg, first_start=False)
    assert resumed == 2 and later.restored_from_memory
    later.close()


def test_an_interrupted_rollback_is_finished_before_anything_reads_the_steps(run_dir, pg,
                                                                             monkeypatch):
    from kfp_nvrx.components.core import timeline

    cfg, newest, _, _ = _saved_run(run_dir, saves=3)
    root = run_dir / "checkpoints"
    moves = []

    def crash_on_second_move(src, dst):
        moves.append(src)
        if len(moves) == 2:
            raise KeyboardInterrupt  # the pod is killed in the middle of the rollback
        os.rename(src, dst)

    monkeypatch.setattr(timeline.os, "replace", crash_on_second_move)
    cfg.checkpoint.load_step = 1
    with pytest.raises(KeyboardInterrupt):
        _restart(run_dir, cfg, first_start=True)
    monkeypatch.undo()
    assert committed_steps(root) == [1]  # readers (export, the launcher) already skip them
    cfg.checkpoint.load_step = -1
    again, resumed, _, _ = _restart(run_dir, cfg)  # the next launch, without load_step
    assert resumed == 1 and not (root / timeline.ROLLBACK_FILE).exists()
    [moved] = [p for p in root.iterdir() if p.name.startswith("abandoned-")]
    assert sorted(p.name for p in moved.iterdir()) == ["step_00000002", "step_00000003"]
    again.close()


def test_files_of_ranks_the_job_no_longer_has_are_removed(run_dir, pg):
    cfg, _, first, _ = _saved_run(run_dir)
    home = first.staging.home
    for name in ("rank1.bank0", "rank1.bank0.json", "rank1.owner"):
        (home.path / name).write_bytes(b"x" * 8)  # a relaunch from 2 ranks to 1
    again, _, _, _ = _restart(run_dir, cfg)
    assert not list(home.path.glob("rank1.*"))
    again.close()


def test_manifest_objects_are_json_not_pickle():
    leaves = {"lr": 1e-3, "betas": (0.9, 0.95), "params": ["a", "b"], "fused": None,
              "nan": float("nan"), "groups": {0: {"k": (1, 2)}}}
    text = json.dumps(encode_objects(leaves), allow_nan=False)
    back = decode_objects(json.loads(text))
    assert back["betas"] == (0.9, 0.95) and back["groups"] == {0: {"k": (1, 2)}}
    assert math.isnan(back["nan"]) and back["params"] == ["a", "b"] and back["fused"] is None
    with pytest.raises(TypeError):
        encode_objects({"f": object()})


def test_sweep_removes_copies_whose_agent_is_gone_and_keeps_live_ones(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    ours = HostCopyDir(tmp_path / "run", 0, 1, root=tmp_path)
    other_dead = HostCopyDir(tmp_path / "other", 0, 1, root=tmp_path)
    other_live = HostCopyDir(tmp_path / "live", 0, 1, root=tmp_path)
    for home in (ours, other_dead, other_live):
        home.ensure()
        home.bank_path(0).write_bytes(b"x" * 16)
    record = other_dead.path / "rank0.owner"
    record.write_text(json.dumps({"agent_pid": dead_pid}))
    assert ours.sweep() == [other_dead.path]
    assert ours.path.is_dir() and other_live.path.is_dir() and not other_dead.path.exists()


def test_sweep_never_follows_a_symlinked_base(tmp_path):
    """Issue 30 item 10: the base linked elsewhere once had unrelated old folders deleted."""
    shm, elsewhere = tmp_path / "shm", tmp_path / "elsewhere"
    shm.mkdir()
    victim = elsewhere / "0123456789abcdef"
    victim.mkdir(parents=True)
    (victim / "precious").write_text("keep")
    os.utime(victim, (0, 0))  # old: no "being set up" grace
    ours = HostCopyDir(tmp_path / "run", 0, 1, root=shm)
    ours.base.symlink_to(elsewhere, target_is_directory=True)
    assert ours.sweep() == []
    assert (victim / "precious").read_text() == "keep"


def test_the_pinning_call_is_the_runtime_library_this_process_loaded():
    from kfp_nvrx.components.training.checkpoint.bank import cudart_path

    maps = ("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libc.so.6\n"
            "7f20-7f30 r-xp 0 08:01 2 /venv/nvidia/cu13/lib/libcudart.so.13\n")
    assert cudart_path(maps) == "/venv/nvidia/cu13/lib/libcudart.so.13"
    assert cudart_path("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libc.so.6\n") is None


def test_a_start_whose_only_commit_is_damaged_starts_fresh_without_building_the_state(run_dir, pg):
    """Building the state initialises the optimizer's (DCP steps it once): a fresh start that
    built it first ended with other weights than a run that never failed."""
    cfg, newest, first, _ = _saved_run(run_dir, saves=1)
    first.discard_host_copy()  # a replaced node: the files only
    files = sorted((step_dir(run_dir / "checkpoints", newest)).glob("*.distcp"))
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[0].write_bytes(bytes(data))
    again = Checkpointer(run_dir, cfg.checkpoint, torch.device("cpu"))
    notes, built = [], []
    again.log = notes.append
    resumed, state = again.resume(lambda: built.append(1) or {}, first_start=False)
    assert (resumed, state, built) == (None, None, [])
    assert any(f"checkpoint step {newest} is damaged" in n for n in notes), notes
    again.close()
