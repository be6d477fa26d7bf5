"""Timestamps of an in-process restart, for the log line that splits the wrapper's share."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any


class RestartClock:
    """Timestamps of one in-process restart, printed by rank 0 when the function is re-entered.

    Splits the wrapper's share of the recovery: the function's exit (after its own cleanup) ->
    the restart decision (NVRx's ``finalize``: after ``last_call_wait`` and the abort) -> the next
    iteration (``initialize``: after the health checks, the iteration barrier and garbage
    collection) -> re-entry (after the pre-entry health check).
    """

    def __init__(self) -> None:
        self.t_exit: float | None = None
        self.t_decided: float | None = None
        self.t_iteration: float | None = None
        self.abort_s: float | None = None  # NVRx's abort (NCCL communicators, process group)

    def exited(self) -> None:
        """The wrapped function raised."""
        self.t_exit = time.time()

    def decided(self) -> None:
        """NVRx decided to restart (``finalize``)."""
        self.t_decided = time.time()

    def next_iteration(self) -> None:
        """NVRx starts the next iteration (``initialize``)."""
        self.t_iteration = time.time()

    def entered(self, iteration: int) -> None:
        """The wrapped function is (re-)entered: log the split of the restart just done."""
        now = time.time()
        t_exit, t_decided, t_iteration = self.t_exit, self.t_decided, self.t_iteration
        if iteration and t_exit is not None and t_decided is not None and t_iteration is not None \
                and os.environ.get("RANK", "0") == "0":
            abort = f" (abort {self.abort_s:.3f}s)" if self.abort_s is not None else ""
            print(f"[trainer] in-process restart {iteration}: exit->decision "
                  f"{t_decided - t_exit:.3f}s{abort}, ->next iteration "
                  f"{t_iteration - t_decided:.3f}s, ->re-entry {now - t_iteration:.3f}s "
                  f"(wrapper total {now - t_exit:.3f}s)", flush=True)
        self.t_exit = self.t_decided = self.t_iteration = self.abort_s = None


def clock_hooks(inprocess: Any, clock: RestartClock, on_abort: Callable[[], None] | None = None,
                quick: bool = False) -> tuple[Any, Any, Any]:
    """NVRx hooks that record times on ``clock``: initialize, finalize and a timed abort.

    The abort runs after ``on_abort`` (the rank monitor's disconnect: the restart has begun, the
    wrapper's timeouts bound it) and is timed. With ``quick`` (``resilience.quick_abort``), where
    the groups have NCCL backends, their aborts and shutdown run on a thread and torch forgets
    the groups at once (:func:`.quick_abort.abort_in_background`: the 0.5-1.0 s of NCCL's
    teardown leave the restart's path); otherwise it is NVRx's ``AbortTorchDistributed``.
    """

    class _Iteration(inprocess.initialize.Initialize):
        def __call__(self, state: Any) -> Any:
            clock.next_iteration()
            return state

    class _Decision(inprocess.finalize.Finalize):
        def __call__(self, state: Any) -> Any:
            clock.decided()
            return state

    class _TimedAbort(inprocess.abort.Abort):
        def __init__(self) -> None:
            self.inner = inprocess.abort.AbortTorchDistributed()

        def __call__(self, state: Any) -> Any:
            if on_abort is not None:
                on_abort()
            t0 = time.time()
            try:
                if quick:
                    # FT: NVRx's in-process abort, its NCCL teardown moved off the restart's path.
                    from kfp_nvrx.components.training.trainer.quick_abort import (
                        abort_in_background,
                    )

                    if abort_in_background(lambda line: print(line, flush=True)):
                        return state
                return self.inner(state)
            finally:
                clock.abort_s = time.time() - t0

    return _Iteration(), _Decision(), _TimedAbort()
