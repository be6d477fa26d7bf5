"""Fault drills: the registry of fault kinds and the ``KIND@STEP[/RANK][:NAME=VALUE,...]`` syntax.

A fault kind is one :class:`FaultKind` in :data:`FAULT_KINDS`: its name, how it reads in a
sentence, when in a step it fires, what it does, whether the job must recover from it (a failure)
or ride it out (a healthy stall), its parameters and its action. Everything that knows about
kinds reads this registry: the launcher side parses and checks ``faults`` with it before a job
starts (:func:`check_faults`), the trainer asks its injector for the fault due at each point of a
step (:mod:`...training.trainer.fault_injector`), the drills count the restarts a scenario's
faults must cause, and the CLI help and the KFP parameter descriptions list its names.

Adding a kind is one ``FAULT_KINDS.register(FaultKind(...))`` below, with its action.

A fault is parsed once into a typed :class:`Fault` (:func:`parse_fault`); it crosses process
boundaries (the ft_launcher command line, a pod's args) as its text.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TypeVar

from kfp_nvrx.components.core.host_copy import (
    node_copy_dir,
    node_name,
    node_workers,
    pid_alive,
    remove_copy,
)
from kfp_nvrx.components.errors import UserError


class When(Enum):
    """The point of a training step at which a fault fires."""

    #: At the start of the step's timed section, before forward/backward.
    STEP = "step"
    #: Right after the step's snapshot was taken (its copies queued; CUDA: may still run).
    CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class Param:
    """A number a fault kind takes (``NAME=VALUE`` after the fault), with its default.

    Attributes:
        name: How the fault text names it.
        default: Its value when the fault does not set it; its type (int or float) is the type.
        doc: One line: what it sets.
        minimum: The smallest value accepted.
    """

    name: str
    default: float | int
    doc: str
    minimum: float = 0.0

    def parse(self, kind: str, text: str) -> float | int:
        """The value of ``NAME=text``; raises UserError naming ``faults`` when it is not one."""
        try:
            value = type(self.default)(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < self.minimum:
            what = "a whole number" if isinstance(self.default, int) else "a number"
            raise UserError("faults", f"{kind} {self.name} must be {what} >= {self.minimum:g}, "
                            f"got {text!r}")
        return value


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


@dataclass(frozen=True)
class FaultKind:
    """One kind of fault.

    Attributes:
        name: The ``KIND`` of the fault text (lower-case letters, digits, ``-``).
        verb: How it reads in a sentence: "rank 1 ``killed`` at step 20".
        when: The point of a step at which it fires (a :data:`When.CHECKPOINT` fault needs a
            checkpoint step).
        does: One line: what it does, for help texts.
        failure: True when the job must recover from it (one restart); False for a healthy stall
            the job must ride out without one.
        action: Carries the fault out in the faulting worker, given the run dir (may not
            return).
        params: The numbers it takes, with their defaults.
    """

    name: str
    verb: str
    when: When
    does: str
    failure: bool
    action: Callable[[Fault, Path], None] = field(compare=False, repr=False)
    params: tuple[Param, ...] = ()

    def param(self, name: str) -> Param | None:
        """The parameter called ``name``, or None."""
        return next((p for p in self.params if p.name == name), None)


class FaultKinds:
    """The registry of fault kinds, in the order they were registered."""

    _NAME = re.compile(r"^[a-z][a-z0-9-]*$")

    def __init__(self) -> None:
        self._kinds: dict[str, FaultKind] = {}

    def register(self, kind: FaultKind) -> FaultKind:
        """Adds ``kind``; raises ValueError on a malformed or taken name (a programming error)."""
        if not self._NAME.match(kind.name) or kind.name in self._kinds:
            raise ValueError(f"fault kind {kind.name!r} is malformed or registered already")
        self._kinds[kind.name] = kind
        return kind

    def unregister(self, name: str) -> None:
        """Removes the kind called ``name`` (tests that register their own)."""
        del self._kinds[name]

    def get(self, name: str) -> FaultKind | None:
        """The kind called ``name``, or None."""
        return self._kinds.get(name)

    def __iter__(self) -> Iterator[FaultKind]:
        return iter(tuple(self._kinds.values()))

    def names(self) -> tuple[str, ...]:
        """Every kind's name, in registration order."""
        return tuple(self._kinds)

    def listing(self) -> str:
        """The names as a user reads them, comma-separated, in registration order."""
        return ", ".join(self._kinds)


#: Every fault kind there is.
FAULT_KINDS = FaultKinds()


def _kill(fault: Fault, run_dir: Path) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _lose_node(fault: Fault, run_dir: Path) -> None:
    """This rank's node is lost: every worker on it, then its host memory of the run, then us.

    The node's other workers are the ones whose owner records are in its host copy folder
    (:mod:`.host_copy`); they go first, so none writes there after the folder is removed.
    """
    folder = node_copy_dir(run_dir, node_name())
    others = node_workers(folder) - {os.getpid()}
    for pid in others:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while others and time.monotonic() < deadline:
        others = {pid for pid in others if pid_alive(pid)}
        time.sleep(0.05)
    remove_copy(folder)
    os.kill(os.getpid(), signal.SIGKILL)


def _raise(fault: Fault, run_dir: Path) -> None:
    raise InjectedFault(f"injected fault {fault.key}")


def _hang(fault: Fault, run_dir: Path) -> None:
    # Blocked "forever" in the step: no heartbeat leaves this rank, so only the rank monitor's
    # timeout ends it.
    while True:
        time.sleep(3600)


def _stall(fault: Fault, run_dir: Path) -> None:
    time.sleep(fault.param("seconds"))


# Seconds the next durable checkpoint write is slowed by (a slow-write fault fired in this
# process; the checkpointer takes it with take_write_delay). Module state on purpose: the fault's
# action runs in the trainer, the delay in the writer process the checkpointer feeds.
_write_delays: list[float] = []


def _slow_write(fault: Fault, run_dir: Path) -> None:
    _write_delays.append(float(fault.param("seconds")))


def take_write_delay() -> float:
    """Seconds the next durable write must be slowed by (0: none); each delay is taken once."""
    return _write_delays.pop(0) if _write_delays else 0.0


# The kinds. Adding one: a FaultKind here with its action above; everything else reads it.
FAULT_KINDS.register(FaultKind(
    "kill", verb="killed", when=When.STEP, does="SIGKILL", failure=True, action=_kill,
    params=(Param("after_commits", 0, "fire at the first step from STEP on at which the run has "
                  "this many committed checkpoints (0: at STEP)"),)))
FAULT_KINDS.register(FaultKind(
    "raise", verb="raised an exception", when=When.STEP, does="exception", failure=True,
    action=_raise))
FAULT_KINDS.register(FaultKind(
    "hang", verb="hung", when=When.STEP, does="stop heartbeating and block", failure=True,
    action=_hang))
# A lost node: its workers and its host memory (their snapshots and the peer copies it held) go
# at once; the restart must restore its ranks from the copies on other nodes.
FAULT_KINDS.register(FaultKind(
    "node-lost", verb="lost its node", when=When.STEP,
    does="SIGKILL every worker of the rank's node and drop the node's host memory", failure=True,
    action=_lose_node))
FAULT_KINDS.register(FaultKind(
    "kill-in-ckpt", verb="killed while checkpointing", when=When.CHECKPOINT,
    does="SIGKILL right after a snapshot's copies were queued", failure=True, action=_kill))
# A slow store: the next durable write (started at or after this step) takes this much longer in
# the writer process. Snapshots go on meanwhile; no step may wait for it.
FAULT_KINDS.register(FaultKind(
    "slow-write", verb="slowed its next checkpoint write", when=When.STEP,
    does="the next durable write takes longer (a slow store)", failure=False, action=_slow_write,
    params=(Param("seconds", 10.0, "how much longer the write takes"),)))
# A slow read from shared storage: the run must not be killed for it once timeouts are learned.
FAULT_KINDS.register(FaultKind(
    "stall", verb="stalled", when=When.STEP, does="a healthy step that takes longer",
    failure=False, action=_stall,
    params=(Param("seconds", 3.0, "how much longer the step takes"),)))


@dataclass(frozen=True)
class Fault:
    """One fault: fires on ``rank`` at ``step``, once per run.

    Attributes:
        kind: What it is.
        step: The step it fires in (>= 1).
        rank: The global rank it fires on.
        params: The parameters the fault text set, as (name, value); the rest keep their defaults.
    """

    kind: FaultKind
    step: int
    rank: int = 0
    params: tuple[tuple[str, float | int], ...] = ()

    @property
    def key(self) -> str:
        """Marker name, unique per fault."""
        return f"{self.kind.name}@{self.step}.{self.rank}"

    def param(self, name: str) -> float | int:
        """The value of parameter ``name``: the fault's own, else the kind's default."""
        given = dict(self.params)
        if name in given:
            return given[name]
        declared = self.kind.param(name)
        if declared is None:
            raise KeyError(f"fault kind {self.kind.name!r} has no parameter {name!r}")
        return declared.default

    def __str__(self) -> str:
        """The fault's text (``KIND@STEP/RANK[:NAME=VALUE,...]``): what the trainer parses."""
        extra = ",".join(f"{name}={value:g}" for name, value in self.params)
        return f"{self.kind.name}@{self.step}/{self.rank}" + (f":{extra}" if extra else "")


_PATTERN = re.compile(r"^(?P<kind>[a-z][a-z0-9-]*)@(?P<step>\d+)(?:/(?P<rank>\d+))?"
                      r"(?::(?P<params>.*))?$")


def fault_verb(kind: str) -> str:
    """How a fault of ``kind`` reads in a sentence; a drill's own kinds read ``<kind> fault``."""
    known = FAULT_KINDS.get(kind)
    return known.verb if known is not None else f"{kind} fault"


def parse_fault(text: str) -> Fault:
    """Parses ``KIND@STEP[/RANK][:NAME=VALUE,...]``; raises UserError naming ``faults`` when malformed."""
    m = _PATTERN.match(text.strip())
    kind = FAULT_KINDS.get(m["kind"]) if m else None
    if m is None or kind is None:
        raise UserError("faults", f"expected KIND@STEP[/RANK] with KIND in {FAULT_KINDS.listing()}, "
                        f"got {text!r}")
    step = int(m["step"])
    if step < 1:
        raise UserError("faults", f"step must be >= 1, got {text!r}")
    params = _parse_params(kind, m["params"]) if m["params"] is not None else ()
    return Fault(kind, step, int(m["rank"] or 0), params)


def _parse_params(kind: FaultKind, text: str) -> tuple[tuple[str, float | int], ...]:
    """``NAME=VALUE,...`` after a fault of ``kind``, each a parameter it declares, set once."""
    values: dict[str, float | int] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        declared = kind.param(name.strip())
        if not sep or declared is None or declared.name in values:
            known = ", ".join(p.name for p in kind.params) or "none"
            raise UserError("faults", f"{kind.name} takes NAME=VALUE parameters, each once "
                            f"(known: {known}), got {item.strip()!r}")
        values[declared.name] = declared.parse(kind.name, value.strip())
    return tuple(values.items())


def check_faults(texts: list[str], steps: int, interval: int,
                 world_size: int | None = None) -> list[Fault]:
    """Parses every fault and checks that it can fire in this run; raises UserError naming ``faults``.

    Args:
        texts: ``KIND@STEP[/RANK][:NAME=VALUE,...]`` strings.
        steps: ``train.steps`` (a fault after the last step never fires).
        interval: ``checkpoint.interval`` (a fault that fires in a checkpoint needs a checkpoint
            step).
        world_size: Workers of the job at most (nodes MAX x processes per node), when known: a
            fault aimed at a rank beyond it never fires.
    """
    parsed = []
    for text in texts:
        f = parse_fault(text)
        name = f.kind.name
        if f.step > steps:
            raise UserError("faults", f"{name}@{f.step} is after the last step ({steps})")
        if f.kind.when is When.CHECKPOINT and (not interval or f.step % interval):
            raise UserError("faults", f"{name}@{f.step} needs a checkpoint step "
                            f"(a multiple of checkpoint.interval={interval})")
        if world_size is not None and f.rank >= world_size:
            raise UserError("faults", f"{text.strip()!r} aims at rank {f.rank} but the job has "
                            f"{world_size} worker(s) (ranks 0-{world_size - 1})")
        parsed.append(f)
    return parsed


_Documented = TypeVar("_Documented", bound=Callable[..., object])


def with_fault_kinds(fn: _Documented) -> _Documented:
    """Writes the registered kinds' names where ``fn``'s docstring says ``{fault_kinds}``.

    For the KFP component and pipelines, whose docstrings become the parameter descriptions a
    user reads in the Kubeflow UI (``kfp-nvrx compile`` writes them into the compiled YAML).
    """
    if fn.__doc__:
        fn.__doc__ = fn.__doc__.replace("{fault_kinds}", FAULT_KINDS.listing())
    return fn
