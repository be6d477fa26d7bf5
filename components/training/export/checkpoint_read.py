"""Which committed checkpoint an export reads, and reading its model tensors (one process, CPU).

A run that is still training commits new steps and prunes old ones while an export reads: the
checkpoint picked as the newest can be deleted under the reader. That is no fault of the user:
:func:`read_newest` picks the newest again and reads that one. Errors name ``step`` only when the
user named one; otherwise the run dir (``run_dir``) is what they gave.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.ckpt_store import CheckpointStore, newest_intact, open_store
from kfp_nvrx.components.errors import UserError

MODEL_PREFIX = "model."
#: Times the newest checkpoint is picked again after it was pruned while read (a live run).
READ_ATTEMPTS = 3


@dataclass(frozen=True)
class Checkpoint:
    """One step of a run's checkpoint store, its commit record and what is wrong with it, if anything.

    ``commit`` is None for a torn checkpoint (no record: crashed or still being written);
    ``problem`` is set when a committed checkpoint's files no longer match its record.
    ``name`` is how messages name it (``step_00000040``), ``location`` where DCP reads it.
    """

    step: int
    name: str
    location: str
    commit: dict[str, Any] | None
    problem: str | None = None

    @property
    def committed(self) -> bool:
        """Whether the checkpoint is complete, intact and may be loaded."""
        return self.commit is not None and self.problem is None


def _inspect(store: CheckpointStore, step: int) -> Checkpoint:
    name, location = store.name(step), store.location(step)
    try:
        commit = store.record(step)
    except ValueError as err:
        return Checkpoint(step, name, location, {}, str(err))
    if commit is None:
        return Checkpoint(step, name, location, None)
    # The one check trainer and drills use.
    return Checkpoint(step, name, location, commit, store.problem(step))


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Checkpoint]:
    """Return every step entry of the run's checkpoint store, committed or torn, oldest first."""
    store = open_store(run_dir)
    return [_inspect(store, step) for step in store.entries()]


def _pick_named(ckpts: list[Checkpoint], step: int, run_dir: str | os.PathLike[str],
                steps: str) -> Checkpoint:
    """The checkpoint at ``step`` when it is committed; else the error naming ``step``."""
    for c in ckpts:
        if c.step != step:
            continue
        if c.committed:
            return c
        why = c.problem or "not committed (torn or still being written)"
        raise UserError("step", f"checkpoint {c.name} is {why}; committed steps: {steps}")
    raise UserError("step", f"no checkpoint for step {step} in {run_dir}; committed: {steps}")


def select_checkpoint(run_dir: str | os.PathLike[str], step: int | None = None,
                      log: Callable[[str], None] | None = None) -> Checkpoint:
    """Pick the newest intact committed checkpoint, or the one at ``step``.

    Raises:
        UserError: ``step`` when that checkpoint is missing, torn or damaged; ``run_dir`` when
            there is no intact committed checkpoint at all.

    """
    store = open_store(run_dir)
    ckpts = list_checkpoints(run_dir)
    steps = ", ".join(str(c.step) for c in ckpts if c.committed) or "none"
    if step is not None:
        return _pick_named(ckpts, step, run_dir, steps)
    by_step = {c.step: c for c in ckpts}
    recorded = [c.step for c in reversed(ckpts) if c.commit is not None]
    pick = newest_intact(store, recorded, problem=lambda s: by_step[s].problem)
    for bad, problem in reversed(pick.damaged):
        (log or (lambda _m: None))(f"skipping damaged checkpoint {by_step[bad].name}: {problem}")
    if pick.step is None:
        raise UserError("run_dir", f"no committed checkpoint under {store.where}")
    return by_step[pick.step]


def model_tensors(ckpt_dir: str | os.PathLike[str], field: str = "step") -> dict[str, Any]:
    """Empty full-size tensors for the ``model.*`` entries of a DCP checkpoint (metadata only).

    Their sizes say how many bytes the export will write before any tensor is read.

    Raises:
        UserError: Naming ``field`` when the metadata cannot be read or lists no model tensors.
    """
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from kfp_nvrx.components.training.checkpoint.dcp_io import read_metadata

    path = str(ckpt_dir)
    try:
        metadata = read_metadata(path)
    except Exception as err:  # noqa: BLE001 - any read/unpickle failure means a bad checkpoint
        raise UserError(field, f"cannot read DCP metadata of {path}: {err}") from None
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise UserError(field, f"{path} holds no '{MODEL_PREFIX}*' tensors")
    return state


def _why(err: BaseException) -> str:
    """What went wrong, without the tracebacks a CheckpointException's text carries."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        return f"{type(inner).__name__}: {inner}"
    return str(err)


def read_into(state: dict[str, Any], ckpt_dir: str | os.PathLike[str],
              field: str = "step") -> dict[str, Any]:
    """Loads the checkpoint's tensors into ``state``; returns them with ``model.`` stripped.

    Raises:
        UserError: Naming ``field`` when the tensors cannot be read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from kfp_nvrx.components.training.checkpoint.dcp_io import storage_reader

    path = str(ckpt_dir)
    try:
        with warnings.catch_warnings():
            # "torch.distributed is disabled ... assuming ... a single process": the intent here.
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load(state, storage_reader=storage_reader(path), no_dist=True)
    # CheckpointException (a file gone mid-read) derives from BaseException, not Exception.
    except (Exception, CheckpointException) as err:  # noqa: BLE001
        msg = " ".join(_why(err).split())[:300]
        raise UserError(field, f"cannot load model tensors from {path}: {msg}") from None
    return {key[len(MODEL_PREFIX):]: t.contiguous() for key, t in state.items()}


def load_model_state(ckpt_dir: str | os.PathLike[str], field: str = "step") -> dict[str, Any]:
    """Read the ``model.*`` tensors of a DCP checkpoint, full-size, on CPU, without a process group.

    Returns:
        ``{fqn: tensor}`` with the ``model.`` prefix stripped.

    Raises:
        UserError: (``field``) when the checkpoint cannot be read or holds no model tensors.

    """
    return read_into(model_tensors(ckpt_dir, field), ckpt_dir, field)


def _unchanged(run_dir: Path, ckpt: Checkpoint) -> bool:
    """Whether ``ckpt`` is still in the store under the record it was picked with (not pruned)."""
    try:
        return open_store(run_dir).record(ckpt.step) == ckpt.commit
    except (OSError, ValueError):
        return False


def read_newest(run_dir: Path, step: int | None,
                before_read: Callable[[Checkpoint, dict[str, Any]], None],
                log: Callable[[str], None], first: Checkpoint | None = None
                ) -> tuple[Checkpoint, dict[str, Any]]:
    """(checkpoint, its model tensors): the one at ``step``, else the newest committed one.

    ``first``: the checkpoint :func:`select_checkpoint` already picked (not picked again).

    ``before_read(ckpt, empty_tensors)`` runs between the metadata and the tensors (the export
    checks its room there). A checkpoint pruned while it was read (the run is still training)
    is not the user's error: the newest is picked again, :data:`READ_ATTEMPTS` times at most.

    Raises:
        UserError: ``step`` when it was given and cannot be read (or was pruned meanwhile);
            ``run_dir`` otherwise.
    """
    field = "run_dir" if step is None else "step"
    for attempt in range(READ_ATTEMPTS):
        ckpt = first if attempt == 0 and first else select_checkpoint(run_dir, step, log)
        try:
            state = model_tensors(ckpt.location, field)
            before_read(ckpt, state)
            return ckpt, read_into(state, ckpt.location, field)
        except UserError as err:
            if _unchanged(run_dir, ckpt) or err.field != field:
                raise
            if step is not None:
                raise UserError("step", f"checkpoint {ckpt.name} was removed while it was "
                                "read (the run is still training and pruned it); export a newer "
                                "step, or leave out the step for the newest") from None
            if attempt + 1 == READ_ATTEMPTS:
                raise UserError("run_dir", f"the newest checkpoint of {run_dir} was removed "
                                f"while it was read, {READ_ATTEMPTS} times (the run is "
                                "training and pruning fast); try again or once it ends") from None
            log(f"{ckpt.name} was removed while it was read (the run is still training); "
                "reading the newest committed checkpoint again")
    raise AssertionError("unreachable")
