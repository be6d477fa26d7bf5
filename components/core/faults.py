"""The fault syntax for drills and tests: ``--fault KIND@STEP[/RANK]`` (repeatable).

Kinds: ``kill`` (SIGKILL self), ``raise`` (exception), ``hang`` (stop heartbeating and block),
``kill-in-ckpt`` (SIGKILL while an async checkpoint is being written), ``stall`` (a healthy step
that takes a few seconds longer, as a slow read from shared storage would: the run must not be
killed for it once timeouts are learned). Parsed here, where the
launcher side can check it; the trainer fires them (:mod:`...trainer.fault_injector`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kfp_nvrx.components.errors import UserError

KINDS = ("kill", "raise", "hang", "kill-in-ckpt", "stall")
_PATTERN = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?:/(?P<rank>\d+))?$")


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
