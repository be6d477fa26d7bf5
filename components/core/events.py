"""Run events: one JSON object per line in ``<run_dir>/events.jsonl``, one typed class per kind.

The classes below are the one place that knows the events' field names: the trainer and the drills
write them (:class:`EventLog`), goodput, the timeline, the launchers' results and the drills read
them (:func:`read_events`). Every line has ``type`` and ``time`` (Unix seconds); the rest is:

- :class:`Start`: an incarnation began (``layer`` names the restart when it is one);
- :class:`Step`: one training step (``start`` .. ``end``);
- :class:`Checkpoint`: a save committed (``blocking_s`` stalled training);
- :class:`Fault`: an injected fault fired (written by the faulting rank, or by a drill);
- :class:`Restart`: a restart of one of :data:`RESTART_LAYERS`;
- :class:`Join`: a node's agent started the workers of a rendezvous round (:mod:`.rounds`);
- :class:`End`: the run completed.

Rank 0 writes everything except :class:`Fault` and :class:`Join` (each node's first worker).
The on-disk form is unchanged from the dicts the trainer used to write: a field that is None is
left out unless it has always been written as ``null`` (``resumed_from``, ``loss``, ``rank``),
so files of older runs read, and older readers read ours. A line of a type this version does
not know reads as :class:`Other`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from kfp_nvrx.components.core.bounded import EVENT_LINE_LIMIT, EVENTS_LIMIT, iter_lines
from kfp_nvrx.components.core.rundir import EVENTS_FILE

#: The layers a restart can be of, in the order reports list them: ft_launcher restarted the
#: workers inside their pods (``in-job``), the wrapper re-entered the training function in the
#: same processes (``in-process``), the pods were recreated (``pod``: a JobSet restart, a fresh
#: ft_launcher).
IN_JOB, IN_PROCESS, POD = "in-job", "in-process", "pod"
RESTART_LAYERS = (IN_JOB, IN_PROCESS, POD)

#: What a field holds, for the checks of a line read back (see :func:`_check`).
_COUNT, _TIME, _NUMBER, _LOSS, _TEXT, _ANY = "count", "time", "number", "loss", "text", "any"
#: Unix times up to 2100-01-01: a time of -1e18 or 1e300 is damage, not a run.
_LATEST = 4_102_444_800.0
#: Seconds an event may lie before the latest one read so far without being reported out of order
#: (ranks write their own lines, a moment apart). A start carries the time its incarnation began,
#: before the lines its set-up wrote: it is exempt.
_ORDER_SLACK_S = 1.0


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
                        metadata={"kind": _TIME, "null": False, "required": True})
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
        pid: Rank 0's process id (the same across in-process restarts).
        run_id: The rendezvous id: new per launcher invocation (a session, see goodput).
        agent: Which ft_launcher started the rank (host/pid...): another agent means new pods.
        layer: One of :data:`RESTART_LAYERS` when this start is a restart's, else None.
        boot: Seconds of each part of the start (see the trainer's boot record).
    """

    TYPE: ClassVar[str] = "start"
    incarnation: int = _f(_COUNT, 0)
    iteration: int = _f(_COUNT, 0)
    world_size: int | None = _f(_COUNT, None)
    resumed_from: int | None = _f(_COUNT, None, null=True)
    load_s: float | None = _f(_NUMBER, None)
    from_memory: bool | None = _f(_ANY, None)
    pid: int | None = _f(_ANY, None)
    run_id: str | None = _f(_ANY, None)
    agent: str | None = _f(_ANY, None)
    layer: str | None = _f(_ANY, None)
    boot: dict[str, Any] | None = _f(_ANY, None)


@dataclass(frozen=True, kw_only=True)
class Step(Event):
    """One training step of an incarnation, ``start`` to ``end`` (Unix seconds)."""

    TYPE: ClassVar[str] = "step"
    step: int = _f(_COUNT)
    start: float = _f(_TIME)
    end: float = _f(_TIME)
    incarnation: int = _f(_COUNT, 0)
    iteration: int = _f(_COUNT, 0)
    #: None when it was not finite (a diverged loss is written as ``null``: NaN is no JSON).
    loss: float | None = _f(_LOSS, None, null=True)
    tokens: int | None = _f(_NUMBER, None)

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
    step: int = _f(_COUNT)
    blocking_s: float = _f(_NUMBER, 0.0)
    total_s: float | None = _f(_NUMBER, None)
    bytes: int | None = _f(_NUMBER, None)


@dataclass(frozen=True, kw_only=True)
class Fault(Event):
    """An injected fault of ``kind`` fired at ``step`` on ``rank`` (-1 or None: no one rank)."""

    TYPE: ClassVar[str] = "fault"
    kind: str = _f(_TEXT)
    step: int = _f(_COUNT, 0)
    rank: int | None = _f(_COUNT, None, null=True)


@dataclass(frozen=True, kw_only=True)
class Restart(Event):
    """A restart of layer ``kind`` (one of :data:`RESTART_LAYERS`) began this incarnation."""

    TYPE: ClassVar[str] = "restart"
    kind: str = _f(_TEXT)
    incarnation: int = _f(_COUNT, 0)
    iteration: int = _f(_COUNT, 0)


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
    agent: str = _f(_TEXT)
    node: int = _f(_COUNT, 0)
    nodes: int = _f(_COUNT, 1)
    rank: int = _f(_COUNT, 0)
    pid: int | None = _f(_ANY, None)
    run_id: str | None = _f(_ANY, None)
    endpoint: str | None = _f(_ANY, None)


#: The status of an ``end`` written when a node was asked to stop (preemption, drain, delete).
STOPPED = "stopped"


@dataclass(frozen=True, kw_only=True)
class End(Event):
    """The run ended with ``status`` (``completed``) after ``step``."""

    TYPE: ClassVar[str] = "end"
    step: int | None = _f(_COUNT, None)
    status: str = _f(_ANY, "")

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

    type: str = _f(_TEXT)

    def to_dict(self) -> dict[str, Any]:
        """The line as it was read."""
        return {"type": self.type, "time": self.time, **self.unnamed}


#: Every event class by its ``type``.
TYPES: dict[str, type[Event]] = {c.TYPE: c for c in (Start, Step, Checkpoint, Fault, Restart,
                                                     Join, End)}


_E = TypeVar("_E", bound=Event)


class EventLog:
    """Appends events; each line is written with one ``write`` call on an O_APPEND file.

    The file is opened with ``O_NOFOLLOW``: an ``events.jsonl`` that is a symbolic link (out of
    the run dir) is never written through. Numbers that are not finite (a diverged loss) are
    written as ``null``: ``NaN`` is no JSON, and every reader after us would choke on it.
    """

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.enabled = enabled

    def emit(self, event: _E) -> _E:
        """Writes one event (when enabled) and returns it."""
        if self.enabled:
            line = (json.dumps(_finite(event.to_dict()), separators=(",", ":")) + "\n").encode()
            # O_NONBLOCK: a FIFO without a reader in its place fails the open (ENXIO) instead of
            # blocking the rank forever; a FIFO with one, a device or a socket is refused below.
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(self.path, flags, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EEXIST, "not a regular file; events go only to a file",
                                  str(self.path))
                os.write(fd, line)
            finally:
                os.close(fd)
        return event


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (nested dicts and lists too)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(name: str, kind: str, value: Any) -> str | None:
    """What is wrong with ``value`` of a field of ``kind``, or None."""
    if kind == _TEXT:
        return None if isinstance(value, str) else f"no {name}"
    if kind == _ANY:
        return None
    if not _is_number(value):
        return f"{name} is {type(value).__name__} {str(value)[:40]!r}, not a number"
    if not math.isfinite(value):
        # A diverged loss is a fact of the run (read as None); anything else is damage.
        return None if kind == _LOSS else f"{name} is {value}, not a finite number"
    if kind == _TIME and not 0 <= value <= _LATEST:
        return f"{name} {value:g} is no time of a run (Unix seconds up to 2100)"
    if kind == _COUNT and (value != int(value) or not -1 <= value <= 2**31 - 1):
        # -1 is "no rank" (a drill's fault).
        return f"{name} {value:g} is no count of a run (a whole number below 2^31)"
    return None


def parse_event(obj: Any) -> Event:
    """The typed event of one decoded line.

    Raises:
        ValueError: What makes the line unusable for the readers (goodput, timeline): no type or
            time, a required field missing, a string or a time no run has where a number belongs.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an event object")
    if not isinstance(obj.get("type"), str):
        raise ValueError("no event type")
    cls = TYPES.get(obj["type"], Other)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "unnamed":
            continue
        value = obj.get(f.name)
        if value is None:
            if f.metadata["required"]:
                raise ValueError(f"no {f.name}")
            continue  # absent or null: the field's default
        problem = _check(f.name, f.metadata["kind"], value)
        if problem:
            raise ValueError(problem)
        if f.metadata["kind"] == _LOSS and not math.isfinite(value):
            value = None
        values[f.name] = value
    event = cls(**values, unnamed={k: v for k, v in obj.items() if k not in values
                                   and k not in ("type", "time") and not hasattr(cls, k)})
    if isinstance(event, Step) and event.end < event.start:
        raise ValueError("step ends before it starts")
    return event


def in_time_order(events: Iterable[Event],
                  disorder: Callable[[int, Event, float], None] | None = None) -> list[Event]:
    """``events`` in the order they happened (stable), each one out of order reported.

    Args:
        events: Events in the order they were written.
        disorder: Called with (index, event, seconds it lies before an earlier one).
    """
    out, latest, disordered = list(events), -math.inf, False
    for i, event in enumerate(out):
        if not isinstance(event, Start) and event.when < latest - _ORDER_SLACK_S:
            disordered = True
            if disorder is not None:
                disorder(i, event, latest - event.when)
        latest = max(latest, event.when)
    if disordered:
        out.sort(key=lambda e: e.when)
    return out


def parse_events(objs: Iterable[Mapping[str, Any]]) -> list[Event]:
    """Typed events, in time order, of decoded lines held in memory (tests, summaries).

    Raises:
        ValueError: One of them is no usable event (see :func:`parse_event`).
    """
    return in_time_order(parse_event(dict(obj)) for obj in objs)


def read_events(run_dir: str | os.PathLike,
                warn: Callable[[str], None] | None = None) -> list[Event]:
    """All well-formed events of a run, in time order.

    Read line by line with a cap per line and in all (:mod:`.bounded`); no file is no events,
    anything but a regular file (a FIFO, a device, a folder) is refused. A line that is not a
    usable event (torn by a killed writer, edited, damaged, not UTF-8, NaN or a string where a
    number belongs, a time no run has) is skipped with one ``warn`` line naming it; a line out of
    time order is reported and put in its place (stable sort by when each event happened).
    """
    path = Path(run_dir) / EVENTS_FILE
    if not os.path.lexists(path):
        return []
    say = warn or (lambda _msg: None)
    events: list[Event] = []
    lines: list[int] = []
    # A FIFO, device or folder in its place is refused by iter_lines (UserError naming run_dir),
    # never waited on: "no events" would hide a run dir someone tampered with.
    for lineno, raw in enumerate(iter_lines(path, "run_dir", EVENT_LINE_LIMIT, EVENTS_LIMIT),
                                 start=1):
        if raw is not None and not raw.strip():
            continue
        try:
            if raw is None:
                raise ValueError(f"longer than {EVENT_LINE_LIMIT >> 10} KiB")
            try:
                obj = json.loads(raw.decode("utf-8", errors="strict"))
            except (ValueError, RecursionError) as err:
                raise ValueError(f"not JSON ({' '.join(str(err).split())[:80]})") from None
            events.append(parse_event(obj))
            lines.append(lineno)
        except ValueError as err:
            say(f"{path} line {lineno}: {err}; skipped")

    def disorder(i: int, event: Event, early: float) -> None:
        say(f"{path} line {lines[i]}: {event.to_dict()['type']} at {event.when:.3f} is "
            f"{early:.1f} s before an earlier line; taken in time order")

    return in_time_order(events, disorder)
