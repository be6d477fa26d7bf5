"""Which bound each step of an incarnation runs under, from what the run measured (issue 37).

A hang is caught by the rank monitor once a step (or the gap between two step heartbeats) lasts
longer than its bound, so the bound must be as tight as the run allows from its third step on,
in every incarnation, and must still let the start-up pieces that are known to stall through.
Steps are of three kinds (:func:`kind_of`):

- ``start-up``: an incarnation's first :data:`STARTUP_STEPS` steps (allocations, autotuning, a
  compile, the first step after a restore, a second step that still compiles). Bound:
  ``safety_factor`` x the longest start-up step the run measured, at least
  ``resilience.first_steps_timeout`` (which alone bounds a fresh run's very first step, before
  anything is measured). A generous floor on purpose: a start-up bound a healthy restart
  overran would kill every later restart at the same point, before it could measure itself.
- ``pinning``: a later step that begins while the staging banks are allocated and pinned in the
  background (the pinning thread shares the driver with the step, which may run slower). Bound:
  the steady one, or ``safety_factor`` x the longest pinning step the run measured when longer.
- ``steady``: every other step. Bound: the learned step and heartbeat timeouts (this
  incarnation's, or the ones an earlier incarnation persisted: a restarted incarnation is judged
  by the run's rhythm from its third step, never relearned under the configured timeouts);
  until the run has learned any (a fresh run's first steps), ``safety_factor`` x the longest step
  this incarnation ran after its first, which is the measured start-up of the run so far.

Every bound is at least the floor (``resilience.min_learned_timeout``, see
:class:`.resilience.Monitor`). The measured seconds (:class:`Measured`) are persisted in
checkpoints and host-memory snapshots with the learned timeouts and only ever grow, so no
incarnation is held to a tighter start-up or pinning bound than an earlier one ran under.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

#: An incarnation's steps before its steps count as steady: the first is the start-up
#: (allocations, autotuning, compilation), the second may still compile.
STARTUP_STEPS = 2


class Kind(Enum):
    """The kind of a step, which picks its bound (see the module docstring)."""

    STARTUP = "start-up"
    PINNING = "pinning"
    STEADY = "steady"


def kind_of(index: int, pinning: bool) -> Kind:
    """The kind of an incarnation's step ``index`` (0-based) that begins while ``pinning``."""
    if index < STARTUP_STEPS:
        return Kind.STARTUP
    return Kind.PINNING if pinning else Kind.STEADY


@dataclass
class Measured:
    """The longest seconds the run saw per kind of step (the step, or the gap to its heartbeat).

    Every rank keeps its own (in synchronous training each step lasts about as long on every
    rank); a checkpoint on disk gives every rank one rank's, a host-memory snapshot each its own.
    """

    startup: float = 0.0
    pinning: float = 0.0

    def add(self, kind: Kind, seconds: float) -> None:
        """Counts one step of ``kind`` that took ``seconds`` (steady steps are learned elsewhere)."""
        if kind is Kind.STARTUP:
            self.startup = max(self.startup, seconds)
        elif kind is Kind.PINNING:
            self.pinning = max(self.pinning, seconds)

    def merge(self, other: Measured) -> None:
        """Keeps the longer of each (a restore never makes a bound tighter)."""
        self.startup = max(self.startup, other.startup)
        self.pinning = max(self.pinning, other.pinning)

    def state(self) -> dict[str, float]:
        """What checkpoints hold: the same keys at every save (a save plan is reused)."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None) -> Measured:
        """The inverse of :meth:`state`; what is missing or no finite number counts as unmeasured."""
        values = {}
        for f in fields(cls):
            value = (state or {}).get(f.name)
            number = float(value) if isinstance(value, (int, float)) and not isinstance(
                value, bool) else 0.0
            values[f.name] = number if math.isfinite(number) and number > 0 else 0.0
        return cls(**values)


@dataclass(frozen=True)
class Limits:
    """The configured numbers every bound is made of.

    Attributes:
        factor: ``resilience.safety_factor``: a bound is this many times what was measured.
        floor: The least any bound is (``resilience.min_learned_timeout``, raised for gloo
            under in-process restart).
        first_steps: ``resilience.first_steps_timeout``: the least a start-up step's bound is,
            and the whole bound of a fresh run's first step.
    """

    factor: float
    floor: float
    first_steps: float

    def bound(self, kind: Kind, measured: Measured, early: float,
              steady: tuple[float, float] | None) -> tuple[float, float]:
        """The (step section, heartbeat gap) bound of a step of ``kind``.

        Args:
            kind: The step's kind.
            measured: What the run measured so far (persisted and this incarnation's).
            early: The longest step (or gap) this incarnation ran after its first (of its
                second step the step alone: its gap holds the one-time start of the staging
                banks' set-up).
            steady: The learned (step, heartbeat) timeouts in force: this incarnation's or
                restored ones; None while the run has none.
        """
        if kind is Kind.STARTUP:
            first = max(self.first_steps, self.floor, self.factor * measured.startup)
            return first, first
        if steady is None:
            provisional = max(self.floor, self.factor * early)
            steady = (provisional, provisional)
        if kind is Kind.PINNING:
            pin = self.factor * measured.pinning
            return max(steady[0], pin), max(steady[1], pin)
        return steady


def bounds_line(limits: Limits, measured: Measured, early: float,
                steady: tuple[float, float] | None, restored: bool) -> str:
    """The bounds in force, in words (the trainer logs it at an incarnation's third step)."""
    step, beat = limits.bound(Kind.STEADY, measured, early, steady)
    pin = limits.bound(Kind.PINNING, measured, early, steady)[0]
    first = limits.bound(Kind.STARTUP, measured, early, steady)[0]
    source = ("learned" if not restored else "restored") if steady is not None else \
        "from this incarnation's first steps"
    return (f"hang bounds: step {step:.1f} s, heartbeat gap {beat:.1f} s ({source}); "
            f"steps while staging buffers pin {pin:.1f} s; an incarnation's first "
            f"{STARTUP_STEPS} steps {first:.1f} s")
