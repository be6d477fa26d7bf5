"""A resume is the resume asked for, and nothing is written or deleted through a symlink.

Unit-level checks of :mod:`kfp_nvrx.components.core.run_record` and the link guard of
:mod:`kfp_nvrx.components.core.rundir` as the trainer, the pruner and the writer use them; the
bad-input sweep (tests/support/bad_input_cases.py) runs the same classes through the real commands.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import yaml

from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.core.ownership import claim_run_dir
from kfp_nvrx.components.core.run_record import check_resume, check_run_dir, record_config
from kfp_nvrx.components.core.rundir import (
    COMMIT_MARKER,
    CONFIG_FILE,
    DATASET_FILE,
    DCP_METADATA,
    RESUMED_CONFIG_FILE,
    checkpoints_dir,
    remove_torn,
    step_dir,
)
from kfp_nvrx.components.core.volume_store import prune
from kfp_nvrx.components.data.shards import FORMAT, INDEX_NAME
from kfp_nvrx.components.errors import UserError


def _commit(root: Path, step: int, payload: bytes = b"x" * 16) -> Path:
    """A committed step folder by hand (sizes in the marker, no CRCs)."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / DCP_METADATA).write_bytes(b"meta")
    (path / "__0_0.distcp").write_bytes(payload)
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    (path / COMMIT_MARKER).write_text(json.dumps({"step": step, "world_size": 1, "files": files}))
    return path


def _dataset(path: Path, digest: str = "a") -> Path:
    """A dataset's index by hand (the guards read the index, not the shards)."""
    path.mkdir(parents=True, exist_ok=True)
    shard = {"file": "train_00000.bin", "tokens": 8, "sha256": digest * 64}
    (path / INDEX_NAME).write_text(json.dumps({
        "format": FORMAT, "dtype": "uint16", "vocab_size": 256,
        "splits": {"train": {"tokens": 8, "shards": [shard]},
                   "val": {"tokens": 0, "shards": []}}}))
    return path


@pytest.fixture(autouse=True)
def _datasets(tmp_path, monkeypatch) -> None:
    """Two datasets of other content, ``data/a`` and ``data/b``, in the test's working dir."""
    monkeypatch.chdir(tmp_path)
    _dataset(tmp_path / "data" / "a", "a")
    _dataset(tmp_path / "data" / "b", "b")


def _run(tmp_path: Path, *overrides: str) -> tuple[Path, object]:
    run = tmp_path / "run"
    cfg = load_config("tiny", ["data.path=data/a", *overrides])
    record_config(cfg, run)
    _commit(checkpoints_dir(run), 4)
    return run, cfg


def _join_pruners() -> None:
    for t in threading.enumerate():
        if t.name.startswith("ckpt-prune:"):
            t.join(timeout=10)


# -- 1. a resume that cannot be the resume asked for stops ----------------------------------------

def test_load_step_that_does_not_exist_is_refused_naming_the_committed_steps(tmp_path) -> None:
    run, _ = _run(tmp_path)
    with pytest.raises(UserError) as err:
        check_run_dir(run, load_config("tiny", ["data.path=data/a", "checkpoint.load_step=7"]))
    assert err.value.field == "checkpoint.load_step" and "committed: 4" in err.value.message
    # ... and in a fresh run dir (it used to train from scratch beside nothing at all).
    with pytest.raises(UserError):
        check_run_dir(tmp_path / "new", load_config("tiny", ["checkpoint.load_step=3"]))
    check_run_dir(run, load_config("tiny", ["data.path=data/a", "checkpoint.load_step=4"]))


def test_load_step_whose_files_are_damaged_is_refused_not_replaced_by_an_older_one(
        tmp_path) -> None:
    run, _ = _run(tmp_path)
    _commit(checkpoints_dir(run), 2)
    os.truncate(step_dir(checkpoints_dir(run), 4) / "__0_0.distcp", 3)
    with pytest.raises(UserError) as err:
        check_run_dir(run, load_config("tiny", ["data.path=data/a", "checkpoint.load_step=4"]))
    assert err.value.field == "checkpoint.load_step" and "damaged" in err.value.message


@pytest.mark.parametrize("override, key", [
    ("train.seed=7", "train.seed"),
    ("data.path=data/b", "data.path"),
    ("model.norm_eps=0.001", "model.norm_eps"),
    ("model.rope_theta=500000", "model.rope_theta"),
])
def test_a_resume_with_another_seed_data_or_model_is_refused(tmp_path, override, key) -> None:
    run, _ = _run(tmp_path)
    before = (run / CONFIG_FILE).read_bytes()
    with pytest.raises(UserError) as err:
        check_run_dir(run, load_config("tiny", ["data.path=data/a", override]))
    assert err.value.field == key and f"checkpoint.allow_changes={key}" in err.value.message
    assert (run / CONFIG_FILE).read_bytes() == before


def test_allow_changes_names_what_may_change_and_nothing_else(tmp_path) -> None:
    run, _ = _run(tmp_path)
    ok = load_config("tiny", ["data.path=data/b", "train.seed=7",
                              "checkpoint.allow_changes=data.path, train.seed"])
    check_resume(ok, run)
    with pytest.raises(UserError) as err:  # the seed is still guarded
        check_resume(load_config("tiny", ["data.path=data/b", "train.seed=7",
                                          "checkpoint.allow_changes=data.path"]), run)
    assert err.value.field == "train.seed"
    check_resume(load_config("tiny", ["data.path=data/a", "model.norm_eps=0.001",
                                      "checkpoint.allow_changes=model"]), run)
    with pytest.raises(UserError) as err:
        load_config("tiny", ["checkpoint.allow_changes=train.lr"])
    assert err.value.field == "checkpoint.allow_changes"


def test_the_same_dataset_spelled_another_way_is_the_same_data(tmp_path, monkeypatch) -> None:
    data = tmp_path / "data" / "a"
    run = tmp_path / "run"
    record_config(load_config("tiny", [f"data.path={data}"]), run)
    _commit(checkpoints_dir(run), 4)
    check_resume(load_config("tiny", ["data.path=./data/a/"]), run)


def test_config_yaml_is_the_record_and_is_never_replaced(tmp_path) -> None:
    run, cfg = _run(tmp_path)
    record = (run / CONFIG_FILE).read_bytes()
    longer = load_config("tiny", ["data.path=data/a", "train.steps=80"])
    check_resume(longer, run)  # more steps: a legitimate resume
    record_config(longer, run)
    assert (run / CONFIG_FILE).read_bytes() == record
    assert yaml.safe_load((run / RESUMED_CONFIG_FILE).read_text())["train"]["steps"] == 80
    record_config(cfg, run)  # back to the record: the stale resumed config goes
    assert not (run / RESUMED_CONFIG_FILE).exists()
    assert (run / CONFIG_FILE).read_bytes() == record
    assert [p.name for p in run.iterdir() if p.name.endswith(".tmp")] == []


def test_a_resume_in_another_checkpoint_store_is_refused(tmp_path, monkeypatch) -> None:
    from kfp_nvrx.components.core import store_kinds
    from kfp_nvrx.components.core.volume_store import VolumeStore

    monkeypatch.setattr(store_kinds, "_FACTORIES", dict(store_kinds._FACTORIES))
    store_kinds.register_store("other", VolumeStore)  # a second kind, as an S3 store would be
    run, cfg = _run(tmp_path)
    before = (run / CONFIG_FILE).read_bytes()
    with pytest.raises(UserError) as err:
        check_run_dir(run, load_config("tiny", ["data.path=data/a", "checkpoint.store=other"]))
    assert err.value.field == "checkpoint.store" and "records 'volume'" in err.value.message
    assert "\n" not in err.value.one_line() and (run / CONFIG_FILE).read_bytes() == before
    with pytest.raises(UserError) as err:  # no allow_changes lets it change
        load_config("tiny", ["checkpoint.allow_changes=checkpoint.store"])
    assert err.value.field == "checkpoint.allow_changes"
    # A record from before the key is a volume run: it resumes as before, no resumed config.
    raw = yaml.safe_load(before)
    del raw["checkpoint"]["store"]
    (run / CONFIG_FILE).write_text(yaml.safe_dump(raw, sort_keys=False))
    check_resume(cfg, run)
    record_config(cfg, run)
    assert not (run / RESUMED_CONFIG_FILE).exists()
    with pytest.raises(UserError) as err:
        check_resume(load_config("tiny", ["data.path=data/a", "checkpoint.store=other"]), run)
    assert err.value.field == "checkpoint.store"


# -- 1b. the records themselves: the data by content, and no record rewritten over checkpoints --

def test_other_data_at_the_same_path_is_refused_unless_allowed(tmp_path) -> None:
    run, cfg = _run(tmp_path)
    record = (run / DATASET_FILE).read_bytes()
    assert json.loads(record)["path"] == str((tmp_path / "data" / "a").resolve())
    _dataset(tmp_path / "data" / "a", "c")  # prepare-data --overwrite into the same folder
    with pytest.raises(UserError) as err:
        check_run_dir(run, cfg)
    assert err.value.field == "data.path" and "other data" in err.value.message
    assert "`overrides=checkpoint.allow_changes=data.path`" in err.value.message
    assert len(err.value.one_line()) == len(str(err.value))  # one line as it is
    allowed = load_config("tiny", ["data.path=data/a", "checkpoint.allow_changes=data.path"])
    check_run_dir(run, allowed)
    record_config(allowed, run)
    assert (run / DATASET_FILE).read_bytes() == record  # the record is never replaced
    _dataset(tmp_path / "data" / "a", "a")  # the original data back: a plain resume again
    check_run_dir(run, cfg)


def test_the_same_data_moved_needs_only_the_path_allowed(tmp_path) -> None:
    run, _ = _run(tmp_path)
    _dataset(tmp_path / "data" / "moved", "a")
    with pytest.raises(UserError) as err:
        check_run_dir(run, load_config("tiny", ["data.path=data/moved"]))
    assert err.value.field == "data.path" and "records" in err.value.message
    check_run_dir(run, load_config("tiny", ["data.path=data/moved",
                                            "checkpoint.allow_changes=data.path"]))


def test_a_missing_dataset_record_beside_checkpoints_is_refused_then_recorded_on_request(
        tmp_path) -> None:
    run, cfg = _run(tmp_path)
    (run / DATASET_FILE).unlink()
    with pytest.raises(UserError) as err:
        check_run_dir(run, cfg)
    assert err.value.field == "run_dir" and DATASET_FILE in err.value.message
    assert "checkpoint.allow_changes=data.path" in err.value.message
    assert not (run / DATASET_FILE).exists()
    allowed = load_config("tiny", ["data.path=data/a", "checkpoint.allow_changes=data.path"])
    check_run_dir(run, allowed)
    record_config(allowed, run)
    check_run_dir(run, cfg)  # recorded now: guarded again without the override
    with pytest.raises(UserError):
        check_run_dir(run, load_config("tiny", ["data.path=data/b"]))


@pytest.mark.parametrize("text", ["", "{}\n", "model: {dim: 64}\n", "- a\n", "\x00\xff"])
def test_a_missing_or_cut_down_config_record_beside_checkpoints_is_refused(tmp_path,
                                                                          text) -> None:
    run, cfg = _run(tmp_path)
    record = run / CONFIG_FILE
    if text:
        record.write_bytes(text.encode("latin-1"))
    else:
        record.unlink()
    with pytest.raises(UserError) as err:
        check_run_dir(run, cfg)
    assert err.value.field == "run_dir" and str(record) in err.value.message
    assert "fresh `run_dir`" in err.value.message or "restore" in err.value.message
    assert (record.read_bytes() == text.encode("latin-1")) if text else not record.exists()


def test_a_cut_down_record_is_refused_even_without_checkpoints(tmp_path) -> None:
    run = tmp_path / "run"
    record_config(load_config("tiny", ["data.path=data/a"]), run)
    (run / CONFIG_FILE).write_text("train: {seed: 0}\n")  # the model and data.path cut away
    with pytest.raises(UserError) as err:
        check_run_dir(run, load_config("tiny", ["data.path=data/b", "model.dim=32"]))
    assert err.value.field == "run_dir" and "cut down" in err.value.message
    assert "data.path" in err.value.message and "more" in err.value.message


def test_a_lost_config_record_is_replaced_only_when_every_guarded_key_may_change(
        tmp_path) -> None:
    run, cfg = _run(tmp_path)
    (run / CONFIG_FILE).unlink()
    with pytest.raises(UserError) as err:  # two of three keys allowed: still refused
        check_run_dir(run, load_config("tiny", ["data.path=data/a",
                                                "checkpoint.allow_changes=model,data.path"]))
    assert err.value.field == "run_dir" and "step 4" in err.value.message
    every = load_config("tiny", ["data.path=data/a",
                                 "checkpoint.allow_changes=model,data.path,train.seed"])
    check_run_dir(run, every)
    record_config(every, run)
    check_run_dir(run, cfg)  # a new record, written on request, guards again


def test_a_first_start_and_a_run_dir_without_checkpoints_need_no_records(tmp_path) -> None:
    run = tmp_path / "run"
    cfg = load_config("tiny", ["data.path=data/a"])
    check_run_dir(run, cfg)
    record_config(cfg, run)
    assert (run / CONFIG_FILE).is_file() and (run / DATASET_FILE).is_file()
    for name in (CONFIG_FILE, DATASET_FILE):
        (run / name).unlink()
    check_run_dir(run, cfg)  # nothing committed: nothing to protect, the next start records


@pytest.mark.parametrize("content", ["not json", json.dumps({"fingerprint": "abc"}), "[]", None])
def test_a_damaged_dataset_record_is_one_line_naming_the_run_dir(tmp_path, content) -> None:
    run, cfg = _run(tmp_path)
    (run / DATASET_FILE).unlink()
    if content is None:
        os.mkfifo(run / DATASET_FILE)
    else:
        (run / DATASET_FILE).write_text(content)
    with pytest.raises(UserError) as err:
        check_run_dir(run, cfg)
    assert err.value.field == "run_dir" and DATASET_FILE in err.value.message


# -- 2. pruning and saving never act through a symlink out of the run dir ---------------------------

def test_a_checkpoints_dir_that_links_elsewhere_is_never_pruned(tmp_path) -> None:
    foreign = tmp_path / "foreign"
    for step in (1, 2, 3, 4):
        _commit(foreign, step)
    run = claim_run_dir(tmp_path / "run")
    (run / "checkpoints").symlink_to(foreign)
    prune(checkpoints_dir(run), keep=1)
    _join_pruners()
    assert sorted(p.name for p in foreign.iterdir()) == [step_dir(foreign, s).name
                                                         for s in (1, 2, 3, 4)]
    with pytest.raises(UserError) as err:
        check_run_dir(run)
    assert err.value.field == "run_dir" and "symbolic link" in err.value.message


def test_a_step_dir_that_links_elsewhere_is_neither_pruned_nor_cleared(tmp_path) -> None:
    run = tmp_path / "run"
    root = checkpoints_dir(run)
    for step in (5, 6, 7):
        _commit(root, step)
    foreign = _commit(tmp_path / "elsewhere", 1)
    step_dir(root, 1).symlink_to(foreign)  # the oldest: prune would drop it
    prune(root, keep=2)
    _join_pruners()
    assert (foreign / COMMIT_MARKER).is_file() and step_dir(root, 1).is_symlink()
    assert not step_dir(root, 5).exists() and step_dir(root, 7).is_dir()  # the real one went
    step_dir(root, 8).symlink_to(foreign)  # a torn step the next save would clear
    with pytest.raises(UserError) as err:
        remove_torn(step_dir(root, 8), run)
    assert "symbolic link" in err.value.message and (foreign / COMMIT_MARKER).is_file()


@pytest.mark.parametrize("name", ["events.jsonl", "config.yaml", "logs/node0.log",
                                  "nccl_trace/rank_0", "checkpoints/step_00000004"])
def test_a_run_dir_holding_a_link_where_we_write_is_refused_before_anything(tmp_path,
                                                                            name) -> None:
    run, _ = _run(tmp_path)
    target = tmp_path / "precious"
    target.write_text("keep me")
    link = run / name
    link.parent.mkdir(exist_ok=True)
    if os.path.lexists(link):
        os.rename(link, tmp_path / "moved")
    link.symlink_to(target)
    with pytest.raises(UserError) as err:
        check_run_dir(run)
    assert err.value.field == "run_dir" and name.split("/")[-1] in err.value.message
    assert target.read_text() == "keep me"


def test_the_run_dir_itself_may_be_a_link(tmp_path) -> None:
    real = tmp_path / "real"
    record_config(load_config("tiny"), real)
    (tmp_path / "alias").symlink_to(real)
    check_run_dir(tmp_path / "alias")
