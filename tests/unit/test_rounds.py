"""Rendezvous rounds (issue 30 items 2 and 3): every node's agent per round, read back.

* the layer of a restart comes from every node's agent, not rank 0's alone: a PyTorchJob whose
  worker-1 pod was recreated restarted at the pod layer although rank 0's agent is the same;
* ``resilience.max_restarts`` is the job's budget of in-job restarts, all nodes together;
* a round whose workers never logged a start (they failed first, or rank 0 refused the restart)
  is a restart all the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kfp_nvrx.components.core.events import Join, parse_events
from kfp_nvrx.components.core.exits import BROKE_LINE, BUDGET_SPENT, verdict
from kfp_nvrx.components.core.goodput import summarize_events
from kfp_nvrx.components.core.rounds import budget, current_budget, might_spend, rounds

A, B, C, D, E = "boot/11/1", "boot/12/1", "boot/13/2", "boot/14/3", "boot/15/4"  # agents


class _Run:
    """A run's events: rounds of joins, each with rank 0's start, six steps, maybe a fault."""

    def __init__(self) -> None:
        self.ev: list[dict] = []
        self.t, self.inc, self.pid = 100.0, 0, 1000

    def round(self, agents: list[str], start: bool = True, fault: bool = True,
              nodes: int = 0) -> None:
        self.t += 5
        self.pid += 10
        for node, agent in enumerate(agents):  # node 0's worker is rank 0
            self.ev.append({"type": "join", "time": self.t + 0.1 * node, "agent": agent,
                            "node": node, "nodes": nodes or len(agents), "rank": node,
                            "pid": self.pid + node, "run_id": "job", "endpoint": "w0:29500"})
        if not start:
            return
        if self.inc:  # rank 0's own word: it only compares its own agent
            self.ev.append({"type": "restart", "time": self.t + 1, "kind": "in-job",
                            "incarnation": self.inc, "iteration": 0})
        self.ev.append({"type": "start", "time": self.t + 0.5, "incarnation": self.inc,
                        "iteration": 0, "world_size": len(agents), "pid": self.pid,
                        "run_id": "job", "agent": agents[0], "resumed_from": None
                        if not self.inc else 2, "layer": "in-job" if self.inc else None})
        self.t += 1
        for s in range(1, 7):
            self.ev.append({"type": "step", "time": self.t + 1, "step": s, "start": self.t,
                            "end": self.t + 1, "incarnation": self.inc, "iteration": 0,
                            "loss": 5.0})
            self.t += 1
        if fault:
            self.ev.append({"type": "fault", "time": self.t, "kind": "kill", "step": 6,
                            "rank": 1})
        self.inc += 1

    def events(self):
        return parse_events(self.ev)


def test_a_recreated_pod_of_another_node_is_a_pod_restart() -> None:
    run = _Run()
    run.round([A, B])
    run.round([A, B])  # ft_launcher restarted the workers in place
    run.round([A, C], fault=False)  # worker-1's pod recreated: rank 0's agent A is the same
    events = run.events()
    got = [r.layer for r in rounds(events)]
    assert got == [None, "in-job", "pod"]
    rep = summarize_events(events)
    assert rep.restarts == {"in-job": 1, "pod": 1}, rep.restarts  # rank 0 said in-job twice
    assert any(s.startswith("rank 1 killed at step 6") for s in rep.what_happened)


def test_a_pid_that_repeats_in_every_pod_links_each_start_to_its_own_round() -> None:
    """The worker is pid 20 in every pod: a JobSet restart's new pods reuse rank 0's pid, and
    rank 0's worker-1 recreated (PyTorchJob) reads in-job to rank 0 alone."""
    run = _Run()
    run.round([A, B])
    run.pid -= 10  # the new pods' rank 0 is pid 1010 again
    run.round([C, D])
    run.round([C, E], fault=False)  # worker-1 recreated; rank 0 said in-job
    events = run.events()
    assert [r.layer for r in rounds(events)] == [None, "pod", "pod"]
    assert summarize_events(events).restarts == {"pod": 2}


def test_two_pods_on_one_node_are_two_agents_even_when_their_pids_and_ticks_agree() -> None:
    """ft_launcher is pid 13 in every container and two pods of one node often start it in the
    same 10 ms tick: the PID namespace tells their agents apart (here, two ``unshare --pid``
    containers whose agent is pid 1 of each)."""
    from kfp_nvrx.components.core.rounds import agent_identity

    code = "from kfp_nvrx.components.core.rounds import agent_identity; print(agent_identity())"
    ids = []
    for _ in range(2):
        # sh is pid 1 (the agent), python its child (the worker); '; :' keeps sh from exec'ing
        out = subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh",
                              "-c", f'"$0" -c "{code}"; :', sys.executable],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        ids.append(out.stdout.strip())
    (boot0, ns0, pid0, _), (boot1, ns1, pid1, _) = (i.split("/") for i in ids)
    assert boot0 == boot1 and pid0 == pid1 == "1"  # what alone named them alike before
    assert ns0 and ns1 and ns0 != ns1
    assert agent_identity().split("/")[1] == os.readlink("/proc/self/ns/pid")[5:-1]
    # Joins whose agents differ only there make one complete round, then an in-job restart.
    a, b = (f"{boot0}/{ns}/13/2633848" for ns in (ns0, ns1))
    run = _Run()
    run.round([a, b])
    run.round([a, b], fault=False)
    assert [(r.layer, r.complete) for r in rounds(run.events())] == [(None, True),
                                                                      ("in-job", True)]


def test_a_round_that_never_started_is_still_a_restart() -> None:
    run = _Run()
    run.round([A, B])
    run.round([A, B], start=False)  # its workers failed during set-up: no start event
    run.round([A, B], fault=False)
    rep = summarize_events(run.events())
    assert rep.restarts == {"in-job": 2}, rep.restarts


def test_the_budget_counts_every_nodes_restarts_once() -> None:
    """Three faults spread over two nodes with max_restarts=2: the third restart is too many
    (each ft_launcher saw at most two failures of its own workers)."""
    run = _Run()
    for _ in range(4):
        run.round([A, B])
    history = rounds(run.events())
    assert [budget(history[:n], 2).used for n in range(1, 5)] == [0, 1, 2, 3]
    assert not budget(history[:3], 2).spent and budget(history, 2).spent
    assert BUDGET_SPENT in budget(history, 2).line()
    assert "resilience.max_restarts=2" in budget(history, 2).line()


def test_the_budget_starts_again_with_the_job_and_skips_pod_restarts() -> None:
    run = _Run()
    run.round([A, B])
    run.round([A, B])  # in-job: 1
    run.round([A, C])  # a PyTorchJob pod recreated: a pod restart, not counted; the count goes on
    run.round([A, C])  # in-job: 2
    assert budget(rounds(run.events()), 1).used == 2
    run.round([D, E])  # every agent new: a JobSet restart or a relaunch, a fresh budget
    run.round([D, E])
    assert budget(rounds(run.events()), 1).used == 1


def test_an_incomplete_round_is_waited_for_only_when_it_could_spend_the_budget() -> None:
    run = _Run()
    run.round([A, B])
    run.round([A, B])
    run.round([A], start=False, nodes=2)  # rank 0 joined; node 1's join is still to come
    history = rounds(run.events())
    assert not history[-1].complete
    assert might_spend(history, 1) and not might_spend(history, 2)
    assert not might_spend(history[:1], 0)  # the job's first round is no restart
    fresh = _Run()
    fresh.round([A, B])
    fresh.round([C], start=False, nodes=2)  # a new agent so far: no in-job restart, yet
    assert not might_spend(rounds(fresh.events()), 0)


def test_rank0_waits_for_the_other_nodes_before_judging(tmp_path: Path) -> None:
    """At the edge of the budget, a new agent on node 1 makes the round a pod restart."""
    run = _Run()
    run.round([A, B])
    run.round([A, B])
    run.ev.append({"type": "join", "time": run.t + 5, "agent": A, "node": 0, "nodes": 2,
                   "rank": 0, "pid": 4242, "run_id": "job", "endpoint": "w0:29500"})
    late = {"type": "join", "time": run.t + 6, "agent": C, "node": 1, "nodes": 2, "rank": 1,
            "pid": 4343, "run_id": "job", "endpoint": "w0:29500"}
    events = tmp_path / "events.jsonl"
    events.write_text("".join(json.dumps(e) + "\n" for e in run.ev))
    mine = Join(time=run.t + 5, agent=A, node=0, nodes=2, rank=0, pid=4242, run_id="job",
                endpoint="w0:29500")
    assert current_budget(tmp_path, mine, 1, wait_s=0.0).spent  # node 1 never came: in-job
    with events.open("a") as f:
        f.write(json.dumps(late) + "\n")
    got = current_budget(tmp_path, mine, 1, wait_s=5.0)
    assert not got.spent and got.used == 1


def test_the_pod_entry_reads_the_spent_budget_as_a_give_up() -> None:
    out = f"{BUDGET_SPENT}: restart 3 ...\n... {BROKE_LINE}, e=SignalException(...)\n"
    assert verdict(1, out) == 1  # not 200 (a lost peer, restarted by the failure policies)


@pytest.mark.timeout(600)
def test_max_restarts_is_the_jobs_budget_not_each_nodes(tmp_path: Path) -> None:
    """Issue 30 item 2 on the local backend (the same agents as the pods): 3 faults over 2
    nodes, ``resilience.max_restarts=2``: the job fails at its third restart, in one line."""
    from kfp_nvrx.components.data.prepare import prepare_dataset

    prepare_dataset("sample:200", tmp_path / "data", seq_len=64)
    proc = subprocess.run(
        [sys.executable, "-m", "kfp_nvrx.components.cli", "launch-local", "--nodes", "2",
         "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"), "--config", "tiny",
         "--set", f"data.path={tmp_path / 'data'}", "--set", "train.steps=16", "--set",
         "checkpoint.interval=2", "--set", "resilience.max_restarts=2", "--fault", "kill@4/1",
         "--fault", "kill@8/0", "--fault", "kill@12/1"],
        capture_output=True, text=True, timeout=540)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    why = [ln for ln in proc.stderr.splitlines() if "Failed:" in ln]
    assert len(why) == 1 and BUDGET_SPENT in why[0], proc.stderr[-3000:]
    assert "restart 3 of the job" in why[0] and "resilience.max_restarts=2" in why[0]
    assert "restarts 3 (in-job 3, in-process 0, pod 0)" in proc.stdout, proc.stdout[-2000:]
