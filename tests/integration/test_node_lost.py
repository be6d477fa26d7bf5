"""Issue 36 on CPU: a lost node restores from the copies its peers hold, not from the volume.

Real ft_launcher agents (NVRx 0.4.1 here), gloo, local nodes x 1 process, the tiny preset in
``train.deterministic`` mode. Each local node keeps its host memory in a folder of its own, so
``node-lost`` (every worker of the node killed, its folder removed) really loses its snapshots.
The durable write of step 12 is slowed past the fault, so the newest snapshot (12) is not
committed when the node goes: only host memory, a peer's, holds it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.local_runs import assert_bitwise, final_weights, tiny_dataset, train

from kfp_nvrx.components.core import events as ev
from kfp_nvrx.components.core.events import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 24
# Every write starts once the writer is free, at a pace that leaves it time to commit step 6 or
# 12 before the fault (what was committed is read from the events, not assumed); the write of
# step 18 is slowed by 60 s, so at step 22 it is still in flight. The fault comes four steps
# after that snapshot, whose peer copy takes milliseconds once every rank sealed it (a tick or two).
BASE = [f"train.steps={STEPS}", "checkpoint.interval=6", "checkpoint.keep=5",
        "checkpoint.persist_duty=1", "train.deterministic=true", "train.step_sleep=0.25"]
SLOW_18 = "slow-write@17/0:seconds=60"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return tiny_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    train(run_dir, dataset, BASE)
    return final_weights(run_dir, STEPS)


@pytest.fixture(scope="module")
def reference3(tmp_path_factory, dataset):
    """The fault-free run on three nodes (another world size trains other weights)."""
    run_dir = tmp_path_factory.mktemp("ref3") / "run"
    train(run_dir, dataset, BASE, nodes="3")
    return final_weights(run_dir, STEPS)


def _restart(run_dir: Path) -> tuple[ev.Start, int | None]:
    """The restart's start (there must be one), and the newest step committed before it."""
    events = read_events(run_dir)
    [restart] = [e for e in events if isinstance(e, ev.Restart)]
    committed = [e.step for e in events if isinstance(e, ev.Checkpoint) and e.time < restart.time]
    return [e for e in events if isinstance(e, ev.Start)][-1], max(committed, default=None)


def _from_the_volume(run_dir: Path, nodes: int) -> None:
    start, committed = _restart(run_dir)
    assert committed != 18
    assert start.resumed_from == committed  # not 18: no node holds every rank's snapshot
    assert start.sources == (["volume"] * nodes if committed is not None else None)
    assert not start.from_memory and not start.peer_bytes


@pytest.mark.parametrize("nodes", [2, 3])
def test_a_lost_node_restores_its_uncommitted_snapshot_from_its_peer(tmp_path, dataset, nodes,
                                                                     request) -> None:
    run = tmp_path / "run"
    train(run, dataset, BASE, nodes=str(nodes), faults=["node-lost@22/1", SLOW_18])
    start, committed = _restart(run)
    assert committed != 18
    assert start.resumed_from == 18  # newer than anything committed: host memory only
    assert start.sources == ["memory", "peer"] + ["memory"] * (nodes - 2)
    assert start.peer_bytes and start.peer_bytes > 0
    want = request.getfixturevalue("reference" if nodes == 2 else "reference3")
    assert_bitwise(final_weights(run, STEPS), want)


def test_a_node_and_the_holder_of_its_copy_lost_together_read_the_volume(tmp_path, dataset,
                                                                        reference3) -> None:
    # Three nodes, one copy each on the next node: node 1's copy is on node 2; both go.
    run = tmp_path / "run"
    train(run, dataset, BASE, nodes="3", faults=["node-lost@22/1", "node-lost@22/2", SLOW_18])
    _from_the_volume(run, 3)
    assert_bitwise(final_weights(run, STEPS), reference3)


def test_replication_off_is_todays_path(tmp_path, dataset, reference) -> None:
    run = tmp_path / "run"
    train(run, dataset, [*BASE, "checkpoint.replicas=1"], faults=["node-lost@22/1", SLOW_18])
    _from_the_volume(run, 2)
    assert_bitwise(final_weights(run, STEPS), reference)
