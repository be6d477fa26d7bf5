"""When background pinning may run: while the loop's thread waits for the GPU.

Registering host memory with CUDA (``cudaHostRegister``) holds the driver's locks and the
process's memory map while it runs, so a kernel launch of the training thread issued meanwhile
waits for it: pinning a 13 GB bank beside a 1b run cost the steps beside it 0.6-2.6 s in all
(docs/benchmarks/NOTES.md), on a loop whose launches keep the GPU fed. Every step also has a
stretch where the loop's thread launches nothing: it waits in ``loss.item()`` for the GPU to
finish the step. Pinning in that stretch costs the step nothing, as long as a piece ends before
the wait does. This module tells the pinning thread whether such a stretch is open and how much of
it is left, estimated from the waits of the last steps (torch-free); a piece that finds none is
pinned paced, at once, so the banks are not slower to come than without the waits.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator

#: Share of the shortest recent wait a piece may use (the rest absorbs a shorter wait).
SHARE = 0.7
#: Recent waits the estimate looks at (the shortest counts: one short wait is one short step).
HISTORY = 8


class GpuWaits:
    """The loop's waits for the GPU, seen from another thread.

    The loop wraps its wait in :meth:`waiting`; a background thread asks :meth:`room` before each
    piece of work that had better not overlap the loop's own CPU work.
    """

    def __init__(self, share: float = SHARE, history: int = HISTORY) -> None:
        self.share = share
        self._lock = threading.Lock()
        self._opened: float | None = None  # perf_counter when the current wait began
        self._waits: deque[float] = deque(maxlen=history)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The loop's thread waits for the GPU inside this block (and does nothing else)."""
        with self._lock:
            self._opened = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                if self._opened is not None:
                    self._waits.append(time.perf_counter() - self._opened)
                self._opened = None

    def budget(self) -> float | None:
        """Seconds a piece may take in one wait (None: no wait measured yet)."""
        with self._lock:
            return self._budget()

    def _budget(self) -> float | None:
        # Callers hold the lock.
        return self.share * min(self._waits) if self._waits else None

    def room(self, seconds: float) -> bool:
        """Whether the loop waits for the GPU now with ``seconds`` of its wait left (never blocks).

        False when no wait is open, the waits measured are too short for ``seconds`` or none was
        measured yet: the caller then paces itself rather than waiting for a wait to open (a
        piece held back for the next wait delays the bank by a step; on an H100 at 1b the
        banks took 20-27 s instead of ~10 s, and the first snapshot came that much later).
        """
        with self._lock:
            budget = self._budget()
            if budget is None or budget < seconds or self._opened is None:
                return False
            return self._opened + budget - time.perf_counter() >= seconds
