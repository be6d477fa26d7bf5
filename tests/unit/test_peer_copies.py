"""Issue 36: every snapshot also held by a peer node, restored from it when a node is lost.

The layout and the restore plan are pure functions; the copies run between real gloo processes
(``support/peer_ranks.py``), each rank on a simulated node of its own (``KFP_NVRX_HOST_NODE``: a
host memory folder per node), so removing a node's folder really loses its snapshots.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kfp_nvrx.components.core.host_copy import NODE_ENV, host_copy_dir, node_copy_dir
from kfp_nvrx.components.launch.local.run import free_port
from kfp_nvrx.components.training.checkpoint.hostcopy import MANIFEST_VERSION, HostCopyDir
from kfp_nvrx.components.training.checkpoint.peers import peer_ranks, plan_restore
from kfp_nvrx.components.training.checkpoint.replicas import ReplicaRefused, check_manifest

TESTS = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- layout and plan
@pytest.mark.parametrize("keys,replicas,want", [
    (["a", "a", "b", "b"], 2, [[2], [3], [0], [1]]),  # the same local rank of the next node
    (["a", "b", "c"], 3, [[1, 2], [2, 0], [0, 1]]),
    (["a", "b", "c"], 2, [[1], [2], [0]]),
    (["a", "a"], 2, [[], []]),  # one node: nobody to hold a copy
    (["a", "b"], 1, [[], []]),  # replication off
    (["a", "b"], 4, [[1], [0]]),  # as many copies as there are other nodes
])
def test_copies_go_to_other_nodes_only(keys, replicas, want) -> None:
    got = peer_ranks(keys, replicas)
    assert got == want
    for rank, targets in enumerate(got):
        assert all(keys[t] != keys[rank] for t in targets)
        assert len({keys[t] for t in targets}) == len(targets)  # never two copies on one node


def test_the_plan_takes_the_newest_step_every_rank_can_get() -> None:
    # Rank 1's node is lost: its step 12 is held by rank 0's node; step 18 only by rank 0.
    own = [{6, 12, 18}, set(), {12}]
    held = [{(1, 12)}, set(), {(0, 12)}]
    assert plan_restore(own, held, newest=6) == (12, [(0, 1)])
    # Nobody holds rank 1's state: no step from host memory, the store's turn.
    assert plan_restore([{12}, set()], [set(), set()], newest=6) == (None, [])
    # Not older than the newest commit.
    assert plan_restore([{12}, set()], [{(1, 12)}, set()], newest=14) == (None, [])
    # Every rank holds its own: nothing to move.
    assert plan_restore([{12}, {12}], [set(), set()], newest=None) == (12, [])
    # The lowest holder sends.
    assert plan_restore([{12}, set(), {12}], [set(), set(), {(1, 12)}], None) == (12, [(2, 1)])
    # Ranks that moved nodes: a copy of its own state in its new node's folder comes first.
    assert plan_restore([set(), set()], [{(0, 12), (1, 12)}, {(0, 12), (1, 12)}], None) \
        == (12, [(0, 0), (1, 1)])


def test_a_manifest_of_another_run_step_rank_or_size_is_refused(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    home = HostCopyDir(run, 0, 2)
    good = {"version": MANIFEST_VERSION, "run_dir": home.run_dir, "run": "99:" + home.run.partition(":")[2],
            "rank": 1, "world_size": 2, "step": 12, "bank": 0, "nbytes": 8,
            "slots": [], "objects": {"__dict__": []}, "crc32": [[0, 8, 1]]}
    assert check_manifest(good, home, 1, 12) is good  # another node's device number: one run
    for change, why in [({"run": "1:2:3"}, "another run"), ({"run_dir": "/elsewhere"}, "another run"),
                        ({"step": 11}, "step"), ({"rank": 0}, "rank"), ({"world_size": 4}, "world_size"),
                        ({"crc32": [[0, 4, 1]]}, "cover"), ({"nbytes": -1}, "size")]:
        with pytest.raises(ReplicaRefused, match=why):
            check_manifest({**good, **change}, home, 1, 12)


# ---------------------------------------------------------------------------- real ranks
@pytest.fixture()
def run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    yield run
    shutil.rmtree(host_copy_dir(run), ignore_errors=True)


def _phase(run: Path, name: str, world: int, *overrides: str,
           nodes: list[int] | None = None) -> list[dict]:
    """Runs ``name`` on ``world`` ranks, rank r on node ``nodes[r]`` (default: node r)."""
    port = free_port()
    out = run.parent
    nodes = nodes or list(range(world))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "support.peer_ranks", name, str(r), str(world), str(port),
         str(run), str(out / f"{name}{r}.pt"), *overrides],
        cwd=TESTS, env={**os.environ, NODE_ENV: str(nodes[r])}) for r in range(world)]
    try:
        codes = [p.wait(240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0] * world
    return [torch.load(out / f"{name}{r}.pt", weights_only=False) for r in range(world)]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_a_lost_node_restores_from_its_peer_bitwise(run_dir) -> None:
    snap = _phase(run_dir, "snapshot", 2)
    assert [s["held"] for s in snap] == [True, True]
    held = sorted(p.name for p in node_copy_dir(run_dir, "0").iterdir())
    assert "rank0.replica1" in held and "rank0.replica1.json" in held
    shutil.rmtree(node_copy_dir(run_dir, "1"))  # node 1 and its memory are gone
    back = _phase(run_dir, "restore", 2)
    for rank in range(2):
        assert back[rank]["step"] == 2
        assert back[rank]["sources"] == ["memory", "peer"]
        assert _equal(back[rank]["tensors"], snap[rank]["tensors"])
    assert back[0]["peer_bytes"] > 0
    assert any("rank 1 fetched its state from rank 0" in n for n in back[1]["notes"])


@pytest.mark.timeout(300)
def test_ranks_that_moved_nodes_take_their_state_from_the_copies_there(run_dir) -> None:
    """After a restart the rendezvous put rank 0 on node 1 and rank 1 on node 0: each finds its
    own state as the copy its new node holds, and takes it without the network."""
    snap = _phase(run_dir, "snapshot", 2)
    back = _phase(run_dir, "restore", 2, nodes=[1, 0])
    for rank in range(2):
        assert back[rank]["step"] == 2 and back[rank]["sources"] == ["peer", "peer"]
        assert _equal(back[rank]["tensors"], snap[rank]["tensors"])


@pytest.mark.timeout(300)
def test_a_damaged_copy_is_refused_and_the_next_tier_is_taken(run_dir) -> None:
    _phase(run_dir, "snapshot", 2)
    shutil.rmtree(node_copy_dir(run_dir, "1"))
    copy = node_copy_dir(run_dir, "0") / "rank0.replica1"
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    back = _phase(run_dir, "restore", 2)
    # No commit was made: the next tier is a fresh start, never a mixed or damaged state.
    assert [b["step"] for b in back] == [None, None]
    assert any("changed since the snapshot" in n for n in back[1]["notes"])


@pytest.mark.timeout(300)
def test_with_replication_off_no_copies_are_made(run_dir) -> None:
    snap = _phase(run_dir, "snapshot", 2, "checkpoint.replicas=1")
    assert [s["held"] for s in snap] == [False, False]
    names = [p.name for p in node_copy_dir(run_dir, "0").iterdir()]
    assert not [n for n in names if "replica" in n]
    shutil.rmtree(node_copy_dir(run_dir, "1"))
    back = _phase(run_dir, "restore", 2, "checkpoint.replicas=1")
    assert [b["step"] for b in back] == [None, None]  # today's path: the store (empty here)


def test_a_link_in_place_of_a_node_folder_is_refused(tmp_path, monkeypatch) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    monkeypatch.setenv(NODE_ENV, "7")
    home = HostCopyDir(run, 0, 1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    try:
        home.base.mkdir(mode=0o700, exist_ok=True)
        home.run_path.mkdir(mode=0o700)
        home.path.symlink_to(elsewhere)
        assert not home.private()
        with pytest.raises(Exception, match="not a private directory"):
            home.ensure()
    finally:
        shutil.rmtree(home.run_path, ignore_errors=True)


def test_the_summary_and_metrics_say_where_each_restart_took_its_state() -> None:
    from kfp_nvrx.components.core import events as ev
    from kfp_nvrx.components.core.goodput import narrate, summarize_events
    from kfp_nvrx.components.launch.ui_outputs import metrics_from_summary

    steps = [ev.Step(time=t + 0.1, step=s, start=t, end=t + 0.1, incarnation=i)
             for i, (t0, first) in enumerate(((0.0, 1), (10.0, 7), (20.0, 13), (30.0, 19)))
             for s, t in ((first + k, t0 + k) for k in range(6))]
    starts = [ev.Start(time=0.0, incarnation=0),
              ev.Start(time=9.5, incarnation=1, resumed_from=6, layer=ev.IN_JOB, from_memory=True,
                       sources=["memory", "memory"]),
              ev.Start(time=19.5, incarnation=2, resumed_from=12, layer=ev.IN_JOB,
                       from_memory=True, sources=["memory", "peer"], peer_bytes=2_000_000_000),
              ev.Start(time=29.5, incarnation=3, resumed_from=18, layer=ev.IN_JOB,
                       sources=["volume", "volume"])]
    copies = [ev.Replica(time=3.0, step=2, seconds=0.4, bytes=10, loop_s=0.002),
              ev.Replica(time=15.0, step=12, seconds=0.5, bytes=10, ok=False, loop_s=0.003)]
    events = sorted([*steps, *starts, *copies], key=lambda e: e.when)
    rep = summarize_events(events)
    assert rep.peer_copies == 1 and rep.peer_copy_stall_s == pytest.approx(0.005)
    assert rep.restores == {"memory": 1, "peer": 1, "volume": 1}
    assert rep.peer_restore_bytes == 2_000_000_000
    m = metrics_from_summary(rep.to_dict())
    assert (m["restores_from_memory"], m["restores_from_peer"], m["restores_from_volume"],
            m["peer_restore_bytes"], m["peer_copies"]) == (1, 1, 1, 2_000_000_000, 1)
    assert any("host memory: 1 rank, peer: 1 rank, 2.00 GB from peers" in line
               for line in narrate(events))
