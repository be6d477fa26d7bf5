"""When snapshots are taken and when the newest one is written: the two paces of the save path.

A snapshot copies the state into a host bank (:mod:`.staging`): the recovery tier, cheap, taken
every ``checkpoint.interval`` steps or ``checkpoint.interval_s`` seconds. The durable write to the
run's store runs behind it at its own pace and always takes the newest snapshot not yet written,
so a slow store delays the durable tier, never a step. Two settings pace it:

- ``checkpoint.persist_interval_s``: seconds at least between the starts of two writes;
- ``checkpoint.persist_duty``: the share of the time a write may be in flight. After a write that
  took ``w`` seconds the next starts ``w * (1 / duty - 1)`` seconds after it ended at the
  earliest: a write in flight costs the steps beside it a little (the writer process reads the
  banks and competes for memory bandwidth and cores), so writing back to back would cost every
  step that little; 1 writes whenever the writer is free.

This module holds the pace and the bookkeeping (torch-free); the
:class:`~.checkpointer.Checkpointer` turns the decisions into collectives (every rank agrees
before a snapshot or a write starts) and the copies and writes themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Why a snapshot was not taken (one line each, logged once per incarnation and reason).
PINNING = "no staging bank is ready yet (they are being allocated and pinned in the background)"
BUSY = "every staging bank is being written to the store (/dev/shm holds one bank)"


@dataclass
class Pace:
    """The two paces and what this incarnation took and wrote so far.

    Attributes:
        interval: Steps between snapshots (0: none but the final step).
        interval_s: Seconds between snapshots (> 0: replaces ``interval``).
        persist_interval_s: Seconds at least between the starts of two durable writes.
        persist_duty: Share of the time a durable write may be in flight (0 < duty <= 1).
        newest: The newest snapshot's step (-1: none yet).
        persisted: The newest step committed to the store (-1: none known).
        plan_state: A state dict of the newest snapshot's layout: its write is planned with it.
    """

    interval: int
    interval_s: float
    persist_interval_s: float
    persist_duty: float = 1.0
    newest: int = -1
    persisted: int = -1
    plan_state: dict[str, Any] | None = None
    last_snapshot: float = field(default_factory=time.monotonic)
    write_started: float = float("-inf")
    write_ended: float = float("-inf")
    write_took: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def periodic(self) -> bool:
        """Whether snapshots are taken during the run (not only the final step)."""
        return self.interval > 0 or self.interval_s > 0

    def snapshot_due(self, step: int) -> bool:
        """This rank's view: is ``step`` a snapshot step? (by time: agreed on by the caller)."""
        if self.interval_s > 0:
            return time.monotonic() - self.last_snapshot >= self.interval_s
        return self.interval > 0 and step % self.interval == 0

    def took(self, step: int, state: dict[str, Any]) -> None:
        """A snapshot of ``step`` was taken (its layout is ``state``'s)."""
        self.newest, self.plan_state = step, state
        self.last_snapshot = time.monotonic()

    def unwritten(self) -> bool:
        """Whether the newest snapshot is newer than the store's newest commit."""
        return self.newest > self.persisted and self.plan_state is not None

    def write_due(self, now: float | None = None) -> bool:
        """This rank's view: may the next durable write start now?"""
        now = time.monotonic() if now is None else now
        if now - self.write_started < self.persist_interval_s:
            return False
        rest = self.write_took * (1.0 / self.persist_duty - 1.0) if self.persist_duty < 1 else 0.0
        return now - self.write_ended >= rest

    def started_write(self) -> None:
        """A durable write started now."""
        self.write_started = time.monotonic()

    def found(self, persisted: int) -> None:
        """A resume listed the store: ``persisted`` is its newest commit (-1: none)."""
        self.persisted = persisted

    def wrote(self, step: int) -> None:
        """The write of ``step`` is committed now."""
        self.persisted = max(self.persisted, step)
        self.write_ended = time.monotonic()
        self.write_took = max(0.0, self.write_ended - self.write_started)

    def skip(self, reason: str, log: Callable[[str], None], step: int) -> None:
        """Counts a snapshot not taken; the first of each reason is logged (one line).

        By time, the next try comes a second later (or an interval, when shorter), not at every
        step: each try is a collective and an event.
        """
        if self.interval_s > 0:
            self.last_snapshot = time.monotonic() - max(0.0, self.interval_s - 1.0)
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if self.skipped[reason] == 1:
            log(f"snapshot of step {step} skipped: {reason}; training goes on (the next "
                "snapshot is taken when it can be)")
