"""Rendezvous rounds: which agents started each incarnation's workers, and what follows from it.

Every ft_launcher restart is a new rendezvous round that every live agent takes part in, whichever
node failed. Each node's first worker writes a :class:`~.events.Join` per round (its agent, its
node); the rounds read back from them say, for every job API alike:

* **which layer restarted**: a round with an agent the previous round did not have means a pod
  was recreated (a JobSet restart, a PyTorchJob pod the operator replaced, a node that joined);
  otherwise the same agents restarted their workers in place (in-job). Rank 0 alone cannot tell:
  in a PyTorchJob whose worker-1 was recreated, rank 0's own agent only restarted its workers.
* **the job's restart budget**: ``resilience.max_restarts`` bounds the in-job restarts of the
  whole job, counted over every node since the job (re)started (every agent new: a launch, a
  relaunch or a JobSet restart). ft_launcher counts only the failures of its own node's workers,
  so three faults spread over two nodes passed ``max_restarts=2``; its count stays a backstop.

Imports no torch: the trainer's bootstrap, goodput and the launchers all read rounds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kfp_nvrx.components.core.elastic_env import agent_pid, env_int
from kfp_nvrx.components.core.events import IN_JOB, POD, Event, Join, Start

# The line rank 0 prints when the budget is spent: the pod entrypoint and the local launcher read
# it as a give-up (a final verdict, never an infrastructure failure to restart from).
from kfp_nvrx.components.core.exits import BUDGET_SPENT
from kfp_nvrx.components.core.procfs import STARTTIME, stat_fields

__all__ = ["BUDGET_SPENT", "Budget", "Round", "agent_identity", "budget", "current_budget",
           "join_event", "might_spend", "rounds", "start_layers"]


def agent_identity(ppid: int | None = None) -> str:
    """The agent (ft_launcher, torchrun) that started this worker, named for good.

    The machine's boot id, the PID namespace this worker shares with its agent, the agent's pid
    and its start time (clock ticks since boot). Every part is needed: ft_launcher has the same
    pid (13) in every pod, and two pods of one job on one node (one kernel: one boot id) often
    start their agents in the same 10 ms tick; their PID namespaces differ. '' off Linux. The
    trainer's ``start`` event names rank 0's agent the same way.
    """
    ppid = agent_pid() if ppid is None else ppid
    fields = stat_fields(ppid)
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    return "" if fields is None else f"{boot}/{_pid_namespace()}/{ppid}/{fields[STARTTIME]}"


def _pid_namespace() -> str:
    """This process's PID namespace (``pid:[4026532573]`` -> ``4026532573``); '' unreadable.

    A worker is forked by its agent, so it shares the agent's namespace; reading our own link
    needs no permission over another process.
    """
    try:
        return os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]")
    except OSError:
        return ""


def join_event(env: Mapping[str, str] | None = None, agent: str | None = None) -> Join:
    """This worker's :class:`Join`, from the environment its agent gave it."""
    env = os.environ if env is None else env
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    return Join(agent=agent_identity() if agent is None else agent,
                node=env_int("GROUP_RANK", 0, env, or_default=True),
                nodes=env_int("GROUP_WORLD_SIZE", 1, env, or_default=True),
                rank=env_int("RANK", 0, env, or_default=True), pid=os.getpid(),
                run_id=env.get("TORCHELASTIC_RUN_ID") or None,
                endpoint=f"{addr}:{port}" if addr or port else None)


@dataclass
class Round:
    """One rendezvous round: the agents that started its workers.

    Attributes:
        joins: The round's joins by agent.
        nodes: Nodes the round was formed with.
        layer: :data:`~.events.IN_JOB` (the same agents restarted their workers) or
            :data:`~.events.POD` (an agent is new) against the round before it; None for the
            first round on record.
        fresh: Every agent is new: the job (re)started here (a launch, a relaunch or a JobSet
            restart; which of these, the run's sessions say).
    """

    joins: dict[str, Join] = field(default_factory=dict)
    nodes: int = 1
    layer: str | None = None
    fresh: bool = True

    @property
    def time(self) -> float:
        """When its first worker joined."""
        return min(j.time for j in self.joins.values())

    @property
    def complete(self) -> bool:
        """Every node of the round has joined."""
        return len(self.joins) >= self.nodes

    def rank0(self) -> tuple[str, int | None] | None:
        """Rank 0's agent and process id (those of the round's ``start``), when it joined."""
        return next(((j.agent, j.pid) for j in self.joins.values() if j.rank == 0), None)


def _opens_round(cur: Round | None, join: Join) -> bool:
    """Whether ``join`` belongs to a new round rather than to ``cur``.

    An agent takes part in a round once; a round is full at its node count; rounds of other
    run ids or endpoints are others (an endpoint may repeat across rounds: not a proof of
    sameness, only of difference).
    """
    if cur is None or join.agent in cur.joins or cur.complete:
        return True
    first = next(iter(cur.joins.values()))
    return (join.run_id, join.endpoint, join.nodes) != (first.run_id, first.endpoint, first.nodes)


def rounds(events: list[Event]) -> list[Round]:
    """The rounds of a run's joins (events in time order), each classified against the last."""
    out: list[Round] = []
    for e in events:
        if isinstance(e, Join) and e.agent:
            if _opens_round(out[-1] if out else None, e):
                out.append(Round(nodes=max(1, e.nodes)))
            out[-1].joins[e.agent] = e
    for prev, cur in zip([None, *out], out, strict=False):
        classify(cur, prev)
    return out


def classify(cur: Round, prev: Round | None) -> None:
    """Sets ``cur.layer`` and ``cur.fresh`` from the agents of the round before it."""
    new = set(cur.joins) - set(prev.joins) if prev is not None else set(cur.joins)
    cur.fresh = new == set(cur.joins)
    cur.layer = None if prev is None else POD if new else IN_JOB


@dataclass(frozen=True)
class Budget:
    """The job's in-job restarts against ``resilience.max_restarts``.

    Attributes:
        used: In-job restarts since the job (re)started, the current round included.
        most: ``resilience.max_restarts``.
    """

    used: int
    most: int

    @property
    def spent(self) -> bool:
        """This restart is one more than the budget allows."""
        return self.used > self.most

    def line(self) -> str:
        """The verdict rank 0 prints when the budget is spent (starts with BUDGET_SPENT)."""
        return (f"{BUDGET_SPENT}: restart {self.used} of the job (all nodes together) is more "
                f"than resilience.max_restarts={self.most} allows; the newest committed "
                "checkpoint is kept (launch again to resume)")


def budget(history: list[Round], most: int) -> Budget:
    """The restart budget at the newest round of ``history`` (it is the current one).

    In-job restarts count since the newest fresh round (every agent new: a launch, a relaunch
    or a JobSet restart, which the runtime's ``failurePolicy.maxRestarts`` bounds); a pod round
    (some agents new: a recreated PyTorchJob pod, a node that joined) does not count, and the
    count goes on across it.
    """
    used = 0
    for r in reversed(history):
        if r.fresh:
            break
        used += r.layer == IN_JOB
    return Budget(used=used, most=most)


def might_spend(history: list[Round], most: int) -> bool:
    """Whether the current (newest) round could spend the budget, before it is complete.

    Only such a round needs every node's join to be read before judging it: for any other, the
    count stays within the budget whatever the missing nodes turn out to be.
    """
    if not history:
        return False
    if len(history) == 1:
        return False  # nothing before it: the job's first round
    cur = history[-1]
    classify(cur, history[-2])
    if cur.fresh:  # the agents seen so far are all new: it is no in-job restart, yet
        return False
    saved = cur.layer
    cur.layer = IN_JOB  # at worst the missing nodes bring no new agent
    try:
        return budget(history, most).spent
    finally:
        cur.layer = saved


def start_layers(events: list[Event]) -> dict[int, str | None]:
    """The restart layer of each incarnation's first ``start`` (by ``id``), from the joins.

    A start is linked to its round through rank 0's process id; starts without a round (runs
    written before joins existed, in-process re-entries) are not in the map. Rank 0's agent is
    part of the link: a pid repeats in every pod (the worker is pid 20 in each).
    """
    by_rank0: dict[tuple[str | None, int | None], Round] = {}
    for r in rounds(events):
        key = r.rank0()
        if key is not None:
            by_rank0[key] = r
    out: dict[int, str | None] = {}
    for e in events:
        if isinstance(e, Start) and not e.iteration and (e.agent, e.pid) in by_rank0:
            out[id(e)] = by_rank0.pop((e.agent, e.pid)).layer
    return out


def current_budget(run_dir: str | os.PathLike[str], mine: Join, most: int, wait_s: float,
                   poll_s: float = 0.2) -> Budget:
    """The budget at the round ``mine`` (rank 0's join, already written) belongs to.

    When this round could spend the budget, the other nodes' joins decide whether it is an
    in-job restart at all (a node whose agent is new makes it a pod restart): they are waited
    for, up to ``wait_s`` (they are written before any process group exists, so they come
    within the nodes' start-up spread); nodes still missing then count as no new agent.
    """
    from kfp_nvrx.components.core.events import read_events

    deadline = time.monotonic() + wait_s
    while True:
        history = rounds(read_events(run_dir))
        at = next((i for i, r in enumerate(history) if (j := r.joins.get(mine.agent)) is not None
                   and j.pid == mine.pid), None)
        if at is None:  # our own join is not readable: nothing to judge (ft_launcher's count is)
            return Budget(used=0, most=most)
        history = history[:at + 1]
        if history[-1].complete or not might_spend(history, most) \
                or time.monotonic() >= deadline:
            return budget(history, most)
        time.sleep(poll_s)
