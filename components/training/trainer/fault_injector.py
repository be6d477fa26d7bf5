"""Fires the ``--fault`` items of this rank, each once per run.

A marker file in ``<run_dir>/faults/`` is created (O_EXCL) before a fault fires, so a restarted
worker does not fire it again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from kfp_nvrx.components.core.faults import Fault
from kfp_nvrx.components.core.rundir import FAULTS_DIR

#: How much longer a ``stall`` fault makes its step (a slow shared-storage read).
STALL_S = 3.0


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


class FaultInjector:
    """Fires the configured faults of this rank once per run."""

    def __init__(self, faults: list[Fault], run_dir: str | os.PathLike, rank: int) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.marker_dir = Path(run_dir) / FAULTS_DIR
        self.rank = rank

    def _claim(self, fault: Fault) -> bool:
        """Atomically marks the fault as fired; False if an earlier incarnation fired it."""
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.marker_dir / fault.key, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, f"{time.time()}\n".encode())
        os.close(fd)
        return True

    def due(self, step: int, kinds: tuple[str, ...]) -> Fault | None:
        """The unfired fault of one of ``kinds`` for ``step``, claimed, or None."""
        for fault in self.faults:
            if fault.step == step and fault.kind in kinds and self._claim(fault):
                return fault
        return None

    @staticmethod
    def fire(fault: Fault, on_hang=None) -> None:
        """Carries the fault out. ``on_hang`` runs before blocking (e.g. stop heartbeats)."""
        if fault.kind in ("kill", "kill-in-ckpt"):
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "raise":
            raise InjectedFault(f"injected fault {fault.key}")
        if fault.kind == "stall":
            time.sleep(STALL_S)
            return
        if fault.kind == "hang":
            if on_hang is not None:
                on_hang()
            while True:  # blocked "forever": only the rank monitor's timeout ends this
                time.sleep(3600)
