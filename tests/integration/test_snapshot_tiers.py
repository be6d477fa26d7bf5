"""Issue 35 on CPU: snapshots at their own pace, the durable write behind them, faults in the overlap.

Real ft_launcher agents (NVRx 0.4.1), gloo, 2 local nodes x 1 process, the tiny preset in
``train.deterministic`` mode. A snapshot every 2 steps; the ``slow-write`` fault makes the next
durable write take seconds longer in the writer process (a slow store), so that snapshots are
taken while it is in flight. Every faulted run must end with weights bitwise equal to the
fault-free reference and redo at most one snapshot interval.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.local_runs import assert_bitwise, final_weights, tiny_dataset, train

from kfp_nvrx.components.core import events as ev
from kfp_nvrx.components.core.events import read_events
from kfp_nvrx.components.core.rundir import committed_steps
from kfp_nvrx.components.core.volume_store import VolumeStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 30
INTERVAL = 2
SLOW_S = 8.0
# Healthy 0.2 s steps: a run long enough for writes and snapshots to overlap on any machine.
BASE = [f"train.steps={STEPS}", f"checkpoint.interval={INTERVAL}", "checkpoint.keep=20",
        "checkpoint.persist_duty=1", "train.deterministic=true", "train.step_sleep=0.2"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return tiny_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    train(run_dir, dataset, BASE, deadline_s=300)
    return final_weights(run_dir, STEPS)


def _events(run_dir: Path) -> list[ev.Event]:
    return list(read_events(run_dir))


def test_a_write_slower_than_the_snapshot_interval_never_holds_a_step(tmp_path, dataset,
                                                                      reference):
    run = tmp_path / "run"
    train(run, dataset, BASE, faults=[f"slow-write@2:seconds={SLOW_S:g}"], deadline_s=300)
    events = _events(run)
    slowed = [e for e in events if isinstance(e, ev.Checkpoint) and e.total_s >= SLOW_S]
    assert slowed, "no durable write was slowed"
    write = slowed[0]
    began, ended = write.time - write.total_s, write.time
    # Snapshots went on while the slowed write was in flight, and no step waited for it.
    during = [e for e in events if isinstance(e, ev.Snapshot) and began < e.time < ended]
    assert len(during) >= 2 and all(not e.skipped for e in during), during
    steps = [e for e in events if isinstance(e, ev.Step) and began < e.end and e.start < ended]
    slowest = max(steps, key=lambda e: e.end - e.start)
    assert slowest.end - slowest.start < SLOW_S / 2, (slowest, len(steps))
    # Superseded snapshots were never written, and what was committed is whole.
    snapshot_steps = {e.step for e in events if isinstance(e, ev.Snapshot) and not e.skipped}
    store = VolumeStore(run)
    committed = committed_steps(run / "checkpoints")
    assert set(committed) < snapshot_steps and committed[0] == STEPS
    assert store.entries() == sorted(committed)  # no torn step left behind
    assert all(store.problem(s) is None for s in committed)  # sizes and CRC32s check out
    assert_bitwise(final_weights(run, STEPS), reference)


@pytest.mark.parametrize("faults,fault_step", [
    (["kill-in-ckpt@12/1"], 12),  # right after a snapshot's copies, before its write
    ([f"slow-write@2:seconds={SLOW_S:g}", "kill@13/0"], 13),  # a write in flight, rank 0
    ([f"slow-write@2:seconds={SLOW_S:g}", "kill@13/1"], 13),  # a write in flight, rank 1
    (["kill@17/1"], 17),  # between snapshots
], ids=["after-snapshot", "in-write-rank0", "in-write-rank1", "between"])
def test_a_fault_anywhere_in_the_overlap_resumes_from_the_newest_snapshot(
        tmp_path, dataset, reference, faults, fault_step):
    run = tmp_path / "run"
    train(run, dataset, BASE, faults=faults, deadline_s=300)
    events = _events(run)
    assert [e.kind for e in events if isinstance(e, ev.Restart)] == [ev.IN_JOB]
    [_, restart] = [e for e in events if isinstance(e, ev.Start)]
    # The newest snapshot every rank held sealed: at most one interval of steps redone (a kill
    # at a step's start loses the steps before it; one after a snapshot, that step too).
    last_done = fault_step if faults[-1].startswith("kill-in-ckpt") else fault_step - 1
    assert last_done - INTERVAL <= restart.resumed_from <= last_done, restart
    assert restart.from_memory
    assert_bitwise(final_weights(run, STEPS), reference)
