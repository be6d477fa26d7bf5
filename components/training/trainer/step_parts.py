"""Where each step's time went (``train.step_parts``): a diagnostic for the step events.

A step that grows beside background work (pinning the banks, a durable write, a replication
round) grows for one of two reasons: the loop's thread waited (for a core, a lock, the GIL) and
the GPU ran out of queued work, or the GPU's own kernels ran slower. The loop's thread is timed
between marks (``data``, ``forward_backward`` and ``optimizer``: launching them; ``sync``:
waiting for the GPU in ``loss.item()``; ``tick``: the durable write and replication moved on;
``monitor``: heartbeats, stop and learning collectives; ``snapshot``: the save), the GPU
from the step's first to its last kernel (``gpu``, CUDA events on the compute stream), and the
garbage collector's runs within the step, whichever part they fell in (``gc``). Off by
default, and no benchmark figure is taken with it on: at 1b on an H100 the step after each snapshot took
0.52-0.53 s with it (after every snapshot of the three runs with it) against 0.302-0.304 s
without, its launch of forward/backward 0.23 s longer. Which of its CUDA calls holds the loop
there (the per-step timing events, their synchronize) is not known yet.
"""

from __future__ import annotations

import time

import torch

from kfp_nvrx.components.training.trainer.heap import CollectionClock


class StepParts:
    """Seconds of each part of the current step; :meth:`take` ends the step.

    Args:
        enabled: ``train.step_parts``; off, every method returns at once and :meth:`take` None.
        device: The training device (CUDA: the GPU span is timed too).
    """

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self.parts: dict[str, float] = {}
        self._last = 0.0
        self._gpu: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._gc = CollectionClock.shared() if enabled else None

    def begin(self) -> None:
        """The step starts now."""
        if not self.enabled:
            return
        self.parts, self._last = {}, time.perf_counter()
        if self._gc is not None:
            self._gc.take()  # what ran between steps belongs to no step
        if self.cuda:
            self._gpu = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._gpu[0].record()

    def gpu_end(self) -> None:
        """The step's last kernel is queued (before the host waits for the loss)."""
        if self._gpu is not None:
            self._gpu[1].record()

    def mark(self, name: str) -> None:
        """The part ``name`` ends now (seconds since the previous mark, added up per name)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - self._last
        self._last = now

    def take(self) -> dict[str, float] | None:
        """The step's parts, rounded to microseconds (None when off); the step ends."""
        if not self.enabled:
            return None
        out = {k: round(v, 6) for k, v in self.parts.items()}
        if self._gpu is not None:
            start, end = self._gpu
            end.synchronize()  # recorded before loss.item(), which waited for it already
            out["gpu"] = round(start.elapsed_time(end) / 1000.0, 6)
            self._gpu = None
        if self._gc is not None:
            out["gc"] = round(self._gc.take()[0], 6)
        self.parts = {}
        return out
