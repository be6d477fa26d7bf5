"""CUDA checkpoint staging: pinned buffer, D2H overlapped with the next step, in-memory restore.

Needs a CUDA GPU (``make test-gpu`` on the GPU machine); on a CPU-only machine these are skipped
and the CPU side of the same code runs in ``tests/unit/test_staging.py``. NCCL, world size 1, a model of
~60 MB of state so the copies take long enough to still be running during the next step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (make test-gpu on a GPU machine)")

SETS = ["train.device=cuda", "model.dim=512", "model.n_layers=4", "model.n_heads=8",
        "model.vocab_size=4096", "model.max_seq_len=256", "data.seq_len=256", "data.batch_size=8"]


@pytest.fixture()
def pg(one_rank_env):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def _trainer(extra=()):
    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.training.trainer.build import TrainState, build

    cfg = load_config("tiny", [*SETS, *extra])
    device = torch.device("cuda", 0)
    model, opt, sched = build(cfg, device)
    train = TrainState()
    gen = torch.Generator(device=device).manual_seed(7)

    def step(ckpt=None):
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.data.seq_len),
                               device=device, generator=gen)
        model(tokens).float().logsumexp(-1).mean().backward()
        if ckpt is not None:
            ckpt.wait_before_update()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        train.step += 1

    return cfg, model, opt, sched, train, step, device


def _snapshot(state):
    from kfp_nvrx.components.training.checkpoint.staging import flat_state

    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().cpu().clone()
            for k, v in flat_state(state).items() if isinstance(v, torch.Tensor)}


def _until_pinned(ckpt, step, state_fn) -> None:
    """As the trainer does: the banks are pinned in the background while steps go on."""
    ckpt.prepare(state_fn)
    while ckpt.preparing():
        step(ckpt)


def test_overlapped_staging_saves_the_state_at_save_time(tmp_path, pg):
    from kfp_nvrx.components.core.rundir import step_dir
    from kfp_nvrx.components.training.checkpoint import Checkpointer, Reports
    from kfp_nvrx.components.training.trainer.build import full_state

    cfg, model, opt, sched, train, step, device = _trainer(["checkpoint.staging=overlap"])
    skipped = []
    ckpt = Checkpointer(tmp_path, cfg.checkpoint, device,
                        reports=Reports(on_snapshot=lambda s, _t, why: why and skipped.append(s)))
    assert ckpt.mode == "overlap"
    ckpt.warm_up()
    step()
    _until_pinned(ckpt, step, lambda: full_state(model, opt, sched, train, {}, 0))
    saved = {}
    for _ in range(3):  # three saves: the second and third reuse the buffer and the writer's map
        step()
        step(ckpt)
        state = full_state(model, opt, sched, train, {}, 0)
        saved[train.step] = _snapshot(state)
        blocked = ckpt.save(train.step, state)
        assert blocked < 5.0 and not skipped
        step(ckpt)  # runs beside the copies; its optimizer step waits for them on the GPU
        ckpt.finalize(blocking=True)
    assert ckpt.staging.buffer.is_pinned()
    last = train.step - 1
    assert ckpt.staging.valid_step == last
    ckpt.close()
    # The banks' registrations end with the run: a bank left mapped and pinned would leave its
    # addresses registered, and a later test's bank mapped there could not be pinned.
    ckpt.discard_host_copy()
    for st in (min(saved), last):  # the first save and the newest (keep=3 holds all three)
        _, model2, opt2, sched2, train2, _, _ = _trainer()
        target = full_state(model2, opt2, sched2, train2, {}, 0)
        dcp.load(target, checkpoint_id=str(step_dir(ckpt.root, st)))
        got = _snapshot(target)
        assert got.keys() == saved[st].keys()
        for key, value in saved[st].items():
            assert torch.equal(got[key], value), (st, key)


def test_in_memory_restore_equals_the_files(tmp_path, pg):
    from kfp_nvrx.components.core.rundir import step_dir
    from kfp_nvrx.components.training.checkpoint import Checkpointer, Kept
    from kfp_nvrx.components.training.trainer.build import full_state

    cfg, model, opt, sched, train, step, device = _trainer(["checkpoint.staging=overlap"])
    ckpt = Checkpointer(tmp_path, cfg.checkpoint, device)
    step()
    _until_pinned(ckpt, step, lambda: full_state(model, opt, sched, train, {}, 0))
    saved = train.step
    ckpt.save(saved, full_state(model, opt, sched, train, {}, 0))
    step(ckpt)
    ckpt.close()
    staging = ckpt.staging
    _, model2, opt2, sched2, train2, _, _ = _trainer()
    again = Checkpointer(tmp_path, cfg.checkpoint, device, Kept(staging))
    target = full_state(model2, opt2, sched2, train2, {}, 0)
    again.load(saved, target)
    assert again.restored_from_memory
    _, model3, opt3, sched3, train3, _, _ = _trainer()
    disk = full_state(model3, opt3, sched3, train3, {}, 0)
    dcp.load(disk, checkpoint_id=str(step_dir(ckpt.root, saved)))
    got, want = _snapshot(target), _snapshot(disk)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert target["train"] == disk["train"]
    again.close()
    again.discard_host_copy()


def test_banks_pin_while_the_loop_waits_for_the_gpu(tmp_path, pg):
    from kfp_nvrx.components.training.checkpoint import Checkpointer
    from kfp_nvrx.components.training.trainer.build import full_state

    cfg, model, opt, sched, train, step, device = _trainer(["checkpoint.staging=overlap"])
    ckpt = Checkpointer(tmp_path, cfg.checkpoint, device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def gpu_bound_step() -> None:
        # A step whose GPU work outlasts its launches (as 1b's: ~0.1 s of matmuls on an H100),
        # ending in the loop's wait.
        step(ckpt)
        c = a
        for _ in range(60):
            c = (c @ a) * 1e-3
        with ckpt.gpu_wait():
            c.sum().item()

    gpu_bound_step()
    gpu_bound_step()
    ckpt.prepare(lambda: full_state(model, opt, sched, train, {}, 0))
    while ckpt.preparing():
        gpu_bound_step()
    notes = [n for n in ckpt.staging.take_notes() if " ready:" in n]
    assert notes, "no bank became ready"
    in_waits = [int(n.split("(", 1)[1].split(" of ")[0]) for n in notes]  # "(N of M pieces ..."
    # A piece goes at once when a wait with room for it is open and is paced otherwise (it never
    # waits for a wait: gpu_waits.room). At 1b on an H100 7-17 % of a bank's 282 pieces landed
    # in waits; this model's 0.2 GB banks pin in 0.1 s, mostly paced (1 of 7 on an H100).
    assert sum(in_waits) >= 1, notes
    ckpt.close()
    ckpt.discard_host_copy()
