"""The incarnation's long-lived heap, frozen once it is built: no step pays a full collection of it.

A full (generation 2) garbage collection walks every tracked object: after the trainer's imports
alone that is some 320,000 objects and 0.5 s on this project's 2-core CPU machines (CPython
3.11, under load), all of it on the loop's thread while the GPU runs out of queued work.
CPython starts one when a quarter more long-lived objects appeared since the last, which the
background work of a save, a write or the staging allocation does. ``gc.freeze()`` moves what
exists into a permanent generation that collections skip; refcounting still frees those
objects, only a reference cycle among them is kept. torchtitan (``gc_freq``) and Megatron
(``--manual-gc``) take the collections off the steps for the same reason.

Frozen while the GPU runs the incarnation's second step (its model, optimizer state and
compiled code exist, the first step's temporaries are gone, and the first step after a restore,
part of the recovery, is not lengthened). Not under NVRx's in-process restart: there the incarnation's
model and optimizer must be collectable when the function is left (FSDP's hooks make them a
cycle), and unfreezing then would cost the restart the full collection the wrapper's start-up
freeze avoids (:func:`.inprocess_restart._restartable`).
"""

from __future__ import annotations

import gc
import time


def freeze_heap() -> tuple[int, float]:
    """Collects what is garbage now and freezes the rest; returns (objects frozen, seconds)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), time.perf_counter() - t0


class CollectionClock:
    """Seconds the garbage collector ran since the last :meth:`take` (all generations).

    A ``gc.callbacks`` hook: collections run on whichever thread allocates, and stop every
    thread that holds or wants the GIL, so the loop's step pays for them wherever they start.
    """

    _shared: CollectionClock | None = None

    @classmethod
    def shared(cls) -> CollectionClock:
        """The process's one clock (one hook, whichever incarnation reads it)."""
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def __init__(self) -> None:
        self._t0: float | None = None
        self._seconds = 0.0
        self._full = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self._seconds += time.perf_counter() - self._t0
            self._full += info.get("generation") == 2
            self._t0 = None

    def take(self) -> tuple[float, int]:
        """(Seconds, full collections) since the last call."""
        out = (self._seconds, self._full)
        self._seconds, self._full = 0.0, 0
        return out
