"""Where a start resumes from: host memory, or the newest intact committed checkpoint on disk.

A start (the first, or a restart of any layer) agrees on one state for every rank: the newest
snapshot every rank holds complete in its staging banks (:mod:`.staging`, :mod:`.hostcopy`) when
it is at least as new as the newest committed checkpoint, else that checkpoint, checked by CRC32
(falling back to older ones). ``checkpoint.load_step`` pins a launch's first start only and rolls
the run's timeline back to it (:mod:`kfp_nvrx.components.core.timeline`). Every public method is
collective.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element

from kfp_nvrx.components.core.config import CheckpointConfig
from kfp_nvrx.components.core.launch_command import iteration_file
from kfp_nvrx.components.core.rundir import (
    checkpoints_dir,
    committed_steps,
    step_dir,
    verify,
    write_atomic,
)
from kfp_nvrx.components.core.timeline import finish_rollback, roll_back
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.checkpoint.reader import load as fast_load
from kfp_nvrx.components.training.checkpoint.staging import HostStaging, SnapshotDamaged
from kfp_nvrx.components.training.ranks import all_ranks, from_rank0, gather


class Recovery:
    """Finds and loads the state one incarnation resumes from.

    Args:
        run_dir: The run directory.
        cfg: The ``checkpoint`` config section.
        device: The training device.
        staging: The process's staging banks (None: no host-memory tier).
        log: Where one-line notices go.
    """

    def __init__(self, run_dir: Path, cfg: CheckpointConfig, device: torch.device,
                 staging: HostStaging | None, log: Callable[[str], None]) -> None:
        self.run_dir = run_dir
        self.root = checkpoints_dir(run_dir)
        self.cfg = cfg
        self.device = device
        self.staging = staging
        self.log = log
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.restored_from_memory = False
        self._loaded: dict[str, Any] | None = None

    def resume(self, state_fn: Callable[[], dict[str, Any]],
               check: Callable[[set[str], int], None] | None = None, first_start: bool = True,
               ) -> tuple[int | None, dict[str, Any] | None]:
        """Loads the newest state this run can resume from; ``(None, None)`` when there is none.

        The newest snapshot every rank holds complete in host memory, when it is at least as new
        as the newest committed checkpoint: this process's own banks after an in-process
        restart, the sealed banks an earlier worker left on this node after an in-job one (see
        :mod:`.hostcopy`), even when that save's write is still in flight or was cut by the
        fault. The ranks agree on the step first, and each checks its bank's CRC32s as it loads;
        a mismatch on any rank sends every rank on, never to a mixed state. Otherwise the newest
        intact committed checkpoint on disk (CRC-checked, falling back to older ones).
        ``checkpoint.load_step`` pins the ``first_start`` of a launch only (and abandons the
        commits after it, :mod:`kfp_nvrx.components.core.timeline`); restarts take the newest.
        ``state_fn`` builds the state to load into; only the keys the checkpoint holds are
        loaded (e.g. not another world size's per-rank RNG). ``check(keys, step)`` may reject
        the checkpoint before anything is loaded.

        Args:
            state_fn: Builds the state dict to load into.
            check: Rejects a checkpoint by its keys (raises).
            first_start: Rank 0's word that this is the launch's first start (broadcast).

        Returns:
            The step resumed from and the state dict loaded in place.
        """
        steps, pinned = self._timeline(first_start)
        newest = steps[0] if steps else None
        memory = [m for m in self.memory_steps(pinned) if newest is None or m >= newest]
        if not memory:
            self._forget_memory()
        if not memory and newest is None:
            return None, None  # (state_fn would initialise the optimizer state: a fresh start)
        state = state_fn()
        for held in memory:
            if self._load_memory(held, state, check, newest):
                return held, self._loaded
        self._forget_memory()
        step = self.select(steps, log=self.log)
        if step is None:
            return None, None
        state = self._only_stored(state, step, check)
        fast_load(state, str(step_dir(self.root, step)))
        return step, state

    def _timeline(self, first_start: bool) -> tuple[list[int], bool]:
        """Committed steps as rank 0 sees them, and whether ``load_step`` pins this start.

        Rank 0 finishes an interrupted rollback first. A pinned start in a run dir with newer
        commits rolls back: every rank withdraws its newer host-memory snapshots, then rank 0
        moves the newer commits out of the timeline (in that order: a crash in between leaves
        no snapshot of the abandoned timeline for a later restart to take).
        """
        out: list[Any] = [None, None]
        if self.rank == 0:
            finish_rollback(self.root)
            out = [committed_steps(self.root), first_start and self.cfg.load_step >= 0]
        steps, pinned = from_rank0(out)
        want = self.cfg.load_step
        if pinned and any(s > want for s in steps):
            if self.staging is not None:
                self.staging.forget(newer_than=want)
            dist.barrier()
            if self.rank == 0:
                moved, into = roll_back(self.root, want)
                self.log(f"checkpoint.load_step={want}: steps {', '.join(map(str, moved))} "
                         f"leave this run's timeline (kept in {into}; delete it when they are "
                         "not needed)")
        return [s for s in steps if not pinned or s == want], bool(pinned)

    def _forget_memory(self) -> None:
        """Nothing in host memory is taken: a later restart must not take it either."""
        if self.staging is not None:
            self.staging.forget()

    def _only_stored(self, state: dict[str, Any], step: int,
                     check: Callable[[set[str], int], None] | None) -> dict[str, Any]:
        keys = self.metadata_keys(step)
        if check is not None:
            check(keys, step)
        return {k: v for k, v in state.items()
                if any(s == k or s.startswith(f"{k}.") for s in keys)}

    def _load_memory(self, step: int, state: dict[str, Any],
                     check: Callable[[set[str], int], None] | None, newest: int | None) -> bool:
        """Loads ``step`` from every rank's bank (collective); False, and nothing taken, if any fails.

        Every rank adopts its bank (a new process) and checks it fits; then every rank copies it
        in, checking its CRC32s. ``self._loaded`` holds the state loaded.
        """
        staging = self.staging
        if staging is None:  # no host-memory tier: memory_steps() found nothing to agree on
            return False
        flat, mapping = flatten_state_dict(state)
        fits = staging.adopt(step, flat) if not staging.banks else True
        fits = fits and staging.can_restore(flat, step)
        if not all_ranks(fits, self.device):
            return False
        state = self._only_stored(state, step, check)
        flat, mapping = flatten_state_dict(state)
        problem = ""
        try:
            leaves = staging.restore(flat, step)
        except SnapshotDamaged as err:
            problem = str(err)
            staging.drop(step)
        if not all_ranks(not problem, self.device):
            self.log(f"step {step} in host memory is damaged ({problem or 'on another rank'}); "
                     "loading from disk")
            return False
        for key, value in leaves.items():
            set_element(state, mapping[key], value)
        if newest is None or step > newest:
            self.log(f"restoring step {step} from host memory (newest committed on disk: {newest})")
            if self.rank == 0:  # FT: ft_launcher's progress tracking: the run's recovery point
                write_atomic(iteration_file(self.run_dir), f"{step}\n".encode())
        self.restored_from_memory, self._loaded = True, state
        return True

    def committed(self) -> list[int]:
        """Committed steps, newest first, as rank 0 sees them (collective)."""
        return from_rank0(committed_steps(self.root) if self.rank == 0 else None)

    def select(self, steps: list[int] | None = None,
               log: Callable[[str], None] = print) -> int | None:
        """The newest intact committed step (or ``load_step``), the same on every rank.

        Every rank checks the sizes and the CRC32 of its share of the files; a damaged checkpoint
        is skipped in favour of the next older one, logged once that one is known: one line per
        damaged step, naming the file, what is wrong with it and the step used instead.
        """
        damaged: list[tuple[int, str]] = []
        found = None
        for step in self.committed() if steps is None else steps:
            problem = verify(step_dir(self.root, step), share=(self.rank, self.world_size))
            problems = gather(problem, self.world_size)
            bad = next((p for p in problems if p), None)
            if bad is None:
                found = step
                break
            if self.cfg.load_step >= 0:  # asked for this one: no fallback, no start from scratch
                raise UserError("checkpoint.load_step", f"step {step} is damaged: {bad}; give "
                                "another step, or -1 for the newest intact one")
            damaged.append((step, bad))
        instead = (f"falling back to step {found}" if found is not None
                   else "no older intact checkpoint to fall back to")
        for step, bad in damaged:
            log(f"checkpoint step {step} is damaged: {bad}; {instead}")
        return found

    def load(self, step: int, state: dict[str, Any]) -> None:
        """Loads ``step`` into ``state`` in place (collective).

        From host memory when every rank holds that snapshot (CRC-checked), else from the files
        (DCP reshards to this world size).
        """
        self.restored_from_memory = False
        if self.staging is None or not (step in self.memory_steps()
                                         and self._load_memory(step, state, None, step)):
            fast_load(state, str(step_dir(self.root, step)))

    def memory_steps(self, pinned: bool = False) -> list[int]:
        """Steps of the snapshots every rank holds complete in host memory, newest first.

        Collective. After an in-process restart a snapshot can be newer than the newest
        committed checkpoint (a save whose copies completed on every rank but whose write the
        fault interrupted); after an in-job restart the sealed banks an earlier worker left on
        this node. ``pinned``: only ``checkpoint.load_step``.
        """
        mine = self.staging.held_steps() if self.staging is not None else []
        if pinned:
            mine = [s for s in mine if s == self.cfg.load_step]
        every = gather(mine, self.world_size)
        common = set(every[0]).intersection(*every[1:])
        return sorted(common, reverse=True)

    def metadata_keys(self, step: int) -> set[str]:
        """Flattened keys stored in a checkpoint (e.g. to skip per-rank RNG of another world size)."""
        if self.staging is not None and step in self.staging.held_steps():
            return self.staging.keys(step)
        md = dcp.FileSystemReader(str(step_dir(self.root, step))).read_metadata()
        return set(md.state_dict_metadata)

