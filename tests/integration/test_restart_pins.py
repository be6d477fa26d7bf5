"""Issue 38 item 1: a restart never re-applies a launch's first-start pins.

``checkpoint.load_step=N`` pins the launch's first start; the run trains on from N and prunes it
(``checkpoint.keep``). A restart afterwards, in-job (``TORCHELASTIC_RESTART_COUNT``) or of a
recreated pod (a new agent, a ``start`` of this rendezvous id on record), resumes from the newest
step: the worker's checks must not stop it with "N is no committed checkpoint".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.local_runs import tiny_dataset, train

from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.core.events import EventLog, Start, read_events
from kfp_nvrx.components.core.run_record import record_config
from kfp_nvrx.components.core.rundir import (
    COMMIT_MARKER,
    DCP_METADATA,
    checkpoints_dir,
    committed_steps,
    step_dir,
)
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.trainer.bootstrap import prepare_job


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return tiny_dataset(tmp_path_factory.mktemp("data"))


def _commit(root: Path, step: int) -> None:
    """A committed step folder by hand (sizes in the marker, no CRCs)."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / DCP_METADATA).write_bytes(b"meta")
    (path / "__0_0.distcp").write_bytes(b"x" * 16)
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    (path / COMMIT_MARKER).write_text(json.dumps({"step": step, "world_size": 1, "files": files}))


def _pruned_run(tmp_path: Path, dataset: str) -> tuple[Path, list[str]]:
    """A run resumed with ``load_step=12`` that trained on to 21: 12 pruned, 18 and 21 kept."""
    run = tmp_path / "run"
    overrides = [f"data.path={dataset}", "train.steps=24", "checkpoint.load_step=12"]
    record_config(load_config("tiny", overrides), run)
    for step in (18, 21):
        _commit(checkpoints_dir(run), step)
    return run, overrides


def test_an_in_job_restart_after_the_pinned_step_was_pruned_starts(tmp_path, dataset,
                                                                   one_rank_env,
                                                                   monkeypatch) -> None:
    run, overrides = _pruned_run(tmp_path, dataset)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    job = prepare_job("tiny", overrides, [], run)
    assert job.cfg.checkpoint.load_step == 12  # the pin is the first start's; Recovery drops it


def test_a_recreated_pod_of_a_started_launch_starts(tmp_path, dataset, one_rank_env,
                                                     monkeypatch) -> None:
    run, overrides = _pruned_run(tmp_path, dataset)
    EventLog(run).emit(Start(incarnation=0, iteration=0, world_size=1, resumed_from=12,
                             run_id="launch-1"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a new agent counts from 0
    prepare_job("tiny", overrides, [], run)


def test_a_new_launch_is_still_held_to_its_pin(tmp_path, dataset, one_rank_env,
                                                monkeypatch) -> None:
    run, overrides = _pruned_run(tmp_path, dataset)
    EventLog(run).emit(Start(incarnation=0, iteration=0, world_size=1, resumed_from=12,
                             run_id="launch-1"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(UserError) as err:
        prepare_job("tiny", overrides, [], run)
    assert err.value.field == "checkpoint.load_step" and "committed: 18, 21" in err.value.message


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_killed_after_a_load_step_resume_pruned_the_step_restarts(tmp_path,
                                                                          dataset) -> None:
    """The reported run: 2 local nodes, ``keep=2``, ``load_step=12``, a rank killed later."""
    run = tmp_path / "run"
    # Every snapshot written while the run goes on (a write whenever the writer is free, slow
    # steps: ~10 s between the resume and the fault, for the writer process to start on a busy
    # machine and commit twice), so that the pinned step is pruned before the fault, as in the
    # reported run.
    base = ["checkpoint.interval=3", "checkpoint.keep=2", "checkpoint.persist_duty=1",
            "train.step_sleep=0.4"]
    train(run, dataset, ["train.steps=12", *base], deadline_s=400)
    res = train(run, dataset, ["train.steps=36", "checkpoint.load_step=12", *base],
                faults=["kill@34/1"], deadline_s=400)
    steps = committed_steps(checkpoints_dir(run))
    assert steps[0] == 36 and 12 not in steps, steps  # pruned before the fault
    starts = [e for e in read_events(run) if isinstance(e, Start)]
    resumed = [s.resumed_from for s in starts]
    assert resumed[:2] == [None, 12] and len(resumed) == 3 and resumed[2] > 12, (resumed,
                                                                                 res.reason)
