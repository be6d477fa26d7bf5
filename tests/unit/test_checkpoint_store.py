"""The checkpoint-store seam: another store is one class plus one registry line, and its callers
(the trainer's pick and commit, the export's pick) run through it without knowing any layout;
only the volume store's own modules know the volume's layout. A run picks its store with
``checkpoint.store``, recorded in its config.yaml, which ``open_store(run_dir)`` follows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml

from kfp_nvrx.components.core import store_kinds
from kfp_nvrx.components.core.ckpt_store import newest_intact, open_store
from kfp_nvrx.components.core.config import CheckpointConfig, Config, load_config
from kfp_nvrx.components.core.store_kinds import register_store
from kfp_nvrx.components.core.volume_store import VolumeStore
from kfp_nvrx.components.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


class MemoryStore:
    """A durable store held in a dict: what an S3 store would implement, minus the network."""

    kind = "memory"
    steps: dict[str, dict[int, dict[str, Any]]] = {}  # per run: step -> record ({} = torn)

    def __init__(self, run_dir: str | Path) -> None:
        self.held = self.steps.setdefault(str(run_dir), {})
        self.where = f"memory://{run_dir}"
        self.progress_file = Path(run_dir) / "progress"
        self.damaged: set[int] = set()
        self.progress: list[int] = []

    def committed_steps(self) -> list[int]:
        return sorted((s for s, r in self.held.items() if r), reverse=True)

    def entries(self) -> list[int]:
        return sorted(self.held)

    def name(self, step: int) -> str:
        return f"ckpt-{step}"

    def location(self, step: int) -> str:
        return f"{self.where}/{step}"

    def record(self, step: int) -> dict[str, Any] | None:
        return self.held.get(step) or None

    def problem(self, step: int, share: tuple[int, int] = (0, 1), crc: bool = True) -> str | None:
        return "bytes changed" if step in self.damaged else None

    def begin(self, step: int) -> str:
        self.held[step] = {}
        return self.location(step)

    def seal_rank(self, step: int, rank: int) -> None:
        pass

    def commit(self, step: int, world_size: int) -> int:
        self.held[step] = {"step": step, "world_size": world_size, "bytes": 10}
        return 10

    def record_progress(self, step: int) -> None:
        self.progress.append(step)

    def withdraw_newer(self, step: int) -> tuple[list[int], str | None]:
        gone = [s for s in self.committed_steps() if s > step]
        for s in gone:
            del self.held[s]
        return gone, None

    def finish_withdraw(self) -> None:
        pass

    def prune(self, keep: int) -> None:
        for s in self.committed_steps()[keep:]:
            del self.held[s]


def _record(run_dir: Path, store: str | None) -> None:
    """The run's config.yaml as its first start writes it, with ``checkpoint.store`` = ``store``
    (None: a record from before the key)."""
    raw = Config().to_dict()
    if store is None:
        del raw["checkpoint"]["store"]
    else:
        raw["checkpoint"]["store"] = store
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.fixture()
def registered(monkeypatch) -> None:
    """The fake registered with its one line (the registry restored after the test)."""
    monkeypatch.setattr(store_kinds, "_FACTORIES", dict(store_kinds._FACTORIES))
    monkeypatch.setattr(MemoryStore, "steps", {})
    register_store("memory", MemoryStore)


@pytest.fixture()
def memory(registered, tmp_path) -> MemoryStore:
    """A run whose config chose the fake: ``open_store(run_dir)`` opens it from the record."""
    _record(tmp_path, "memory")
    store = open_store(tmp_path)
    assert isinstance(store, MemoryStore) and "memory" in store_kinds.store_kinds()
    return store


def test_a_run_opens_the_store_its_config_chose(registered, tmp_path) -> None:
    cfg = load_config("tiny", ["checkpoint.store=memory"])  # valid once registered
    assert cfg.checkpoint.store == "memory"
    chose, old, fresh = tmp_path / "chose", tmp_path / "old", tmp_path / "fresh"
    _record(chose, cfg.checkpoint.store)
    _record(old, None)
    assert isinstance(open_store(chose), MemoryStore)
    assert isinstance(open_store(old), VolumeStore)  # a record from before the key: the volume
    assert isinstance(open_store(fresh), VolumeStore)  # no record yet: the default
    assert isinstance(open_store(fresh, "memory"), MemoryStore)  # the trainer's resolved kind


def test_an_unknown_store_is_refused_naming_checkpoint_store(tmp_path) -> None:
    with pytest.raises(UserError) as err:
        load_config("tiny", ["checkpoint.store=s3"])
    assert err.value.field == "checkpoint.store" and "volume" in err.value.message
    with pytest.raises(UserError) as err:
        CheckpointConfig().store = "s3"  # Python assignments are checked too
    assert err.value.field == "checkpoint.store"
    _record(tmp_path, "s3")  # a run recorded by a process that had an S3 store
    with pytest.raises(UserError) as err:
        open_store(tmp_path)
    assert err.value.field == "checkpoint.store" and "recorded in" in err.value.message
    with pytest.raises(UserError) as err:
        open_store(tmp_path, "s3")
    assert err.value.field == "checkpoint.store" and "got 's3'" in err.value.message


def test_commit_progress_and_prune_go_through_the_store(memory: MemoryStore) -> None:
    from kfp_nvrx.components.training.checkpoint.commit import write_commit

    for step in (2, 4, 6):
        memory.begin(step)
        assert write_commit(memory, step, world_size=2, keep=2) == 10
    assert memory.committed_steps() == [6, 4] and memory.progress == [2, 4, 6]


def test_newest_intact_skips_damage_in_any_store(memory: MemoryStore) -> None:
    for step in (2, 4, 6):
        memory.begin(step)
        memory.commit(step, 1)
    memory.begin(8)  # torn: never committed
    memory.damaged = {6}
    pick = newest_intact(memory)
    assert pick.step == 4 and pick.damaged == [(6, "bytes changed")]
    assert newest_intact(memory, wanted=2).step == 2


def test_the_export_picks_from_a_registered_store(memory: MemoryStore, tmp_path) -> None:
    from kfp_nvrx.components.training.export.checkpoint_read import select_checkpoint

    for step in (3, 5):
        memory.begin(step)
        memory.commit(step, 1)
    memory.begin(7)  # torn: the export names it only when asked for step 7
    logged: list[str] = []
    got = select_checkpoint(tmp_path, log=logged.append)
    assert (got.step, got.name, got.location) == (5, "ckpt-5", f"memory://{tmp_path}/5")
    assert not logged


def test_the_trainers_pick_runs_through_the_store(memory: MemoryStore, one_rank_env) -> None:
    from kfp_nvrx.components.training.checkpoint.recovery import Recovery

    for step in (1, 2):
        memory.begin(step)
        memory.commit(step, 1)
    memory.damaged = {2}
    lines: list[str] = []
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        found = Recovery(memory, CheckpointConfig(), torch.device("cpu"), None,
                         lines.append).select(log=lines.append)
    finally:
        dist.destroy_process_group()
    assert found == 1 and lines == ["checkpoint step 2 is damaged: bytes changed; "
                                    "falling back to step 1"]


#: The volume store's own modules: the only ones that may import its layout or its journal.
_VOLUME_STORE = {"volume_layout", "volume_store", "timeline", "rundir"}
_LAYOUT_NAMES = {"COMMIT_MARKER", "STEP_PREFIX", "CRC_SIDECAR_PREFIX", "DCP_METADATA", "step_dir",
                 "parse_step", "committed_steps", "verify", "write_commit_marker", "remove_torn",
                 "read_commit_marker", "checkpoints_dir", "CHECKPOINTS_DIR", "select_checkpoint"}


def test_only_the_volume_store_knows_its_layout() -> None:
    offenders = []
    for path in sorted([*(ROOT / "components").rglob("*.py"), *(ROOT / "bench").glob("*.py")]):
        if path.stem in _VOLUME_STORE and path.parent.name == "core":
            continue
        text = path.read_text()
        if re.search(r"core(\.| import )(volume_layout|timeline)\b", text):
            offenders.append(f"{path.relative_to(ROOT)} imports the volume layout")
        for one, many in re.findall(r"core\.rundir import (?:([^(\n]+)$|\(([^)]*)\))", text,
                                    re.MULTILINE):
            known = _LAYOUT_NAMES & set(re.findall(r"\w+", one + many))
            if known:
                offenders.append(f"{path.relative_to(ROOT)} takes {sorted(known)} from rundir")
    assert offenders == []


def test_the_trainer_reaches_the_store_only_through_its_interface() -> None:
    """Issue 39 item 2: no trainer module imports a store (the async writers took the volume
    store's checksums through a re-export: a remote store would have got a volume sidecar)."""
    offenders = [str(path.relative_to(ROOT))
                 for path in sorted((ROOT / "components" / "training").rglob("*.py"))
                 if re.search(r"core(\.| import )volume_store\b", path.read_text())]
    assert offenders == []


def test_a_torn_leftover_is_set_aside_at_once_and_deleted_off_the_loop(tmp_path,
                                                                      monkeypatch) -> None:
    """Issue 35: rewriting a step whose write a fault cut deleted the leftover on the loop."""
    import shutil
    import threading

    from kfp_nvrx.components.core.volume_layout import TRASH_PREFIX
    from kfp_nvrx.components.core.volume_store import VolumeStore

    store = VolumeStore(tmp_path)
    torn = Path(store.begin(5))
    (torn / "__0_0.distcp").write_bytes(b"x" * 1024)  # the cut write's file, no commit marker
    gate = threading.Event()
    real_rmtree = shutil.rmtree
    removing = []

    def slow_rmtree(path, *args, **kwargs):  # a multi-GB leftover: deleting takes a while
        removing.append(Path(path).name)
        gate.wait(10)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    try:
        again = Path(store.begin(5))  # returns while the old files are still being deleted
        assert again == torn and not list(again.iterdir())
        assert removing and removing[0].startswith(TRASH_PREFIX)
    finally:
        gate.set()
    for t in threading.enumerate():
        if t.name.startswith("ckpt-prune:"):
            t.join(10)
    assert sorted(p.name for p in store.root.iterdir()) == ["step_00000005"]
    link = store.root / "step_00000006"
    link.symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(Exception, match="link"):
        store.begin(6)  # never through a link
    assert tmp_path.is_dir()
