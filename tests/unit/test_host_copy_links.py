"""Issue 38 items 2 and 4: nothing under the host-copy base is touched before it is proven ours.

``/dev/shm`` is open to every user: a link planted as the base (``kfp-nvrx-<uid>``) or as a run's
folder (``<base>/<run key>``) must never turn one of our lists, reads, writes or deletes into one
in the folder the link names. One test per entry point of :class:`HostCopyDir` (and the core's
``remove_copy`` / ``remove_run_copy``), each with both links; then the manifest's CRC coverage and
huge pids in owner records and folder names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kfp_nvrx.components.core.host_copy import remove_copy, remove_run_copy
from kfp_nvrx.components.training.checkpoint.hostcopy import MANIFEST_VERSION, HostCopyDir

#: What a planted link's target holds: names our deletes of ``rank<N>.*`` would match.
VICTIMS = ("rank0.keep", "rank1.data", "rank7.notes", ".rank3.cfg", "rank0.bank0",
           "rank0.bank0.json", "rank0.bank1.json", "rank0.owner")


def _victim(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    for name in VICTIMS:
        (where / name).write_text(f"precious {name}")
    os.utime(where, (0, 0))  # old: no "being set up" grace
    return where


def _intact(where: Path) -> None:
    assert sorted(p.name for p in where.iterdir()) == sorted(VICTIMS), list(where.iterdir())
    for name in VICTIMS:
        assert (where / name).read_text() == f"precious {name}", name


def _home(tmp_path: Path, link: str, *, run: bool = True) -> tuple[HostCopyDir, Path]:
    """A rank's host copy (world size 1) whose base or run folder is a planted link."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.yaml").write_text("model: {}\n")
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    home = HostCopyDir(run_dir if run else None, 0, 1, root=shm)
    victim = tmp_path / "elsewhere"
    if link == "base":
        _victim(victim / home.path.name)
        home.base.symlink_to(victim, target_is_directory=True)
        return home, victim / home.path.name
    home.base.mkdir(mode=0o700)
    _victim(victim)
    home.path.symlink_to(victim, target_is_directory=True)
    return home, victim


LINKS = pytest.mark.parametrize("link", ["base", "run"])


@LINKS
def test_drop_other_ranks_deletes_nothing_through_a_link(tmp_path, link) -> None:
    home, victim = _home(tmp_path, link)
    home.drop_other_ranks()
    _intact(victim)


@LINKS
def test_remove_rank_files_deletes_nothing_through_a_link(tmp_path, link) -> None:
    home, victim = _home(tmp_path, link)
    home.remove_rank_files()
    _intact(victim)


@LINKS
def test_remove_rank_files_of_a_private_buffer_deletes_nothing_through_a_link(tmp_path,
                                                                                 link) -> None:
    home, victim = _home(tmp_path, link, run=False)  # "run": the buffer's own name, planted
    home.remove_rank_files()
    _intact(victim)


@LINKS
def test_drop_banks_deletes_nothing_through_a_link(tmp_path, link) -> None:
    home, victim = _home(tmp_path, link)
    home.drop_banks(keep=set())
    _intact(victim)


@LINKS
@pytest.mark.parametrize("index", [None, 0, 1])
def test_withdraw_deletes_nothing_through_a_link(tmp_path, link, index) -> None:
    home, victim = _home(tmp_path, link)
    home.withdraw(index)
    _intact(victim)


@LINKS
def test_ensure_writes_nothing_through_a_link(tmp_path, link) -> None:
    from kfp_nvrx.components.core.host_copy import HostCopyUnavailable

    home, victim = _home(tmp_path, link)
    with pytest.raises(HostCopyUnavailable):
        home.ensure()
    _intact(victim)


@LINKS
def test_publish_writes_nothing_through_a_link(tmp_path, link) -> None:
    home, victim = _home(tmp_path, link)
    assert not home.publish(0, step=3, nbytes=0, slots=[], objects={}, crc32=[])
    _intact(victim)


def _manifest(home: HostCopyDir, nbytes: int = 16, **changes) -> dict:
    return {"version": MANIFEST_VERSION, "run_dir": home.run_dir, "run": home.run, "rank": 0,
            "world_size": 1, "step": 3, "bank": 0, "nbytes": nbytes, "slots": [], "objects": {},
            "crc32": [[0, nbytes, 7]], "pid": 1, "time": 0.0, **changes}


@LINKS
def test_snapshots_reads_nothing_through_a_link(tmp_path, link) -> None:
    """A complete, well-formed snapshot behind the link: still none of ours."""
    home, victim = _home(tmp_path, link)
    (victim / "rank0.bank0").write_bytes(b"x" * 16)
    (victim / "rank0.bank0.json").write_text(json.dumps(_manifest(home)))
    assert home.snapshots() == []


@LINKS
def test_sweep_deletes_nothing_through_a_link(tmp_path, link) -> None:
    """The base linked, or another run's folder in our base linked elsewhere."""
    home, victim = _home(tmp_path, "base" if link == "base" else "run")
    other = HostCopyDir(tmp_path / "other", 0, 1, root=tmp_path / "shm")
    if link == "run":
        home.path.unlink()
        other.path.symlink_to(victim, target_is_directory=True)
    assert home.sweep() == []
    _intact(victim)


@LINKS
def test_remove_copy_and_remove_run_copy_delete_nothing_through_a_link(tmp_path, link) -> None:
    home, victim = _home(tmp_path, link)
    assert not remove_copy(home.path)
    assert not remove_run_copy(home.run_dir, root=home.root)
    _intact(victim)


def test_a_private_run_folder_under_a_linked_base_is_not_removed(tmp_path) -> None:
    """The run folder itself passes the checks (0700, ours); the base above it is the link."""
    home, victim = _home(tmp_path, "base")
    victim.chmod(0o700)
    assert not remove_copy(home.path)
    home.remove_rank_files()
    _intact(victim)


def test_a_base_open_to_others_is_not_used(tmp_path) -> None:
    home, _ = _home(tmp_path, "run")
    home.path.unlink()
    home.path.mkdir(mode=0o700)
    (home.path / "rank0.bank0").write_bytes(b"x" * 16)
    home.base.chmod(0o777)
    home.drop_banks(keep=set())
    home.remove_rank_files()
    assert (home.path / "rank0.bank0").exists()


def test_the_checkpointer_of_a_new_worker_deletes_nothing_through_a_link(tmp_path, monkeypatch,
                                                                          one_rank_env) -> None:
    """Its start (``sweep``, then ``drop_other_ranks``) under a planted link: nothing deleted."""
    import torch.distributed as dist

    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.training.checkpoint import checkpointer as ck

    home, victim = _home(tmp_path, "base")
    monkeypatch.setattr(ck, "HostCopyDir", lambda run, rank, world: HostCopyDir(
        run, rank, world, root=home.root))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cfg = load_config("tiny", ["checkpoint.staging=blocking"]).checkpoint
        ck.Checkpointer(tmp_path / "run", cfg, __import__("torch").device("cpu")).close()
    finally:
        dist.destroy_process_group()
    _intact(victim)


# -- a manifest's CRCs must cover its whole bank ------------------------------------------------

def _private_home(tmp_path: Path) -> HostCopyDir:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("model: {}\n")
    home = HostCopyDir(run_dir, 0, 1, root=tmp_path)
    home.ensure()
    home.bank_path(0).write_bytes(b"x" * 16)
    return home


@pytest.mark.parametrize("crc32", [[], [[0, 8, 1]], [[0, 8, 1], [9, 7, 2]], [[0, 8, 1], [4, 12, 2]],
                                   [[0, 17, 1]], [[0, 16, -1]], [[0, 16, 2**32]], [[0, 16]],
                                   [["0", 16, 1]], [[0, 16, True]], None, "x"])
def test_a_manifest_whose_crcs_leave_bytes_out_describes_no_snapshot(tmp_path, crc32) -> None:
    home = _private_home(tmp_path)
    home.manifest_path(0).write_text(json.dumps(_manifest(home, crc32=crc32)))
    assert home.snapshots() == []


def test_a_manifest_whose_crcs_cover_the_bank_is_a_snapshot(tmp_path) -> None:
    home = _private_home(tmp_path)
    home.manifest_path(0).write_text(json.dumps(_manifest(home, crc32=[[0, 8, 1], [8, 8, 2]])))
    assert [m["step"] for m in home.snapshots()] == [3]


# -- a huge pid names no process ----------------------------------------------------------------

@pytest.mark.parametrize("pid", [2**63, 2**31, 10**30, 4_194_305])
def test_a_huge_pid_in_an_owner_record_or_folder_name_is_a_gone_agent(tmp_path, pid) -> None:
    ours = HostCopyDir(tmp_path / "run", 0, 1, root=tmp_path)
    other = HostCopyDir(tmp_path / "other", 0, 1, root=tmp_path)
    ours.ensure()
    other.ensure()
    (other.path / "rank0.owner").write_text(json.dumps({"agent_pid": pid}))
    private = ours.base / f"private-{pid}-1"
    private.mkdir(mode=0o700)
    assert sorted(ours.sweep()) == sorted([other.path, private])
