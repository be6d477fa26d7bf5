"""Waits in a queue during a run: kept out of its wall time, and a re-admission is no restart.

Kueue holds a job it has not admitted, and holds it again when it preempts it: the pods get
SIGTERM (the trainer saves and writes an ``end`` of status ``stopped``), are deleted, and new pods
start once the job is admitted again. From the pods' events alone that reads like a pod delete:
a stop, then every agent new (a fresh round, a ``pod`` restart). Only the launcher sees the queue,
so it writes each wait as a :class:`~.events.Queued` line where the run dir is on its machine
(``kfp-nvrx goodput --queued`` takes the waits a launcher printed instead).

What goodput makes of the waits (:mod:`.goodput`):

* the seconds they held the job inside the run are not wall time (nor recovery, nor lost work);
* each wait that ended inside the run was a re-admission: the first restart that follows it
  (the new pods' round) is the job resuming, counted as a preemption, not as a pod restart,
  and its window (from the stop to the first step after it) is no recovery. A pod deleted by
  hand, a drain or a node lost, with no queue in between, stays a pod restart with its recovery:
  the launcher counts those pods too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kfp_nvrx.components.core.events import Event, Queued

Wait = tuple[float, float]


def merged(waits: Iterable[Wait]) -> list[Wait]:
    """The union of ``waits`` as sorted, disjoint ``(start, end)`` spans (empty ones dropped).

    The launcher's waits and the run dir's record of them are the same waits, written twice
    when both are known (a re-attached launcher writes the first one again): counted once.
    """
    out: list[list[float]] = []
    for a, b in sorted((float(a), float(b)) for a, b in waits if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def waits_of(events: Sequence[Event], given: Iterable[Wait] = ()) -> list[Wait]:
    """The run's waits: its :class:`~.events.Queued` lines and ``given`` ones, merged."""
    return merged([*((e.start, e.end) for e in events if isinstance(e, Queued)), *given])


def held(lo: float, hi: float, waits: Sequence[Wait]) -> float:
    """Seconds of ``[lo, hi]`` that a queue held the job (``waits`` merged)."""
    return sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in waits)


def readmissions(events: Sequence[Event], waits: Sequence[Wait]) -> list[float]:
    """When the job was admitted again inside the run: the end of each wait that began in it.

    A wait that began before the run's first event is its first admission's (or a
    re-attached launcher's view of it), none of these.
    """
    run = [e.when for e in events if not isinstance(e, Queued)]
    return [b for a, b in waits if run and a > min(run)]


def absorbed(restarts: Sequence[float], admitted: Sequence[float]) -> set[int]:
    """Indexes of the restarts (their times) that are re-admissions, not restarts.

    Each re-admission takes the first restart at or after it that no earlier one took.
    """
    taken: set[int] = set()
    order = sorted(range(len(restarts)), key=lambda i: restarts[i])
    for b in sorted(admitted):
        i = next((i for i in order if i not in taken and restarts[i] >= b), None)
        if i is not None:
            taken.add(i)
    return taken


def readmitted_between(lo: float, hi: float, admitted: Sequence[float]) -> bool:
    """Whether the job was admitted again in ``(lo, hi]`` (a window that is a resume)."""
    return any(lo < b <= hi for b in admitted)
