"""The events' schema: one typed class per kind of line, and what each field holds.

See :mod:`kfp_nvrx.components.core.events` for the format and who writes and reads each kind.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

#: The layers a restart can be of, in the order reports list them: ft_launcher restarted the
#: workers inside their pods (``in-job``), the wrapper re-entered the training function in the
#: same processes (``in-process``), the pods were recreated (``pod``: a JobSet restart, a fresh
#: ft_launcher).
IN_JOB, IN_PROCESS, POD = "in-job", "in-process", "pod"
RESTART_LAYERS = (IN_JOB, IN_PROCESS, POD)

#: What a field holds, for the checks of a line read back (see :func:`.read.parse_event`).
COUNT, TIME, NUMBER, LOSS, TEXT, ANY = "count", "time", "number", "loss", "text", "any"
#: Unix times up to 2100-01-01: a time of -1e18 or 1e300 is damage, not a run.
LATEST = 4_102_444_800.0


def _f(kind: str, default: Any = dataclasses.MISSING, *, null: bool = False) -> Any:
    """A field of ``kind``, required in a line read back when it has no default.

    ``null``: written as ``null`` when None (the format always had it).
    """
    meta = {"kind": kind, "null": null, "required": default is dataclasses.MISSING}
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class Event:
    """What every event has: its ``type`` (the class) and ``time`` (Unix seconds)."""

    TYPE: ClassVar[str] = ""
    #: Now, unless given (a start carries the time its incarnation began); required when read.
    time: float = field(default_factory=time.time,
                        metadata={"kind": TIME, "null": False, "required": True})
    #: Fields of the line this version does not name (a newer writer's); kept, never written.
    unnamed: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def when(self) -> float:
        """When it happened, for time order: a step's start, any other event's time."""
        return self.time

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the line (``type`` and ``time`` first, Nones left out; see above)."""
        out: dict[str, Any] = {"type": self.TYPE}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "unnamed" and (value is not None or f.metadata.get("null")):
                out[f.name] = value
        return out


@dataclass(frozen=True, kw_only=True)
class Start(Event):
    """An incarnation began: the process group is up and the newest checkpoint is loaded.

    Attributes:
        incarnation: ft_launcher restarts so far (job-wide, as rank 0 counted them).
        iteration: In-process re-entries of the training function in this process.
        world_size: Ranks of the incarnation.
        resumed_from: Step of the checkpoint it resumed from (None: from scratch).
        load_s: Seconds the load took.
        from_memory: The state came from the host copy, not the volume.
        sources: Where each rank's state came from, by rank: ``memory`` (its node's host copy),
            ``peer`` (a copy another node held: the node was lost) or ``volume``.
        peer_bytes: Bytes the ranks fetched from peers for this start.
        pid: Rank 0's process id (the same across in-process restarts).
        run_id: The rendezvous id: new per launcher invocation (a session, see goodput).
        agent: Which ft_launcher started the rank (host/pid...): another agent means new pods.
        layer: One of :data:`RESTART_LAYERS` when this start is a restart's, else None.
        boot: Seconds of each part of the start (see the trainer's boot record).
    """

    TYPE: ClassVar[str] = "start"
    incarnation: int = _f(COUNT, 0)
    iteration: int = _f(COUNT, 0)
    world_size: int | None = _f(COUNT, None)
    resumed_from: int | None = _f(COUNT, None, null=True)
    load_s: float | None = _f(NUMBER, None)
    from_memory: bool | None = _f(ANY, None)
    sources: list[str] | None = _f(ANY, None)
    peer_bytes: int | None = _f(COUNT, None)
    pid: int | None = _f(ANY, None)
    run_id: str | None = _f(ANY, None)
    agent: str | None = _f(ANY, None)
    layer: str | None = _f(ANY, None)
    boot: dict[str, Any] | None = _f(ANY, None)


@dataclass(frozen=True, kw_only=True)
class Step(Event):
    """One training step of an incarnation, ``start`` to ``end`` (Unix seconds)."""

    TYPE: ClassVar[str] = "step"
    step: int = _f(COUNT)
    start: float = _f(TIME)
    end: float = _f(TIME)
    incarnation: int = _f(COUNT, 0)
    iteration: int = _f(COUNT, 0)
    #: None when it was not finite (a diverged loss is written as ``null``: NaN is no JSON).
    loss: float | None = _f(LOSS, None, null=True)
    tokens: int | None = _f(NUMBER, None)
    #: Seconds of each part of the step, with ``train.step_parts`` (the trainer's StepParts).
    parts: dict[str, float] | None = _f(ANY, None)

    @property
    def when(self) -> float:
        """A step happened when it started."""
        return self.start

    @property
    def seconds(self) -> float:
        """How long the step took."""
        return self.end - self.start


@dataclass(frozen=True, kw_only=True)
class Checkpoint(Event):
    """A save of ``step`` committed: ``blocking_s`` stalled training, ``total_s`` in all."""

    TYPE: ClassVar[str] = "checkpoint"
    step: int = _f(COUNT)
    blocking_s: float = _f(NUMBER, 0.0)
    total_s: float | None = _f(NUMBER, None)
    bytes: int | None = _f(NUMBER, None)


@dataclass(frozen=True, kw_only=True)
class Snapshot(Event):
    """A host snapshot of ``step``: ``stall_s`` held training, every wait it caused included.

    ``skipped`` says why no snapshot was taken (empty when one was); its ``stall_s`` is what the
    attempt cost. The durable write behind it ends in a :class:`Checkpoint`.
    """

    TYPE: ClassVar[str] = "snapshot"
    step: int = _f(COUNT)
    stall_s: float = _f(NUMBER, 0.0)
    skipped: str = _f(TEXT, "")


@dataclass(frozen=True, kw_only=True)
class Replica(Event):
    """A round of peer copies of the snapshot of ``step`` ended (``ok``: every copy is held).

    ``seconds`` from its start to rank 0's part ending; ``bytes`` each rank sent; ``loop_s`` the
    seconds its collectives (starting it, learning it ended) held the training loop.
    """

    TYPE: ClassVar[str] = "replica"
    step: int = _f(COUNT)
    seconds: float = _f(NUMBER, 0.0)
    bytes: int = _f(COUNT, 0)
    ok: bool = _f(ANY, True)
    loop_s: float = _f(NUMBER, 0.0)


@dataclass(frozen=True, kw_only=True)
class Fault(Event):
    """An injected fault of ``kind`` fired at ``step`` on ``rank`` (-1 or None: no one rank)."""

    TYPE: ClassVar[str] = "fault"
    kind: str = _f(TEXT)
    step: int = _f(COUNT, 0)
    rank: int | None = _f(COUNT, None, null=True)


@dataclass(frozen=True, kw_only=True)
class Restart(Event):
    """A restart of layer ``kind`` (one of :data:`RESTART_LAYERS`) began this incarnation."""

    TYPE: ClassVar[str] = "restart"
    kind: str = _f(TEXT)
    incarnation: int = _f(COUNT, 0)
    iteration: int = _f(COUNT, 0)


@dataclass(frozen=True, kw_only=True)
class Join(Event):
    """A node's agent started the workers of a rendezvous round (one line per node per round).

    Written by each node's first worker (``LOCAL_RANK`` 0) before its process group exists, so
    a round whose workers never trained is on record too. :mod:`.rounds` reads them: which
    layer restarted (a new agent on any node: the pods were recreated) and the job-wide
    restart budget.

    Attributes:
        agent: The agent that started the node's workers (see :func:`.rounds.agent_identity`).
        node: The node's group rank in this round.
        nodes: Nodes in this round (``GROUP_WORLD_SIZE``).
        rank: Global rank of the worker that wrote it.
        pid: Its process id (rank 0's is the ``pid`` of the round's :class:`Start`).
        run_id: The rendezvous id.
        endpoint: ``MASTER_ADDR:MASTER_PORT`` the round's workers were given.
    """

    TYPE: ClassVar[str] = "join"
    agent: str = _f(TEXT)
    node: int = _f(COUNT, 0)
    nodes: int = _f(COUNT, 1)
    rank: int = _f(COUNT, 0)
    pid: int | None = _f(ANY, None)
    run_id: str | None = _f(ANY, None)
    endpoint: str | None = _f(ANY, None)


@dataclass(frozen=True, kw_only=True)
class Queued(Event):
    """A wait in a queue (Kueue held the job), ``start`` to ``end``, as its launcher saw it.

    The pods cannot see the queue: the launcher writes one line per wait once the wait has
    ended, where the run dir is on its machine (``time``: when it wrote it). ``after`` says what
    began it: ``creation`` (before the first admission) or ``preemption`` (the job had run).
    Goodput keeps the wait out of the wall time and a re-admission out of the restarts.
    """

    TYPE: ClassVar[str] = "queued"
    start: float = _f(TIME)
    end: float = _f(TIME)
    after: str = _f(TEXT, "creation")
    reason: str = _f(TEXT, "")


#: The status of an ``end`` written when a node was asked to stop (preemption, drain, delete).
STOPPED = "stopped"


@dataclass(frozen=True, kw_only=True)
class End(Event):
    """The run ended with ``status`` (``completed``) after ``step``."""

    TYPE: ClassVar[str] = "end"
    step: int | None = _f(COUNT, None)
    status: str = _f(ANY, "")

    @property
    def completed(self) -> bool:
        """The training loop ran to its last step."""
        return self.status == "completed"

    @property
    def closes_session(self) -> bool:
        """Whether the run ended here.

        Not when a node was stopped mid-run (``stopped``): it saved, and the job goes on,
        restarted or re-admitted, in the same launch.
        """
        return self.status != STOPPED


@dataclass(frozen=True, kw_only=True)
class Other(Event):
    """A line of a type this version does not know (a newer writer's): read, used by no one."""

    type: str = _f(TEXT)

    def to_dict(self) -> dict[str, Any]:
        """The line as it was read."""
        return {"type": self.type, "time": self.time, **self.unnamed}


#: Every event class by its ``type``.
TYPES: dict[str, type[Event]] = {c.TYPE: c for c in (Start, Step, Checkpoint, Snapshot, Replica, Fault,
                                                     Restart, Join, End, Queued)}
