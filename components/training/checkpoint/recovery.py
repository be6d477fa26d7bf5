"""Where a start resumes from: the host-memory tier, or the newest intact step of the store.

A start (the first, or a restart of any layer) agrees on one state for every rank: the newest
snapshot every rank holds complete in the host-memory tier (:mod:`.host_tier`) when it is at
least as new as the newest committed checkpoint of the run's store
(:mod:`kfp_nvrx.components.core.ckpt_store`), else that checkpoint, checked by CRC32 (falling back
to older ones: :func:`~kfp_nvrx.components.core.ckpt_store.newest_intact`).
``checkpoint.load_step`` pins a launch's first start only and withdraws the newer steps from both
tiers (the store's ``withdraw_newer``). Every public method is collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element

from kfp_nvrx.components.core.ckpt_store import CheckpointStore, newest_intact, open_store
from kfp_nvrx.components.core.config import CheckpointConfig
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.checkpoint import dcp_io
from kfp_nvrx.components.training.checkpoint.host_tier import HostTier
from kfp_nvrx.components.training.checkpoint.peers import Peers
from kfp_nvrx.components.training.checkpoint.staging import HostStaging, SnapshotDamaged
from kfp_nvrx.components.training.ranks import all_ranks, from_rank0, gather


class Recovery:
    """Finds and loads the state one incarnation resumes from.

    Args:
        store: The run's checkpoint store (the durable tier), or its run dir (its store is opened).
        cfg: The ``checkpoint`` config section.
        device: The training device.
        staging: The process's staging banks (None: no host-memory tier).
        log: Where one-line notices go.
        peers: The peer nodes holding copies of this rank's snapshots (None: none).
    """

    def __init__(self, store: CheckpointStore | str | os.PathLike[str], cfg: CheckpointConfig,
                 device: torch.device, staging: HostStaging | None,
                 log: Callable[[str], None], peers: Peers | None = None) -> None:
        self.store = (open_store(store, cfg.store) if isinstance(store, (str, os.PathLike))
                      else store)
        self.cfg = cfg
        self.device = device
        self.memory = HostTier(staging) if staging is not None else None
        self.log = log
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.peers = peers
        self.restored_from_memory = False
        self.sources: list[str] | None = None  # where each rank's state came from, last resume
        self.durable: list[int] = []  # the store's commits the last resume saw, newest first
        self._loaded: dict[str, Any] | None = None

    def without_banks(self) -> None:
        """The banks are gone (unavailable on some rank): nothing is restored from memory."""
        self.memory = self.peers = None

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
        ``checkpoint.load_step`` pins the ``first_start`` of a launch only to that durable step,
        read from the store (and withdraws the steps after it, :meth:`_timeline`); restarts take
        the newest.
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
        self.durable = steps  # the store's commits this start sees, newest first
        newest = steps[0] if steps else None
        fetched = self._from_peers(newest) if not pinned else None
        # checkpoint.load_step names a durable step: it is read from the store, never memory.
        memory = [] if pinned else [m for m in self.memory_steps() if newest is None or m >= newest]
        if not memory:
            self._forget_memory()
        state = None
        if memory:
            state = state_fn()
            for held in memory:
                if self._load_memory(held, state, check, newest):
                    self._said(held, fetched)
                    return held, self._loaded
            self._forget_memory()
        step = self.select(steps, log=self.log) if steps else None
        if step is None:
            # A fresh start. state_fn is called only once a step is known to load: building the
            # state initialises the optimizer's (DCP steps it once), which a fresh start must
            # not inherit (its weights would differ from a run that never failed).
            self.sources = None
            return None, None
        state = self._only_stored(state if state is not None else state_fn(), step, check)
        dcp_io.load(self.store, step, state)
        self.sources = ["volume"] * self.world_size
        return step, state

    def _from_peers(self, newest: int | None) -> int | None:
        """Ranks that lost their snapshots fetch them from the peers holding copies (collective).

        Returns:
            The step fetched for (None: nobody needed a peer).
        """
        if self.peers is None or self.memory is None:
            return None
        return self.peers.restore(self.memory.committed_steps(), newest, self.log)

    def _said(self, step: int, fetched: int | None) -> None:
        """Where each rank's state of ``step`` came from: its own host memory, or a peer's."""
        peers = self.peers.fetched if self.peers is not None and fetched == step else []
        self.sources = ["peer" if r in peers else "memory" for r in range(self.world_size)]

    def _timeline(self, first_start: bool) -> tuple[list[int], bool]:
        """Committed steps as rank 0 sees them, and whether ``load_step`` pins this start.

        Rank 0 finishes an interrupted rollback first. A pinned start in a run dir with newer
        commits rolls back: every rank withdraws its newer host-memory snapshots, then rank 0
        moves the newer commits out of the timeline (in that order: a crash in between leaves
        no snapshot of the abandoned timeline for a later restart to take).
        """
        out: list[Any] = [None, None]
        if self.rank == 0:
            self.store.finish_withdraw()
            out = [self.store.committed_steps(), first_start and self.cfg.load_step >= 0]
        steps, pinned = from_rank0(out)
        want = self.cfg.load_step
        if pinned and any(s > want for s in steps):
            if self.memory is not None:
                self.memory.withdraw_newer(want)
            dist.barrier()
            if self.rank == 0:
                moved, into = self.store.withdraw_newer(want)
                self.log(f"checkpoint.load_step={want}: steps {', '.join(map(str, moved))} "
                         f"leave this run's timeline (kept in {into}; delete it when they are "
                         "not needed)")
        return [s for s in steps if not pinned or s == want], bool(pinned)

    def _forget_memory(self) -> None:
        """Nothing in host memory is taken: a later restart must not take it either."""
        if self.memory is not None:
            self.memory.prune(0)

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
        memory = self.memory
        if memory is None:  # no host-memory tier: memory_steps() found nothing to agree on
            return False
        flat, mapping = flatten_state_dict(state)
        if not all_ranks(memory.fits(step, flat), self.device):
            return False
        state = self._only_stored(state, step, check)
        flat, mapping = flatten_state_dict(state)
        problem = ""
        try:
            leaves = memory.read_into(flat, step)
        except SnapshotDamaged as err:
            problem = str(err)
            memory.drop(step)
        if not all_ranks(not problem, self.device):
            self.log(f"step {step} in host memory is damaged ({problem or 'on another rank'}); "
                     "loading from disk")
            return False
        for key, value in leaves.items():
            set_element(state, mapping[key], value)
        if newest is None or step > newest:
            self.log(f"restoring step {step} from host memory (newest committed on disk: {newest})")
            if self.rank == 0:  # FT: ft_launcher's progress tracking: the run's recovery point
                self.store.record_progress(step)
        self.restored_from_memory, self._loaded = True, state
        return True

    def committed(self) -> list[int]:
        """Committed steps, newest first, as rank 0 sees them (collective)."""
        return from_rank0(self.store.committed_steps() if self.rank == 0 else None)

    def select(self, steps: list[int] | None = None,
               log: Callable[[str], None] = print) -> int | None:
        """The newest intact committed step (or ``load_step``), the same on every rank.

        Every rank checks the sizes and the CRC32 of its share of the files; a damaged checkpoint
        is skipped in favour of the next older one, logged once that one is known: one line per
        damaged step, naming the file, what is wrong with it and the step used instead.
        """
        pick = newest_intact(self.store, self.committed() if steps is None else steps,
                             problem=self._problem_on_every_rank)
        instead = (f"falling back to step {pick.step}" if pick.step is not None
                   else "no older intact checkpoint to fall back to")
        for step, bad in pick.damaged:
            log(f"checkpoint step {step} is damaged: {bad}; {instead}")
        return pick.step

    def _problem_on_every_rank(self, step: int) -> str | None:
        """The first rank's problem with ``step``, each rank checking its share of the CRC32s.

        Raises:
            UserError: ``checkpoint.load_step`` is set (no fallback, no start from scratch).
        """
        problem = self.store.problem(step, share=(self.rank, self.world_size))
        bad = next((p for p in gather(problem, self.world_size) if p), None)
        if bad is not None and self.cfg.load_step >= 0:
            raise UserError("checkpoint.load_step", f"step {step} is damaged: {bad}; give "
                            "another step, or -1 for the newest intact one")
        return bad

    def load(self, step: int, state: dict[str, Any]) -> None:
        """Loads ``step`` into ``state`` in place (collective).

        From host memory when every rank holds that snapshot (CRC-checked), else from the files
        (DCP reshards to this world size).
        """
        self.restored_from_memory = False
        if self.memory is None or not (step in self.memory_steps()
                                        and self._load_memory(step, state, None, step)):
            dcp_io.load(self.store, step, state)

    def memory_steps(self, pinned: bool = False) -> list[int]:
        """Steps of the snapshots every rank holds complete in host memory, newest first.

        Collective. After an in-process restart a snapshot can be newer than the newest
        committed checkpoint (a save whose copies completed on every rank but whose write the
        fault interrupted); after an in-job restart the sealed banks an earlier worker left on
        this node. ``pinned``: only ``checkpoint.load_step``.
        """
        mine = self.memory.committed_steps() if self.memory is not None else []
        if pinned:
            mine = [s for s in mine if s == self.cfg.load_step]
        every = gather(mine, self.world_size)
        common = set(every[0]).intersection(*every[1:])
        return sorted(common, reverse=True)

    def metadata_keys(self, step: int) -> set[str]:
        """Flattened keys stored in a checkpoint (e.g. to skip per-rank RNG of another world size)."""
        if self.memory is not None and step in self.memory.committed_steps():
            return self.memory.keys(step)
        md = dcp_io.read_metadata(self.store.location(step))
        return set(md.state_dict_metadata)

