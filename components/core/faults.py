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

#: Every kind, with how it reads in a sentence ("rank 1 killed at step 20"): the one list of kinds.
_VERBS = {"kill": "killed", "raise": "raised an exception", "hang": "hung",
          "kill-in-ckpt": "killed while checkpointing", "stall": "stalled"}
KINDS = tuple(_VERBS)
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


def fault_verb(kind: str) -> str:
    """How a fault of ``kind`` reads in a sentence; a drill's own kinds read ``<kind> fault``."""
    return _VERBS.get(kind, f"{kind} fault")


def parse_fault(text: str) -> Fault:
    """Parses ``KIND@STEP[/RANK]``; raises UserError naming ``faults`` when malformed."""
    m = _PATTERN.match(text.strip())
    if not m or m["kind"] not in KINDS:
        raise UserError("faults", f"expected KIND@STEP[/RANK] with KIND in {', '.join(KINDS)}, "
                        f"got {text!r}")
    step = int(m["step"])
    if step < 1:
        raise UserError("faults", f"step must be >= 1, got {text!r}")
    return Fault(m["kind"], step, int(m["rank"] or 0))


def check_faults(texts: list[str], steps: int, interval: int,
                 world_size: int | None = None) -> list[Fault]:
    """Parses every fault and checks that it can fire in this run; raises UserError naming ``faults``.

    Args:
        texts: ``KIND@STEP[/RANK]`` strings.
        steps: ``train.steps`` (a fault after the last step never fires).
        interval: ``checkpoint.interval`` (``kill-in-ckpt`` needs a checkpoint step).
        world_size: Workers of the job at most (nodes MAX x processes per node), when known: a
            fault aimed at a rank beyond it never fires.
    """
    parsed = []
    for text in texts:
        f = parse_fault(text)
        if f.step > steps:
            raise UserError("faults", f"{f.kind}@{f.step} is after the last step ({steps})")
        if f.kind == "kill-in-ckpt" and (not interval or f.step % interval):
            raise UserError("faults", f"kill-in-ckpt@{f.step} needs a checkpoint step "
                            f"(a multiple of checkpoint.interval={interval})")
        if world_size is not None and f.rank >= world_size:
            raise UserError("faults", f"{text.strip()!r} aims at rank {f.rank} but the job has "
                            f"{world_size} worker(s) (ranks 0-{world_size - 1})")
        parsed.append(f)
    return parsed
