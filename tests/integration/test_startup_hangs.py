"""Issue 37 items 1 and 5 on CPU: every incarnation is watched from its first steps.

Real ft_launcher agents (NVRx 0.4.1 here), gloo, 2 local nodes x 1 process, the tiny preset, whose
configured step and heartbeat timeouts are 60 s. A hang in the third step of a fresh run, and in
the third step after an in-job restart, must be caught by a bound measured from the run (here the
4 s floor, ``resilience.min_learned_timeout``), not by the configured 60 s. (That a restarted
incarnation whose first steps stall past the learned timeout is not killed for it is
``test_one_fault_one_restart.py``'s start-up stall test.)

What is timed is the fault's event to the creation of the restarted rank 0 process: detection
plus ft_launcher's restart of the worker group, which takes a few seconds on a loaded machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.local_runs import tiny_dataset, train

from kfp_nvrx.components.core import events as ev
from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.core.events import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 12
#: gloo's collective timeout (the tiny preset's 10 s) above the configured timeouts: the peer
#: blocked in a collective with the hung rank must not be what ends the hang.
BASE = [f"train.steps={STEPS}", "checkpoint.interval=6", "checkpoint.keep=5",
        "resilience.pg_timeout=120"]
#: The tiny preset's configured step and heartbeat timeouts: what judged these hangs before.
CONFIGURED = load_config("tiny").resilience.step_timeout
#: Fault to the restarted worker: the 4 s floor, the monitor's 0.25 s check, ft_launcher's
#: restart (stopping the other worker, a rendezvous round, a new process), with room for a
#: loaded machine; far below the configured timeouts.
WITHIN = 20.0
#: A start event's parts that come before its incarnation: they run from process creation.
PROCESS_PARTS = ("interpreter", "imports", "checks", "cuda_context", "nvrx_client", "wrapper")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return tiny_dataset(tmp_path_factory.mktemp("data"))


def _fault_to_restart(run_dir: Path) -> tuple[ev.Start, ev.Start, float]:
    """The hang's incarnation, the one after it, and seconds from the hang to its new process."""
    events = read_events(run_dir)
    hang = next(e for e in events if isinstance(e, ev.Fault) and e.kind == "hang")
    starts = [e for e in events if isinstance(e, ev.Start)]
    before = [s for s in starts if s.time < hang.time][-1]
    after = next(s for s in starts if s.time > hang.time)
    created = after.time - sum((after.boot or {}).get(k, 0.0) for k in PROCESS_PARTS)
    seconds = created - hang.time
    print(f"\n[{run_dir.parent.name}] hang at step {hang.step} -> new worker in {seconds:.1f} s "
          f"(configured timeouts {CONFIGURED:g} s)")
    return before, after, seconds


def test_a_hang_in_the_third_step_of_a_run_is_caught_within_seconds(tmp_path, dataset):
    """Before issue 37 the fresh run's steps were judged by the configured 60 s until its
    rhythm was learned (~30 steps at 1b); now by safety_factor x its second step, at least the
    floor."""
    run = tmp_path / "run"
    train(run, dataset, BASE, faults=["hang@3/1"])
    before, after, seconds = _fault_to_restart(run)
    assert before.incarnation == 0 and after.incarnation == 1
    assert seconds < WITHIN < CONFIGURED


def test_a_hang_in_the_third_step_after_a_restart_is_caught_within_seconds(tmp_path, dataset):
    """The restarted incarnation resumes step 6 (saved with the learned rhythm), runs steps 7
    and 8 as its start-up and hangs in step 9, its third: judged by the restored rhythm, not
    relearned over its first steps under the configured timeouts."""
    run = tmp_path / "run"
    train(run, dataset, BASE, faults=["kill@8/1", "hang@9/0"])
    before, after, seconds = _fault_to_restart(run)
    assert before.incarnation == 1 and before.resumed_from == 6 and after.incarnation == 2
    assert seconds < WITHIN < CONFIGURED
