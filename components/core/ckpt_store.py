"""The checkpoint-store interface: where a run's checkpoints live, and the one newest-intact pick.

Every module that lists, picks, opens, commits or prunes checkpoints goes through a store; only
the stores know their layout. Two tiers implement it:

* :class:`CheckpointStore`, the durable tier, one per run dir: the volume store
  (:mod:`.volume_store`, a POSIX path: local disk or FSx) is the one registered today;
* :class:`StepStore`, what every tier offers (the durable one and the host-memory tier of the
  trainer, :mod:`kfp_nvrx.components.training.checkpoint.host_tier`): list what it holds, tell
  what is wrong with a step, withdraw newer steps, prune.

:func:`newest_intact` is the only function that picks "the newest intact committed step" (resume,
export, the resume checks). Another durable store (e.g. S3) is one module implementing
:class:`CheckpointStore` plus one line in :data:`.store_kinds._FACTORIES` (or a
:func:`.store_kinds.register_store` call); the trainer's DCP readers and synchronous writers come
from the store's :meth:`CheckpointStore.location` (:mod:`kfp_nvrx.components.training.checkpoint.
dcp_io`: a URL gets DCP's fsspec ones), and its asynchronous writes go to the store's
:meth:`CheckpointStore.spool`, which the store seals (:meth:`CheckpointStore.seal_files`, in the
writer process) and commits: saves stay asynchronous whatever the store
(``tests/unit/test_store_async.py`` shows it with a fake object store).
Imports no torch.

A run picks its store with the config key ``checkpoint.store`` (:data:`.store_kinds.STORE_KEY`,
checked against :func:`.store_kinds.store_kinds`); its first start records it in the run's
``config.yaml``, and :func:`open_store` without a kind opens the store that record names
(:mod:`.recorded_config`), so readers that have no config in hand (export, the local agent) open
the run's own store. Below the run record (:mod:`.run_record`), which checks a resume through it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# The default store loads with the opener, not at a run's first open: a by-name import in the
# middle of a check meets a half-made module when that check re-enters (tests/integration/test_ownership.py
# runs a second rank's check inside every file-system call of the first).
from kfp_nvrx.components.core import volume_store  # noqa: F401
from kfp_nvrx.components.core.recorded_config import read_recorded_config
from kfp_nvrx.components.core.store_kinds import (
    DEFAULT_KIND,
    STORE_KEY,
    StrPath,
    check_kind,
    factory,
)


class StepStore(Protocol):
    """What every checkpoint tier offers: the steps it holds, their problems, withdrawal."""

    kind: str

    def committed_steps(self) -> list[int]:
        """Steps held complete (committed), newest first; not yet checked (:meth:`problem`)."""
        ...

    def problem(self, step: int, share: tuple[int, int] = (0, 1), crc: bool = True) -> str | None:
        """What is wrong with ``step`` (None: intact); ``share`` splits a CRC check over ranks."""
        ...

    def withdraw_newer(self, step: int) -> tuple[list[int], str | None]:
        """Takes the steps newer than ``step`` out for good; returns them and where they went."""
        ...

    def prune(self, keep: int) -> None:
        """Keeps the newest ``keep`` committed steps; drops older ones (only what we created)."""
        ...


class CheckpointStore(StepStore, Protocol):
    """The durable tier of one run: a volume (POSIX path) today, an object store tomorrow.

    Attributes:
        kind: The registry key (``volume``).
        where: Where the checkpoints are, as messages name it (a path, a URL).
        progress_file: The local file ft_launcher reads the newest committed step from.
    """

    where: str
    progress_file: Path

    def entries(self) -> list[int]:
        """Every step with an entry, committed or torn, oldest first (for messages)."""
        ...

    def name(self, step: int) -> str:
        """The entry of ``step`` as messages name it (e.g. ``step_00000040``)."""
        ...

    def location(self, step: int) -> str:
        """Where DCP reads and writes ``step`` (a path for the volume, a URL for others)."""
        ...

    def record(self, step: int) -> dict[str, Any] | None:
        """The commit record of ``step``; None when torn (raises ValueError when unreadable)."""
        ...

    def begin(self, step: int) -> str:
        """An empty entry for a new save of ``step`` (rank 0; a torn leftover goes); its location."""
        ...

    def seal_rank(self, step: int, rank: int) -> None:
        """Records the checksums of ``rank``'s files of ``step`` (a synchronous save)."""
        ...

    def spool(self, step: int) -> str:
        """The local folder an asynchronous save writes ``step``'s files into (every rank).

        NVRx's writer writes to a file system; the store takes the files from here in
        :meth:`seal_files` and :meth:`commit` (the volume: the step's own folder, nothing moves;
        an object store: a node-local folder it uploads from).
        """
        ...

    def seal_files(self, step: int, rank: int, files: list[str]) -> None:
        """Takes ``rank``'s files of ``step`` from the spool once written (NVRx's writer process).

        Runs in the writer process, beside training, so it may take its time (an upload); it
        gets a pickled copy of the store. The volume records the files' checksums.
        """
        ...

    def commit(self, step: int, world_size: int) -> int:
        """Commits ``step`` once every rank wrote it (rank 0); returns its size in bytes.

        After an asynchronous save the coordinator's ``.metadata`` is in the :meth:`spool`.
        """
        ...

    def record_progress(self, step: int) -> None:
        """Tells ft_launcher's progress tracking that ``step`` is the run's recovery point."""
        ...

    def finish_withdraw(self) -> None:
        """Completes a :meth:`withdraw_newer` a crash interrupted (rank 0, before listing)."""
        ...


def recorded_kind(run_dir: StrPath) -> str:
    """The store kind the run in ``run_dir`` records (``checkpoint.store`` in its config.yaml).

    :data:`DEFAULT_KIND` when there is no record yet (a fresh run dir; its first start passes
    its config's kind instead) or the record predates the key (every such run used the volume).

    Raises:
        UserError: Naming ``run_dir`` when the record exists but cannot be read.
    """
    recorded = read_recorded_config(Path(run_dir)) or {}
    return str(recorded.get(STORE_KEY, DEFAULT_KIND))


def open_store(run_dir: StrPath, kind: str | None = None) -> CheckpointStore:
    """The durable checkpoint store of the run in ``run_dir``.

    Args:
        run_dir: The run directory.
        kind: The store kind (the caller's resolved ``checkpoint.store``); None: the kind the
            run's record names (:func:`recorded_kind`), read once here.

    Raises:
        UserError: Naming ``checkpoint.store`` when no store of that kind is registered.
    """
    source = ""
    if kind is None:
        kind, source = recorded_kind(run_dir), f" (recorded in {run_dir}'s config.yaml)"
    made = factory(check_kind(kind, source))
    if isinstance(made, str):  # "module:attribute" (the volume store's module is loaded above)
        module, _, attribute = made.partition(":")
        made = getattr(importlib.import_module(module), attribute)
    store: CheckpointStore = made(run_dir)
    return store


@dataclass
class Pick:
    """What :func:`newest_intact` found.

    Attributes:
        step: The newest intact step (None: none is).
        damaged: The newer steps skipped, with what is wrong with each, newest first.
    """

    step: int | None = None
    damaged: list[tuple[int, str]] = field(default_factory=list)


def newest_intact(store: StepStore, steps: Iterable[int] | None = None, wanted: int = -1,
                  problem: Callable[[int], str | None] | None = None) -> Pick:
    """The newest intact committed step of ``store`` (or ``wanted``), and the damaged ones skipped.

    The one place that decides which step a resume, an export or a check takes.

    Args:
        store: The tier to pick from.
        steps: The candidates, newest first (default: ``store.committed_steps()``).
        wanted: Only this step (-1: any).
        problem: What is wrong with a step (default: ``store.problem``); a collective one lets
            ranks split the check; it may raise to refuse falling back.
    """
    check = problem if problem is not None else store.problem
    pick = Pick()
    for step in store.committed_steps() if steps is None else steps:
        if wanted >= 0 and step != wanted:
            continue
        bad = check(step)
        if bad is None:
            pick.step = step
            return pick
        pick.damaged.append((step, bad))
    return pick
