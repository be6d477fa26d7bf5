"""A stopped node's workers save the newest state before they exit (issue 31: preemption).

Kueue preempting the job, a node drain, a spot interruption or a deleted pod all reach the
workers as SIGTERM from ft_launcher, which also sends SIGTERM when it restarts them because a
peer failed. The node's entry point tells the two apart (:mod:`kfp_nvrx.components.core.
stop_request`): only a stop it asked for carries a deadline. On such a SIGTERM the worker notes
the deadline and goes on to the end of its step; there every rank learns (one small all-reduce
per step) that some node must stop and how much time the first of them has, saves the step just
trained (or lets the save in flight commit), and exits: a stopped rank with 0, the others with 1
so that their agents restart them into the relaunched job. The save commits within the time
left or is abandoned (never a torn checkpoint: the commit marker is written last).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable

from kfp_nvrx.components.core.stop_request import STOP_FILE_ENV, read_stop


class StopRequested(BaseException):
    """Raised out of the training loop once the stop's save is over.

    Attributes:
        asked: This rank's node was asked to stop (exit 0); else a peer's was (exit 1: restart).
        saved: The step the stop left committed on disk (None: nothing new was saved).
    """

    def __init__(self, asked: bool, saved: int | None, message: str) -> None:
        super().__init__(message)
        self.asked = asked
        self.saved = saved


class StopWatch:
    """Whether this node was asked to stop, and by when; a no-op without a stop request path.

    Args:
        save_timeout: ``resilience.stop_save_timeout`` (0: a stop saves nothing).
        path: This node's stop request file (default: :data:`STOP_FILE_ENV`).
        on_stop: Called (in the signal handler) when a stop is noted; must only set flags.
    """

    def __init__(self, save_timeout: float, path: str | None = None,
                 on_stop: Callable[[], None] | None = None) -> None:
        self.path = path if path is not None else os.environ.get(STOP_FILE_ENV)
        self.enabled = bool(self.path) and save_timeout > 0
        self.deadline: float | None = None
        self.on_stop = on_stop  # e.g. the rank monitor client goes quiet

    def install(self) -> None:
        """Handles SIGTERM in this (main) thread: a stop request is noted, anything else ends."""
        if self.enabled and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum: int, _frame: object) -> None:
        deadline = read_stop(self.path)
        if deadline is None:  # ft_launcher restarting the workers: go at once, as before
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.deadline = deadline
        if self.on_stop is not None:
            self.on_stop()

    def agree(self, reduce_max: Callable[[list[float]], list[float]]) -> tuple[bool, float]:
        """Collective: whether any rank was asked to stop, and the least time any of them has."""
        left = self.deadline - time.time() if self.deadline is not None else 1e9
        asked, neg_left = reduce_max([1.0 if self.deadline is not None else 0.0, -left])
        return asked > 0, -neg_left if math.isfinite(neg_left) else 0.0
