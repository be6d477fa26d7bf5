"""Checkpoint staging buffer: staged async saves equal NVRx-staged ones, in-memory restore, fallback.

CPU, gloo, world size 1, the tiny preset; the writer is NVRx's real persistent worker process. The
CUDA side (pinned buffer, side-stream copies, overlap with the next step) runs in
``tests/gpu/test_staging_cuda.py`` on a GPU machine.
"""

from __future__ import annotations

import errno
import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.core.rundir import step_dir
from kfp_nvrx.components.training.checkpoint import Checkpointer, Kept, Reports, staged_write
from kfp_nvrx.components.training.checkpoint import staging as staging_mod
from kfp_nvrx.components.training.trainer.build import TrainState, build, full_state


@pytest.fixture()
def pg(one_rank_env):
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _fail_staging_after(monkeypatch, views: int) -> None:
    """Make staging raise after ``views`` tensors were staged (a fault in the middle of a save)."""
    original = staging_mod.HostStaging.view
    calls = []

    def failing_view(self, key, bank=None):
        calls.append(key)
        if len(calls) > views:
            raise RuntimeError("fault while staging")
        return original(self, key, bank)

    monkeypatch.setattr(staging_mod.HostStaging, "view", failing_view)


def _trainer(overrides=()):
    cfg = load_config("tiny", ["train.device=cpu", *overrides])
    model, opt, sched = build(cfg, torch.device("cpu"))
    train = TrainState()

    def step():
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
        model(tokens).float().logsumexp(-1).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        train.step += 1

    return cfg, model, opt, sched, train, step


def _state(model, opt, sched, train):
    return full_state(model, opt, sched, train, {"note": "ft"}, 0)


def _tensors(state):
    flat = staging_mod.flat_state(state)
    return {k: (v.to_local() if hasattr(v, "to_local") else v).clone()
            for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _fresh_load(path, model, opt, sched, train):
    target = _state(model, opt, sched, train)
    dcp.load(target, checkpoint_id=str(path))
    return target


def test_staged_save_writes_the_state_at_save_time_and_equals_nvrx_staging(tmp_path, pg):
    saved = {}
    for mode in ("blocking", "nvrx"):  # one writer process at a time, same seeded run
        cfg, model, opt, sched, train, step = _trainer([f"checkpoint.staging={mode}"])
        for _ in range(2):
            step()
        ckpt = Checkpointer(tmp_path / mode, cfg.checkpoint, torch.device("cpu"))
        assert ckpt.mode == mode
        state = _state(model, opt, sched, train)
        expected = _tensors(state)
        ckpt.save(train.step, state)
        step()  # in-place optimizer updates while the write is in flight must not leak in
        ckpt.close()
        assert (step_dir(ckpt.root, 2) / "COMMITTED").is_file()
        got = _fresh_load(step_dir(ckpt.root, 2), *_trainer()[1:5])
        saved[mode] = _tensors(got)
        assert saved[mode].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(saved[mode][key], value), (mode, key)
        assert got["train"] == {"step": 2, "tokens": 0} and got["ft"] == {"note": "ft"}
    for key, value in saved["nvrx"].items():
        assert torch.equal(saved["blocking"][key], value), key


def test_reused_buffer_second_save_and_in_memory_restore(tmp_path, pg, monkeypatch):
    cfg, model, opt, sched, train, step = _trainer(["checkpoint.staging=blocking"])
    staging = staging_mod.HostStaging(torch.device("cpu"))
    ckpt = Checkpointer(tmp_path, cfg.checkpoint, torch.device("cpu"), Kept(staging))
    step()
    ckpt.prepare(lambda: _state(model, opt, sched, train))  # background allocation
    for _ in range(2):
        step()
        ckpt.save(train.step, _state(model, opt, sched, train))
        ckpt.finalize(blocking=True)
    buffer_ptr = staging.buffer.data_ptr()
    assert staging.valid_step == 3 and staging.generation == 1
    want = _tensors(_state(model, opt, sched, train))
    ckpt.close()

    # A new incarnation in the same process (in-process restart) restores from host memory.
    _, model2, opt2, sched2, train2, step2 = _trainer(["checkpoint.staging=blocking"])
    step2()  # other values (and optimizer state present)
    ckpt2 = Checkpointer(tmp_path, cfg.checkpoint, torch.device("cpu"), Kept(staging))
    assert ckpt2.select() == 3
    target = _state(model2, opt2, sched2, train2)
    ckpt2.load(3, target)
    assert ckpt2.restored_from_memory and staging.buffer.data_ptr() == buffer_ptr
    disk = _fresh_load(step_dir(ckpt2.root, 3), *_trainer()[1:5])
    got = _tensors(target)
    for key, value in _tensors(disk).items():
        assert torch.equal(got[key], value), key
        assert torch.equal(got[key], want[key]), key
    assert target["train"] == disk["train"] and target["sched"] == disk["sched"]

    # A save whose copies completed but whose write the fault cut off: every rank holds the
    # snapshot, so an in-process restart restores it although it never reached the disk.
    step2()
    state4 = _state(model2, opt2, sched2, train2)
    want4 = _tensors(state4)
    ckpt2.save(4, state4)
    ckpt2.abort()
    assert not (step_dir(ckpt2.root, 4) / "COMMITTED").exists()
    ckpt3 = Checkpointer(tmp_path, cfg.checkpoint, torch.device("cpu"), Kept(staging))
    assert ckpt3.select() == 3 and ckpt3.memory_steps() == [4, 3, 2]  # three banks
    assert ckpt3.metadata_keys(4) >= set(want4)  # from the snapshot: step 4 has no .metadata
    notes, checked = [], []
    ckpt3.log = notes.append
    resumed, target4 = ckpt3.resume(lambda: _state(*_trainer()[1:5]),
                                    check=lambda keys, step: checked.append(step))
    assert resumed == 4 and checked == [4] and ckpt3.restored_from_memory
    assert notes == ["restoring step 4 from host memory (newest committed on disk: 3)"]
    for key, value in _tensors(target4).items():
        assert torch.equal(value, want4[key]), key

    # A fault while staging tears only the bank being staged (the oldest, step 2): the others
    # still hold steps 4 and 3, and the restart restores the newest, 4, from memory.
    _fail_staging_after(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="fault while staging"):
        ckpt3.save(5, _state(model2, opt2, sched2, train2))
    ckpt3.abort()
    monkeypatch.undo()
    ckpt4 = Checkpointer(tmp_path, cfg.checkpoint, torch.device("cpu"), Kept(staging))
    assert ckpt4.memory_steps() == [4, 3]
    resumed, target4 = ckpt4.resume(lambda: _state(model2, opt2, sched2, train2))
    assert resumed == 4 and ckpt4.restored_from_memory
    for key, value in _tensors(target4).items():
        assert torch.equal(value, want4[key]), key
    ckpt4.close()


def test_one_bank_torn_by_a_fault_while_staging_falls_back_to_the_files(tmp_path, pg, monkeypatch):
    cfg, model, opt, sched, train, step = _trainer(["checkpoint.staging=blocking"])
    staging = staging_mod.HostStaging(torch.device("cpu"), banks=1)
    ckpt = Checkpointer(tmp_path, cfg.checkpoint, torch.device("cpu"), Kept(staging))
    step()
    ckpt.save(train.step, _state(model, opt, sched, train))
    ckpt.finalize(blocking=True)
    assert len(staging.banks) == 1 and staging.valid_step == 1
    _fail_staging_after(monkeypatch, 3)
    step()
    with pytest.raises(RuntimeError, match="fault while staging"):
        ckpt.save(train.step, _state(model, opt, sched, train))
    ckpt.abort()
    monkeypatch.undo()
    ckpt2 = Checkpointer(tmp_path, cfg.checkpoint, torch.device("cpu"), Kept(staging))
    assert ckpt2.memory_steps() == []
    resumed, _ = ckpt2.resume(lambda: _state(model, opt, sched, train))
    assert resumed == 1 and not ckpt2.restored_from_memory
    ckpt2.close()


def test_writer_views_own_exactly_their_bytes():
    base = torch.zeros(1 << 20, dtype=torch.uint8)
    slot = staging_mod.Slot(offset=128, nbytes=64, shape=(4, 4), dtype=torch.float32)
    base[128:192].view(torch.float32).copy_(torch.arange(16, dtype=torch.float32))
    region = staged_write._region(base, slot)
    assert region.untyped_storage().nbytes() == 64
    assert torch.equal(region.flatten(), torch.arange(16, dtype=torch.float32))
    buf = io.BytesIO()
    torch.save(region, buf)
    assert buf.tell() < 4096  # a plain view would serialise the whole 1 MiB buffer


def test_too_small_dev_shm_falls_back_to_nvrx_staging(tmp_path, pg, monkeypatch):
    cfg, model, opt, sched, train, step = _trainer(["checkpoint.staging=blocking"])
    step()
    monkeypatch.setattr(staging_mod, "shm_free_bytes", lambda path="/dev/shm": 1024)
    notes = []
    ckpt = Checkpointer(tmp_path, cfg.checkpoint, torch.device("cpu"), reports=Reports(log=notes.append))
    ckpt.save(1, _state(model, opt, sched, train))
    ckpt.close()
    assert ckpt.mode == "nvrx" and ckpt.staging is None
    assert len(notes) == 1 and "/dev/shm" in notes[0] and "checkpoint.staging=nvrx" in notes[0]
    assert (step_dir(ckpt.root, 1) / "COMMITTED").is_file()


def test_first_allocation_leaves_room_for_every_local_rank(monkeypatch):
    flat = {"w": torch.zeros(1024, dtype=torch.float32), "step": 3}
    need = staging_mod.layout_of(flat)["w"].nbytes
    monkeypatch.setattr(staging_mod, "shm_free_bytes", lambda path="/dev/shm": 5 * need)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(staging_mod.StagingUnavailable, match=r"x 8 local rank\(s\)"):
        staging_mod.HostStaging(torch.device("cpu")).ensure(flat)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    ok = staging_mod.HostStaging(torch.device("cpu"))
    ok.ensure(flat)
    ok.stage(flat, 1)
    assert ok.valid_step == 1 and torch.equal(ok.view("w"), flat["w"])
    ok.release()


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC])
def test_a_read_only_or_full_dev_shm_is_said_as_host_memory_and_falls_back(tmp_path, pg,
                                                                           monkeypatch, err):
    """Issue 30 item 10: it was reported as a full checkpoint disk, or with no path."""
    from kfp_nvrx.components.training.checkpoint import bank as bank_mod

    real_open = os.open

    def refusing_open(path, flags, *args):
        if ".bank" in str(path):
            raise OSError(err, os.strerror(err), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(bank_mod.os, "open", refusing_open)
    cfg, model, opt, sched, train, step = _trainer(["checkpoint.staging=blocking"])
    step()
    notes = []
    ckpt = Checkpointer(tmp_path, cfg.checkpoint, torch.device("cpu"), reports=Reports(log=notes.append))
    ckpt.save(1, _state(model, opt, sched, train))
    ckpt.close()
    assert ckpt.mode == "nvrx" and len(notes) == 1
    assert "host memory" in notes[0] and os.strerror(err) in notes[0] and "/dev/shm" in notes[0]
    assert "checkpoint.staging=nvrx" in notes[0]
    assert (step_dir(ckpt.root, 1) / "COMMITTED").is_file()  # saved through NVRx's staging
