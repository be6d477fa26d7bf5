"""When background pinning may run: while the loop's thread waits for the GPU.

Registering host memory with CUDA (``cudaHostRegister``) holds the driver's locks and the
process's memory map while it runs, so a kernel launch of the training thread issued meanwhile
waits for it: pinning a 13 GB bank beside a 1b run cost the steps beside it 0.6-2.6 s in all
(docs/benchmarks/NOTES.md), on a loop whose launches keep the GPU fed. Every step also has a
stretch where the loop's thread launches nothing: it waits in ``loss.item()`` for the GPU to
finish the step. Pinning in that stretch costs the step nothing, as long as a piece ends before
the wait does. This module tells the pinning thread when such a stretch is open and how much of
it is left, estimated from the waits of the last steps (torch-free).
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

    The loop wraps its wait in :meth:`waiting`; a background thread asks :meth:`wait_for` before
    each piece of work that must not overlap the loop's own CPU work.
    """

    def __init__(self, share: float = SHARE, history: int = HISTORY) -> None:
        self.share = share
        self._cond = threading.Condition()
        self._opened: float | None = None  # perf_counter when the current wait began
        self._closed = float("-inf")  # perf_counter when the last wait ended
        self._waits: deque[float] = deque(maxlen=history)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The loop's thread waits for the GPU inside this block (and does nothing else)."""
        with self._cond:
            self._opened = time.perf_counter()
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._closed = time.perf_counter()
                if self._opened is not None:
                    self._waits.append(self._closed - self._opened)
                self._opened = None

    def budget(self) -> float | None:
        """Seconds a piece may take in one wait (None: no wait measured yet)."""
        with self._cond:
            return self._budget()

    def _budget(self) -> float | None:
        # Callers hold the condition's lock.
        return self.share * min(self._waits) if self._waits else None

    def wait_for(self, seconds: float, timeout: float) -> bool:
        """Blocks until the loop waits for the GPU with ``seconds`` of its wait left.

        Returns:
            True in such a wait. False at once when the waits measured are too short for
            ``seconds`` or the loop has not waited for ``timeout`` seconds (it is not running:
            before its first step, after its last, in a restart), and after ``timeout`` without
            a fitting wait (a long step): the caller then paces itself.
        """
        deadline = time.perf_counter() + timeout
        with self._cond:
            while True:
                now, budget = time.perf_counter(), self._budget()
                if budget is None or budget < seconds:
                    return False
                if self._opened is not None:
                    if self._opened + budget - now >= seconds:
                        return True
                elif now - self._closed > timeout:
                    return False
                if now >= deadline:
                    return False
                # Woken when a wait opens; one already too far along is let pass.
                self._cond.wait(min(deadline - now, 0.05))
