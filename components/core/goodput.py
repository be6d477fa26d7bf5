"""Goodput and recovery figures computed from ``events.jsonl``.

Definitions:
- *kept* steps are the last execution of each step number (an earlier execution of the same step
  was rolled back by a restart and is *redone* work);
- a *session* is one invocation of the launcher: it ends with an ``end`` event, and a ``start``
  event of another ``run_id`` (the rendezvous id, new per launcher) begins the next one. The idle
  time between two sessions of a resumed run is nobody's lost work: it is not counted;
- wall time = the sum over sessions of first event to last event;
- goodput = time inside kept steps / wall time;
- lost work = time inside redone steps;
- recovery = fault (or the last step before a restart) -> first step of the next incarnation,
  the time a queue held the job not counted;
- queued = the waits in a queue (Kueue) inside the run, from the launcher (:mod:`.queue_waits`):
  not wall time; a re-admission after a preemption is no restart and its window no recovery
  (``preemptions``; ``resume_s``: from the stop to the first step after it, queue not counted);
- restarts by layer: in-process from the trainer's ``restart`` events; in-job and pod from the
  rendezvous rounds each node's ``join`` records (:mod:`.rounds`: a new agent on any node is a
  pod restart, which rank 0's own ``restart`` event cannot see), counting rounds whose workers
  failed before training too; runs written before joins existed count their ``restart`` events;
- checkpoint stall = the seconds every snapshot held training (each wait it caused included) plus
  the blocking seconds of every durable write started between snapshots;
- what happened = one sentence per restart: the fault (or failure), where training resumed, how
  long recovery took and how many steps were redone (:func:`narrate`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kfp_nvrx.components.core.events import (
    POD,
    RESTART_LAYERS,
    Checkpoint,
    End,
    Event,
    Fault,
    Join,
    Queued,
    Replica,
    Snapshot,
    Start,
    Step,
    read_events,
)
from kfp_nvrx.components.core.faults import fault_verb
from kfp_nvrx.components.core.queue_waits import (
    Wait,
    held,
    readmissions,
    readmitted_between,
    waits_of,
)
from kfp_nvrx.components.core.restart_counts import restart_counts
from kfp_nvrx.components.core.rounds import start_layers
from kfp_nvrx.components.core.sources import source_words


@dataclass
class GoodputReport:
    """Summary of one run."""

    wall_s: float = 0.0
    productive_s: float = 0.0
    goodput: float = 0.0
    steps_final: int = 0
    steps_run: int = 0
    steps_redone: int = 0
    lost_work_s: float = 0.0
    restarts: dict[str, int] = field(default_factory=dict)
    recovery_s: list[float] = field(default_factory=list)
    recovery_mean_s: float = 0.0
    recovery_max_s: float = 0.0
    checkpoint_stall_s: float = 0.0
    checkpoints: int = 0
    snapshots: int = 0
    snapshots_skipped: int = 0
    snapshot_stall_s: float = 0.0
    snapshot_stall_max_s: float = 0.0
    final_loss: float | None = None
    faults: int = 0
    what_happened: list[str] = field(default_factory=list)
    #: Seconds a queue (Kueue) held the job while the run's wall clock ran, not counted in
    #: ``wall_s``, lost work or recovery; and those waits as [start, end] (the timeline).
    queued_s: float = 0.0
    queued: list[list[float]] = field(default_factory=list)
    #: Times the job was admitted again after a preemption (each a resume, not a restart), and
    #: the seconds from each stop to the first step after it, its time queued not counted.
    preemptions: int = 0
    resume_s: list[float] = field(default_factory=list)
    #: Where each restart's state came from: ``memory`` (every rank's own node), ``peer`` (some
    #: ranks fetched copies other nodes held: a lost node), ``volume`` (the store); and the bytes
    #: the peer restores moved over the network.
    restores: dict[str, int] = field(default_factory=dict)
    peer_restore_bytes: int = 0
    #: Rounds of peer copies that every rank's peers hold, and the seconds their collectives held
    #: the training loop (also in ``checkpoint_stall_s``).
    peer_copies: int = 0
    peer_copy_stall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return asdict(self)

    def restarts_of(self, layer: str) -> int:
        """Restarts of one of :data:`~.events.RESTART_LAYERS` (0 when there was none)."""
        return self.restarts.get(layer, 0)


def _count_restores(rep: GoodputReport, events: Sequence[Event]) -> None:
    """Where each restart's state came from (its ``start``), and the bytes fetched from peers."""
    for e in events:
        if not isinstance(e, Start) or e.layer is None or e.resumed_from is None:
            continue
        sources = e.sources or (["memory"] if e.from_memory else ["volume"])
        tier = "peer" if "peer" in sources else "memory" if "volume" not in sources else "volume"
        rep.restores[tier] = rep.restores.get(tier, 0) + 1
        rep.peer_restore_bytes += int(e.peer_bytes or 0)


def _count_saves(rep: GoodputReport, events: Sequence[Event]) -> None:
    """The snapshots, durable writes, peer copies and every second they held training."""
    for event in events:
        if isinstance(event, Checkpoint):
            rep.checkpoints += 1
            rep.checkpoint_stall_s += float(event.blocking_s)
        elif isinstance(event, Snapshot):
            stall = float(event.stall_s)
            rep.snapshots += 0 if event.skipped else 1
            rep.snapshots_skipped += 1 if event.skipped else 0
            rep.snapshot_stall_s += stall
            rep.snapshot_stall_max_s = max(rep.snapshot_stall_max_s, stall)
            rep.checkpoint_stall_s += stall
        elif isinstance(event, Replica):
            rep.peer_copies += 1 if event.ok else 0
            rep.peer_copy_stall_s += float(event.loop_s)
            rep.checkpoint_stall_s += float(event.loop_s)


def restarts_in_words(total: int, by_layer: Mapping[str, int]) -> str:
    """``3 (in-job 2, in-process 0, pod 1)``: the total and every layer's restarts, even none."""
    layers = ", ".join(f"{layer} {int(by_layer.get(layer, 0))}" for layer in RESTART_LAYERS)
    return f"{int(total)} ({layers})"


def _incarnation(ev: Start | Step) -> tuple[int, int]:
    return int(ev.incarnation), int(ev.iteration)


def sessions(events: list[Event]) -> list[int]:
    """The session (launcher invocation) of each event, 0, 1, ... (see the module docstring)."""
    out: list[int] = []
    index, run_id, ended = 0, None, False
    for e in events:
        rid = (e.run_id or None) if isinstance(e, (Start, Join)) else None
        if out and (ended or (rid is not None and run_id is not None and rid != run_id)):
            index, run_id, ended = index + 1, None, False
        if rid is not None:
            run_id = rid
        ended = ended or (isinstance(e, End) and e.closes_session)
        out.append(index)
    return out


def _wall(events: list[Event], sess: list[int]) -> float:
    """Sum over sessions of first event (a step's start) to last event (a step's end)."""
    spans: dict[int, list[float]] = {}
    for e, k in zip(events, sess, strict=True):
        lo, hi = e.when, max(e.time, e.end if isinstance(e, Step) else e.time)
        span = spans.setdefault(k, [lo, hi])
        span[0], span[1] = min(span[0], lo, e.time), max(span[1], hi)
    return sum(hi - lo for lo, hi in spans.values())


def kept_steps(events: list[Event]) -> list[tuple[Step, bool]]:
    """Each step event with True when it was kept: the last execution of its step number."""
    steps = [e for e in events if isinstance(e, Step)]
    last = {e.step: i for i, e in enumerate(steps)}
    return [(e, last[e.step] == i) for i, e in enumerate(steps)]


def training(events: Sequence[Event]) -> list[Event]:
    """The events the pods wrote: the launcher's :class:`~.events.Queued` lines are its own.

    A wait's line is written when the launcher learns of it, maybe after the run ended: it
    must neither stretch a session's wall time nor begin a session of its own.
    """
    return [e for e in events if not isinstance(e, Queued)]


def summarize_events(events: list[Event], queued: Sequence[Wait] = ()) -> GoodputReport:
    """Computes the report from typed events in time order (:func:`.events.read_events`).

    Args:
        events: The run's events (its :class:`~.events.Queued` lines included).
        queued: ``(start, end)`` of waits in a queue (Kueue holding the job, before its first
            admission and after each preemption) as a launcher saw them, besides the run's
            own record of them (:mod:`.queue_waits`): kept apart from the wall time the
            goodput is taken over, from lost work and from recovery.
    """
    rep = GoodputReport()
    waits, events = waits_of(events, queued), training(events)
    if not events:
        return rep
    sess = sessions(events)
    admitted = readmissions(events, waits)
    lo, hi = min(e.when for e in events), max(e.time for e in events)
    rep.queued = [[a, b] for a, b in waits]
    rep.queued_s = round(held(lo, hi, waits), 3)
    rep.wall_s = max(0.0, _wall(events, sess) - rep.queued_s)
    final: Step | None = None
    for e, kept in kept_steps(events):
        rep.steps_run += 1
        if kept:
            rep.productive_s += e.seconds
            final = e if final is None or e.step > final.step else final
        else:
            rep.lost_work_s += e.seconds
            rep.steps_redone += 1
    rep.goodput = rep.productive_s / rep.wall_s if rep.wall_s > 0 else 0.0
    if final is not None:
        rep.steps_final, rep.final_loss = final.step, final.loss
    rep.restarts = restart_counts(events, sess, admitted)
    rep.preemptions = len(admitted)
    _count_saves(rep, events)
    _count_restores(rep, events)
    rep.faults = sum(1 for e in events if isinstance(e, Fault))
    windows = _windows(events, sess)
    rep.recovery_s, rep.resume_s = (
        [round(end - origin - held(origin, end, waits), 3) for origin, end in windows
         if readmitted_between(origin, end, admitted) == resumed] for resumed in (False, True))
    if rep.recovery_s:
        rep.recovery_mean_s = sum(rep.recovery_s) / len(rep.recovery_s)
        rep.recovery_max_s = max(rep.recovery_s)
    rep.what_happened = narrate(events, sess, waits)
    if rep.queued_s:
        rep.what_happened.append(f"held {rep.queued_s:.0f} s in the queue ({len(rep.queued)} "
                                 "wait(s)), kept out of the wall time and the recovery")
    return rep


def narrate(events: list[Event], sess: list[int] | None = None,
            waits: Sequence[Wait] = ()) -> list[str]:
    """Return one sentence per restart (and per relaunch or re-admission of the run).

    E.g. "rank 1 killed at step 20, resumed from step 10 in 4.1 s, 9 steps redone": redone counts
    the stopped incarnation's executions past the resumed step (as ``steps_redone`` does),
    recovery runs from the fault (or the last step) to the next incarnation's first step. A new
    session reads "relaunched, resumed from step 10, 2 steps redone": the time between two
    launcher invocations is no recovery. A re-admission after a preemption (``waits``, see
    :mod:`.queue_waits`) reads "preempted at step 58, resumed from step 58 in 9.6 s after 53 s
    queued, 0 steps redone": the time queued is not in the seconds.
    """
    sess = sessions(events) if sess is None else sess
    layers, admitted = start_layers(events), readmissions(events, waits)
    out: list[str] = []
    fault: Fault | None = None
    current: tuple[int, int, int] | None = None
    done: list[int] = []  # steps the current incarnation executed
    last_end: float | None = None
    stopped: int | None = None  # the step its node's stop ended the current incarnation at
    pending: dict[str, Any] | None = None  # a restart waiting for its first step (recovery)
    for e, k in zip(events, sess, strict=True):
        if isinstance(e, Fault) and fault is None:
            fault = e
        elif isinstance(e, End) and not e.closes_session:
            stopped = e.step
        elif isinstance(e, Start):
            inc = (k, *_incarnation(e))
            relaunch = current is not None and k != current[0]
            if current is not None and inc != current:
                # the restart's layer as the rounds tell it, else as rank 0 logged it
                what = _cause(relaunch, fault, layers.get(id(e), e.layer), done,
                              _preempted_at(last_end, e.time, admitted, stopped, done))
                where, redone = _resumed(e, done)
                origin = None if relaunch else fault.time if fault is not None else last_end
                pending = {"text": f"{what}, {where}", "origin": origin, "redone": redone}
                fault, done, stopped = None, [], None
            current = inc
        elif isinstance(e, Step):
            if current is None or (k, *_incarnation(e)) != current:  # a log without starts
                current, done = (k, *_incarnation(e)), []
            if pending is not None:
                out.append(f"{pending['text']}{_took(pending['origin'], e.end, waits)}, "
                           f"{pending['redone']}")
                pending = None
            done.append(int(e.step))
            last_end = e.end
    if pending is not None:
        out.append(f"{pending['text']}, {pending['redone']}")
    return out


def _took(origin: float | None, end: float, waits: Sequence[Wait]) -> str:
    """" in 4.1 s" from ``origin`` to ``end``, " ... after 53 s queued" when a queue held it."""
    if origin is None:
        return ""
    queued = held(origin, end, waits)
    return f" in {end - origin - queued:.1f} s" + (f" after {queued:.0f} s queued" if queued else "")


def _preempted_at(last_end: float | None, start: float, admitted: Sequence[float],
                  stopped: int | None, done: list[int]) -> int | None:
    """Where a preemption stopped the incarnation before ``start`` (None: not preempted).

    It was when the job was admitted again after its last step; the step its stop said, if any.
    """
    if last_end is None or not readmitted_between(last_end, start, admitted):
        return None
    return max(done, default=0) if stopped is None else stopped


def _cause(relaunch: bool, fault: Fault | None, layer: str | None, done: list[int],
           preempted: int | None = None) -> str:
    """What ended the incarnation that a restart follows (the start of its sentence)."""
    if preempted is not None:
        return f"preempted at step {preempted}"
    if relaunch:
        return "relaunched"
    if fault is not None:
        rank = f"rank {fault.rank}" if fault.rank is not None else "a rank"
        return f"{rank} {fault_verb(fault.kind)} at step {fault.step}"
    if layer == POD:
        return f"pods recreated after step {max(done, default=0)}"
    return f"workers failed after step {max(done, default=0)}"


def _resumed(e: Start, done: list[int]) -> tuple[str, str]:
    """Where a restart resumed from, and the stopped incarnation's steps it redoes, in words."""
    base = e.resumed_from
    where = "restarted from scratch" if base is None else f"resumed from step {base}"
    if e.sources and "peer" in e.sources:
        where += source_words(e.sources, e.peer_bytes)
    elif e.from_memory:
        where += " (host memory)"
    redone = sum(1 for s in done if s > (base or 0))
    return where, f"{redone} step{'s' if redone != 1 else ''} redone"


def recovery_windows(events: list[Event], sess: list[int] | None = None,
                     waits: Sequence[Wait] = ()) -> list[tuple[float, float]]:
    """(origin, end of the next incarnation's first step), one window per restart.

    The origin is the first fault since the last window, else the end of the last step before
    the restart. A relaunch (a new session) opens no window: the idle time between two launcher
    invocations is no recovery; nor does a re-admission after a preemption (``waits``): the job
    resumed, no failure was recovered from.
    """
    waits, events = waits_of(events, waits), training(events)
    sess = sessions(events) if sess is None else sess
    admitted = readmissions(events, waits)
    return [(a, b) for a, b in _windows(events, sess) if not readmitted_between(a, b, admitted)]


def _windows(events: list[Event], sess: list[int]) -> list[tuple[float, float]]:
    """(origin, end of the first step) of every incarnation that followed another in a session.

    Restarts and re-admissions alike: :func:`recovery_windows` tells them apart.
    """
    out: list[tuple[float, float]] = []
    last_fault: float | None = None
    last_step_end: float | None = None
    current: tuple[int, int, int] | None = None
    for e, k in zip(events, sess, strict=True):
        if isinstance(e, Fault):
            last_fault = e.time if last_fault is None else last_fault
        elif isinstance(e, Step):
            inc = (k, *_incarnation(e))
            if current is not None and inc[0] != current[0]:
                last_fault = None
            elif current is not None and inc != current:
                origin = last_fault if last_fault is not None else last_step_end
                if origin is not None:
                    out.append((origin, e.end))
                last_fault = None
            current = inc
            last_step_end = e.end
    return out


def summarize(run_dir: str | os.PathLike,
              warn: Callable[[str], None] | None = None) -> GoodputReport:
    """Reads ``<run_dir>/events.jsonl`` and summarises it (``warn``: one line per bad line)."""
    return summarize_events(read_events(run_dir, warn))
