"""Issue 31 items 4-5 on CPU: a stopped node's workers save the step they trained, then exit.

Real ft_launcher agents (NVRx 0.4.1), gloo, 2 local nodes x 1 process, the tiny preset. The launch
is cancelled (SIGTERM, as a preempted or drained pod's entry point gets it) between two saves; the
relaunch must resume from the step the stop saved, not from the last periodic commit, and end with
final weights bitwise equal to a run that was never stopped.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from support.local_runs import assert_bitwise, final_weights, run_local, tiny_dataset

from kfp_nvrx.components.core import events as ev
from kfp_nvrx.components.core.events import read_events
from kfp_nvrx.components.core.rundir import committed_steps
from kfp_nvrx.components.core.volume_store import VolumeStore
from kfp_nvrx.components.launch.jobspec.spec import JobSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 24
BASE = [f"train.steps={STEPS}", "checkpoint.interval=6", "checkpoint.keep=5",
        "resilience.stop_save_timeout=30"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return tiny_dataset(tmp_path_factory.mktemp("data"))


def _spec(run_dir: Path, dataset: str, extra=(), faults=()) -> JobSpec:
    return JobSpec(nodes="2", run_dir=str(run_dir), config="tiny", faults=list(faults),
                   overrides=[f"data.path={dataset}", *BASE, *extra])


def _stop_at(run_dir: Path, step: int, in_write: bool = False) -> threading.Thread:
    """SIGTERMs this process (the launcher) once the run has trained ``step``.

    ``in_write``: and once a durable write is in flight (a step folder without its commit
    marker: the write began and has not committed), so the stop lands inside it on purpose.
    """
    def writing() -> bool:
        store = VolumeStore(run_dir)
        return any(s not in store.committed_steps() for s in store.entries())

    def watch() -> None:
        while not (any(isinstance(e, ev.Step) and e.step >= step for e in read_events(run_dir))
                   and (not in_write or writing())):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_stopped_launch_saves_its_step_and_the_relaunch_resumes_there(tmp_path, dataset):
    reference = tmp_path / "ref"
    assert run_local(_spec(reference, dataset), log=lambda _l: None, deadline_s=480).succeeded

    run = tmp_path / "run"
    watcher = _stop_at(run, 8)
    # Slow steps (a healthy 0.3 s each) so that the stop lands mid-run, whatever the machine.
    first = run_local(_spec(run, dataset, ["train.step_sleep=0.3"]), log=lambda _l: None,
                      deadline_s=480)
    watcher.join(timeout=5)
    assert first.state == "Cancelled", first.reason
    [end] = [e for e in read_events(run) if isinstance(e, ev.End)]
    assert end.status == "stopped" and 8 <= end.step < STEPS
    stopped_at = end.step
    assert committed_steps(run / "checkpoints")[0] == stopped_at  # saved on the stop
    saves = [e.step for e in read_events(run) if isinstance(e, ev.Checkpoint)]
    assert stopped_at in saves

    again = run_local(_spec(run, dataset), log=lambda _l: None, deadline_s=480)
    assert again.succeeded, (again.reason, again.last_log_lines)
    starts = [e for e in read_events(run) if isinstance(e, ev.Start)]
    assert starts[-1].resumed_from == stopped_at  # not the last periodic commit
    assert_bitwise(final_weights(run, STEPS), final_weights(reference, STEPS))


def test_a_stop_inside_a_write_saves_its_step(tmp_path, dataset):
    """Issue 35 item 4: the stop's SIGTERM reaches NVRx's writer process and its results queue
    too, which cut the write in flight; every rank must drop that write together and the stop
    still save its own step. The write is slowed (60 s) so that the stop lands inside it."""
    reference = tmp_path / "ref"
    assert run_local(_spec(reference, dataset), log=lambda _l: None, deadline_s=480).succeeded
    run = tmp_path / "run"
    watcher = _stop_at(run, 8, in_write=True)
    first = run_local(_spec(run, dataset, ["train.step_sleep=0.3"], ["slow-write@1:seconds=60"]),
                      log=lambda _l: None, deadline_s=480)
    watcher.join(timeout=5)
    assert first.state == "Cancelled", first.reason
    [end] = [e for e in read_events(run) if isinstance(e, ev.End)]
    assert end.status == "stopped" and 8 <= end.step < STEPS
    assert committed_steps(run / "checkpoints")[0] == end.step  # saved on the stop

    again = run_local(_spec(run, dataset), log=lambda _l: None, deadline_s=480)
    assert again.succeeded, (again.reason, again.last_log_lines)
    starts = [e for e in read_events(run) if isinstance(e, ev.Start)]
    assert starts[-1].resumed_from == end.step
    assert_bitwise(final_weights(run, STEPS), final_weights(reference, STEPS))


def test_without_a_save_budget_a_stop_saves_nothing(tmp_path, dataset):
    run = tmp_path / "run"
    watcher = _stop_at(run, 8)
    res = run_local(_spec(run, dataset, ["train.step_sleep=0.3", "resilience.stop_save_timeout=0"]),
                    log=lambda _l: None, deadline_s=480)
    watcher.join(timeout=5)
    assert res.state == "Cancelled"
    assert not [e for e in read_events(run) if isinstance(e, ev.End)]
    assert all(s % 6 == 0 for s in committed_steps(run / "checkpoints"))  # periodic saves only
