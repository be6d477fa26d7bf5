"""Figures and checks of one drill run, from its run directory and events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.events import Checkpoint, End, Event, Start
from kfp_nvrx.components.core.volume_store import VolumeStore


def starts(events: list[Event]) -> list[Start]:
    """The ``start`` events (one per incarnation / in-process iteration)."""
    return [e for e in events if isinstance(e, Start)]


def committed_steps_lost(events: list[Event],
                         seen: tuple[tuple[float, int], ...] = ()) -> int:
    """Committed progress thrown away: for every restart, newest commit so far - step resumed.

    0 when each restart resumed from the newest committed checkpoint; positive when it had to
    fall back (a damaged checkpoint) or started over. ``seen`` adds commits the drill saw on disk,
    as (time, step): a worker killed between writing a commit marker and logging its checkpoint
    event leaves a commit the events do not show.
    """
    lost, newest = 0, 0
    seen_start = False
    for e in events:
        if isinstance(e, Checkpoint):
            newest = max(newest, int(e.step))
        elif isinstance(e, Start):
            newest = max([newest, *(step for t, step in seen if t <= e.time)])
            if seen_start:
                lost += max(0, newest - int(e.resumed_from or 0))
            seen_start = True
    return lost


def completed(events: list[Event]) -> bool:
    """Whether the trainer logged a completed end."""
    return any(isinstance(e, End) and e.completed for e in events)


def run_dir_problems(run_dir: Path, skip: int | None = None) -> list[str]:
    """What is inconsistent: committed checkpoints that fail verification, leftover temp files.

    ``skip``: a committed step the drill damaged itself (its check is the scenario's own).
    """
    problems = []
    # The drills run on the local backend: the run's store is the volume one, whose files they
    # inspect (and damage) themselves.
    store = VolumeStore(run_dir)
    for step in store.committed_steps():
        if step == skip:
            continue
        problem = store.problem(step)
        if problem:
            problems.append(f"committed step {step}: {problem}")
    for tmp in run_dir.rglob("*.tmp"):
        # A worker SIGKILLed mid-save leaves its temp files in that torn step: it never commits
        # and the next start removes it, so a run that ends right there (ft_launcher gave up) may
        # hold one. A temp file anywhere else is a leak.
        if not store.torn_entry_holds(tmp):
            problems.append(f"temporary file left: {tmp.relative_to(run_dir)}")
    return problems


def final_weights(run_dir: Path, step: int) -> dict[str, Any] | None:
    """Model tensors of the committed checkpoint ``step``, or None when it is not committed."""
    from kfp_nvrx.components.training.export.consolidate import load_model_state

    store = VolumeStore(run_dir)
    if step not in store.committed_steps():
        return None
    return load_model_state(store.location(step))


def bitwise_equal(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Same keys, and every tensor equal bit for bit."""
    import torch

    if a is None or b is None or a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) for k in a)


