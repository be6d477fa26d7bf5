"""Fires the ``faults`` of this rank, each once per run, at the point of a step its kind names.

What a kind does and when it fires is its :class:`~kfp_nvrx.components.core.faults.FaultKind`
in the registry; this module only decides which fault is due and fires it once. A marker file in
``<run_dir>/faults/`` is created (O_EXCL) before a fault fires, so a restarted worker does not
fire it again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kfp_nvrx.components.core.ckpt_store import open_store
from kfp_nvrx.components.core.faults import Fault, InjectedFault, When
from kfp_nvrx.components.core.rundir import FAULTS_DIR

#: Re-exported: the exception a ``raise`` fault throws.
__all__ = ["FaultInjector", "InjectedFault"]


class FaultInjector:
    """Fires the configured faults of this rank once per run."""

    def __init__(self, faults: list[Fault], run_dir: str | os.PathLike[str], rank: int) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.run_dir = Path(run_dir)
        self.marker_dir = self.run_dir / FAULTS_DIR
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

    def due(self, step: int, when: When) -> Fault | None:
        """The unfired fault of ``step`` that fires at ``when``, claimed, or None.

        A fault with ``after_commits=N`` fires at the first step from its own on at which the
        run's store holds N committed checkpoints (a drill that damages the newest commit needs
        one, however slowly the machine writes).
        """
        for fault in self.faults:
            if fault.kind.when is not when or step < fault.step:
                continue
            commits = int(fault.param("after_commits")) if fault.kind.param("after_commits") else 0
            if step > fault.step and not commits:
                continue
            if commits and len(open_store(self.run_dir).committed_steps()) < commits:
                continue
            if self._claim(fault):
                return fault
        return None

    def fire(self, fault: Fault) -> None:
        """Carries the fault out: its kind's action (a kill or a hang never returns)."""
        fault.kind.action(fault, self.run_dir)
