"""The node-local host copy: a restarted worker loads the newest commit from /dev/shm, or disk.

CPU, gloo, world size 1, the tiny preset. A "restarted worker" is a new ``Checkpointer`` with a new
``HostStaging`` (what a new process builds); the earlier one's banks stay mapped as they would in
the page cache of a dead process. Exactness against the files is checked tensor by tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kfp_nvrx.components.core.launch_command import iteration_file
from kfp_nvrx.components.core.rundir import COMMIT_MARKER, step_dir
from kfp_nvrx.components.training.checkpoint import Checkpointer
from kfp_nvrx.components.training.checkpoint.hostcopy import HostCopyDir
from kfp_nvrx.components.training.checkpoint.staging import flat_state
from kfp_nvrx.components.training.trainer.build import full_state


@pytest.fixture()
def pg(one_rank_env):
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _trainer():
    # test_staging's tiny CPU trainer (tests/ is on sys.path), as (config, state(), step()).
    from test_staging import _trainer as staging_trainer

    cfg, model, opt, sched, train, step = staging_trainer(["checkpoint.staging=blocking"])
    return cfg, (lambda: full_state(model, opt, sched, train, {"note": "ft"}, 0)), step


def _tensors(state):
    return {k: (v.to_local() if hasattr(v, "to_local") else v).clone()
            for k, v in flat_state(state).items() if isinstance(v, torch.Tensor)}


def _saved_run(run_dir, saves=2):
    """Trains and commits ``saves`` checkpoints; returns the config and the newest step."""
    cfg, state, step = _trainer()
    ckpt = Checkpointer(run_dir, cfg.checkpoint, torch.device("cpu"))
    for _ in range(saves):
        step()
        ckpt.save(saves and state()["train"]["step"], state())
        ckpt.finalize(blocking=True)
    ckpt.close()  # the writer stops; the banks stay (a dead worker's files)
    return cfg, saves, ckpt


def _restart(run_dir, cfg):
    _, state, _ = _trainer()
    again = Checkpointer(run_dir, cfg.checkpoint, torch.device("cpu"))
    notes = []
    again.log = notes.append
    resumed, target = again.resume(state)
    return again, resumed, target, notes


def _disk(run_dir, step):
    _, state, _ = _trainer()
    target = state()
    dcp.load(target, checkpoint_id=str(step_dir(run_dir / "checkpoints", step)))
    return target


def test_restarted_worker_loads_the_committed_bank_and_skips_the_files(tmp_path, pg, monkeypatch):
    cfg, newest, first = _saved_run(tmp_path)
    assert iteration_file(tmp_path).read_text() == f"{newest}\n"
    home = first.staging.home
    manifest = json.loads(home.manifest_path.read_text())
    assert manifest["step"] == newest and oct(home.path.stat().st_mode & 0o777) == "0o700"

    # No CRC pass over the files on this path: verify() must not be called.
    import kfp_nvrx.components.training.checkpoint.checkpointer as ckpt_mod

    monkeypatch.setattr(ckpt_mod, "verify", lambda *a, **k: pytest.fail("files verified"))
    again, resumed, target, _ = _restart(tmp_path, cfg)
    assert resumed == newest and again.restored_from_memory
    assert again.staging.adopted_step == newest
    want = _tensors(_disk(tmp_path, newest))
    got = _tensors(target)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert target["train"]["step"] == newest and target["ft"] == {"note": "ft"}

    # The adopted bank keeps committed state while the next save goes to the other bank.
    again.save(newest + 1, target)
    again.finalize(blocking=True)
    assert sorted(b.step for b in again.staging.banks) == [newest, newest + 1]
    again.close()
    again.discard_host_copy()
    assert not list(home.path.glob("rank0.*"))


def test_a_copy_that_does_not_match_the_newest_commit_is_not_used(tmp_path, pg):
    cfg, newest, _ = _saved_run(tmp_path)
    marker = step_dir(tmp_path / "checkpoints", newest) / COMMIT_MARKER
    data = json.loads(marker.read_text())
    data["time"] += 1  # another commit of the same step (e.g. a rerun): another identity
    marker.write_text(json.dumps(data))
    again, resumed, target, _ = _restart(tmp_path, cfg)
    assert resumed == newest and not again.restored_from_memory
    for key, value in _tensors(_disk(tmp_path, newest)).items():
        assert torch.equal(_tensors(target)[key], value), key
    again.close()
    again.discard_host_copy()


def test_a_directory_open_to_others_is_not_trusted(tmp_path, pg):
    cfg, newest, first = _saved_run(tmp_path)
    os.chmod(first.staging.home.path, 0o777)
    try:
        again, resumed, _, _ = _restart(tmp_path, cfg)
        assert resumed == newest and not again.restored_from_memory
    finally:
        os.chmod(first.staging.home.path, 0o700)
    again.close()
    first.discard_host_copy()


def test_a_manifest_that_is_no_file_is_not_read(tmp_path, pg):
    """A FIFO in the manifest's place (nobody writes to it) is refused, not waited on."""
    cfg, newest, first = _saved_run(tmp_path)
    manifest = first.staging.home.manifest_path
    manifest.unlink()
    os.mkfifo(manifest, 0o600)
    again, resumed, _, _ = _restart(tmp_path, cfg)
    assert resumed == newest and not again.restored_from_memory
    again.close()
    first.discard_host_copy()


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


def test_the_pinning_call_is_the_runtime_library_this_process_loaded():
    from kfp_nvrx.components.training.checkpoint.bank import cudart_path

    maps = ("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libc.so.6\n"
            "7f20-7f30 r-xp 0 08:01 2 /venv/nvidia/cu13/lib/libcudart.so.13\n")
    assert cudart_path(maps) == "/venv/nvidia/cu13/lib/libcudart.so.13"
    assert cudart_path("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libc.so.6\n") is None
