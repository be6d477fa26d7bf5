"""Fault injection for drills and tests: ``--fault KIND@STEP[/RANK]`` (repeatable).

Kinds: ``kill`` (SIGKILL self), ``raise`` (exception), ``hang`` (stop heartbeating and block),
``kill-in-ckpt`` (SIGKILL while an async checkpoint is being written), ``stall`` (a healthy step
that takes ``STALL_S`` seconds longer, as a slow read from shared storage would: the run must not
be killed for it once timeouts are learned). Each fault fires once per
run: a marker file in ``<run_dir>/faults/`` is created (O_EXCL) before it fires, so a restarted
worker does not fire it again.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from kfp_nvrx.components.errors import UserError

KINDS = ("kill", "raise", "hang", "kill-in-ckpt", "stall")
STALL_S = 3.0
_PATTERN = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?:/(?P<rank>\d+))?$")


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


@dataclass(frozen=True)
class Fault:
    """One fault: fires on ``rank`` (default 0) at ``step``."""

    kind: str
    step: int
    rank: int = 0

    @property
    def key(self) -> str:
        """Marker name, unique per fault."""
        return f"{self.kind}@{self.step}.{self.rank}"


def parse_fault(text: str) -> Fault:
    """Parses ``KIND@STEP[/RANK]``; raises UserError naming ``--fault`` when malformed."""
    m = _PATTERN.match(text.strip())
    if not m or m["kind"] not in KINDS:
        raise UserError("--fault", f"expected KIND@STEP[/RANK] with KIND in {', '.join(KINDS)}, "
                        f"got {text!r}")
    step = int(m["step"])
    if step < 1:
        raise UserError("--fault", f"step must be >= 1, got {text!r}")
    return Fault(m["kind"], step, int(m["rank"] or 0))


class FaultInjector:
    """Fires the configured faults of this rank once per run."""

    def __init__(self, faults: list[Fault], run_dir: str | os.PathLike, rank: int) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.marker_dir = Path(run_dir) / "faults"
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
