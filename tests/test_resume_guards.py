"""A resume is the resume asked for, and nothing is written or deleted through a symlink.

Unit-level checks of :mod:`kfp_nvrx.components.core.run_record` and the link guard of
:mod:`kfp_nvrx.components.core.rundir` as the trainer, the pruner and the writer use them; the
bad-input sweep (tests/bad_input_cases.py) runs the same classes through the real commands.
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
    DCP_METADATA,
    RESUMED_CONFIG_FILE,
    checkpoints_dir,
    remove_torn,
    step_dir,
)
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.checkpoint.files import prune


def _commit(root: Path, step: int, payload: bytes = b"x" * 16) -> Path:
    """A committed step folder by hand (sizes in the marker, no CRCs)."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / DCP_METADATA).write_bytes(b"meta")
    (path / "__0_0.distcp").write_bytes(payload)
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    (path / COMMIT_MARKER).write_text(json.dumps({"step": step, "world_size": 1, "files": files}))
    return path


def _run(tmp_path: Path, *overrides: str) -> tuple[Path, object]:
    run = tmp_path / "run"
    cfg = load_config("tiny", ["data.path=/data/a", *overrides])
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
        check_run_dir(run, load_config("tiny", ["data.path=/data/a", "checkpoint.load_step=7"]))
    assert err.value.field == "checkpoint.load_step" and "committed: 4" in err.value.message
    # ... and in a fresh run dir (it used to train from scratch beside nothing at all).
    with pytest.raises(UserError):
        check_run_dir(tmp_path / "new", load_config("tiny", ["checkpoint.load_step=3"]))
    check_run_dir(run, load_config("tiny", ["data.path=/data/a", "checkpoint.load_step=4"]))


def test_load_step_whose_files_are_damaged_is_refused_not_replaced_by_an_older_one(
        tmp_path) -> None:
    run, _ = _run(tmp_path)
    _commit(checkpoints_dir(run), 2)
    os.truncate(step_dir(checkpoints_dir(run), 4) / "__0_0.distcp", 3)
    with pytest.raises(UserError) as err:
        check_run_dir(run, load_config("tiny", ["data.path=/data/a", "checkpoint.load_step=4"]))
    assert err.value.field == "checkpoint.load_step" and "damaged" in err.value.message


@pytest.mark.parametrize("override, key", [
    ("train.seed=7", "train.seed"),
    ("data.path=/data/b", "data.path"),
    ("model.norm_eps=0.001", "model.norm_eps"),
    ("model.rope_theta=500000", "model.rope_theta"),
])
def test_a_resume_with_another_seed_data_or_model_is_refused(tmp_path, override, key) -> None:
    run, _ = _run(tmp_path)
    before = (run / CONFIG_FILE).read_bytes()
    with pytest.raises(UserError) as err:
        check_run_dir(run, load_config("tiny", ["data.path=/data/a", override]))
    assert err.value.field == key and f"checkpoint.allow_changes={key}" in err.value.message
    assert (run / CONFIG_FILE).read_bytes() == before


def test_allow_changes_names_what_may_change_and_nothing_else(tmp_path) -> None:
    run, _ = _run(tmp_path)
    ok = load_config("tiny", ["data.path=/data/b", "train.seed=7",
                              "checkpoint.allow_changes=data.path, train.seed"])
    check_resume(ok, run)
    with pytest.raises(UserError) as err:  # the seed is still guarded
        check_resume(load_config("tiny", ["data.path=/data/b", "train.seed=7",
                                          "checkpoint.allow_changes=data.path"]), run)
    assert err.value.field == "train.seed"
    check_resume(load_config("tiny", ["data.path=/data/a", "model.norm_eps=0.001",
                                      "checkpoint.allow_changes=model"]), run)
    with pytest.raises(UserError) as err:
        load_config("tiny", ["checkpoint.allow_changes=train.lr"])
    assert err.value.field == "checkpoint.allow_changes"


def test_the_same_dataset_spelled_another_way_is_the_same_data(tmp_path, monkeypatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    run = tmp_path / "run"
    record_config(load_config("tiny", [f"data.path={data}"]), run)
    monkeypatch.chdir(tmp_path)
    check_resume(load_config("tiny", ["data.path=./data/"]), run)


def test_config_yaml_is_the_record_and_is_never_replaced(tmp_path) -> None:
    run, cfg = _run(tmp_path)
    record = (run / CONFIG_FILE).read_bytes()
    longer = load_config("tiny", ["data.path=/data/a", "train.steps=80"])
    check_resume(longer, run)  # more steps: a legitimate resume
    record_config(longer, run)
    assert (run / CONFIG_FILE).read_bytes() == record
    assert yaml.safe_load((run / RESUMED_CONFIG_FILE).read_text())["train"]["steps"] == 80
    record_config(cfg, run)  # back to the record: the stale resumed config goes
    assert not (run / RESUMED_CONFIG_FILE).exists()
    assert (run / CONFIG_FILE).read_bytes() == record
    assert [p.name for p in run.iterdir() if p.name.endswith(".tmp")] == []


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
