"""The host-memory tier behind the checkpoint-store interface: what the staging banks hold.

The banks (:mod:`.staging`) keep the newest snapshots of this rank in host memory, as files under
``/dev/shm`` described by JSON manifests (:mod:`.hostcopy`). As a
:class:`~kfp_nvrx.components.core.ckpt_store.StepStore` this tier lists the steps it holds, says
whether it holds one, withdraws newer ones (a ``checkpoint.load_step`` rollback) and prunes
(withdraws the manifests a start does not take); it opens a step for reading by copying a bank
into a state (:meth:`HostTier.read_into`, every piece CRC32-checked). :mod:`.recovery` agrees on a
step across ranks and picks between this tier and the durable store.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Callable
from typing import Any

import torch

from kfp_nvrx.components.training.checkpoint.bank import (
    StagingUnavailable,
    _Bank,
    _local,
    _slot_rows,
    layout_of,
)
from kfp_nvrx.components.training.checkpoint.hostcopy import HostCopyUnavailable, decode_objects
from kfp_nvrx.components.training.checkpoint.integrity import BackgroundCheck, SnapshotDamaged
from kfp_nvrx.components.training.checkpoint.restore import restore_bounced
from kfp_nvrx.components.training.checkpoint.staging import HostStaging


class HostTier:
    """This rank's snapshots in host memory (a :class:`~.ckpt_store.StepStore`).

    Args:
        staging: The worker process's staging banks.
    """

    kind = "host-memory"

    def __init__(self, staging: HostStaging) -> None:
        self.staging = staging

    # ------------------------------------------------------------------ listing
    def committed_steps(self) -> list[int]:
        """Steps of the complete snapshots this rank could restore, newest first.

        This process's own banks (an in-process restart), or else the sealed snapshots an
        earlier worker of this run left on this node (an in-job restart), as their manifests
        describe them.
        """
        st = self.staging
        if st.banks:
            return sorted({b.step for b in st.banks if b.step is not None}, reverse=True)
        return [m["step"] for m in st.home.snapshots()]

    def problem(self, step: int, share: tuple[int, int] = (0, 1), crc: bool = True) -> str | None:
        """None when this rank holds ``step`` (its CRC32s are checked as it is read)."""
        return None if step in self.committed_steps() else f"step {step} is not in host memory"

    def keys(self, step: int | None = None) -> set[str]:
        """The flattened keys of the snapshot of ``step`` (as a DCP checkpoint's metadata lists)."""
        st = self.staging
        bank = st._holding(step if step is not None else st.valid_step)
        return set(st.slots) | set(bank.objects if bank is not None else {})

    # ------------------------------------------------------------------ withdrawing
    def withdraw_newer(self, step: int) -> tuple[list[int], str | None]:
        """Withdraws the described snapshots newer than ``step`` (a rollback's abandoned ones)."""
        return self._withdraw(lambda s, _i: s > step), None

    def prune(self, keep: int) -> None:
        """Withdraws the described snapshots but the newest ``keep`` (a start that takes none).

        A later restart must never take them: they are older than what this start loads. Only
        the manifests of an earlier worker go, and only while this process holds no banks.
        """
        self._withdraw(lambda _s, i: i >= keep)

    def _withdraw(self, which: Callable[[int, int], bool]) -> list[int]:
        """Withdraws the described snapshots ``which(step, index)`` picks (index 0: newest)."""
        st = self.staging
        if st.banks:
            return []
        gone = []
        for i, m in enumerate(st.home.snapshots()):
            if which(m["step"], i):
                st.home.withdraw(m["bank"])
                gone.append(m["step"])
        # The files stay: the background allocation reuses or deletes them (freeing 13 GB of
        # tmpfs takes a second, which a restart's load must not wait for).
        return gone

    def drop(self, step: int) -> None:
        """The bank holding ``step`` is damaged: it is never restored, described or kept again."""
        st = self.staging
        bank = st._holding(step)
        if bank is not None:
            st.sealer.unseal(bank, st.banks)
            bank.step, bank.objects = None, {}
            if st.committed is bank:
                st.committed = None

    # ------------------------------------------------------------------ reading
    def fits(self, step: int, flat: dict[str, Any]) -> bool:
        """Whether ``flat`` can be filled from ``step`` (adopting an earlier worker's bank)."""
        st = self.staging
        adopted = self.adopt(step, flat) if not st.banks else True
        return adopted and self.can_restore(flat, step)

    def can_restore(self, flat: dict[str, Any], step: int) -> bool:
        """Whether ``flat`` can be filled from the bank holding ``step`` (same layout)."""
        st = self.staging
        bank = st._holding(step)
        if bank is None or bank.buffer is None:
            return False
        want = layout_of({k: v for k, v in flat.items() if isinstance(v, torch.Tensor)})
        return (all(st.slots.get(k) is not None and st.slots[k].shape == s.shape
                    and st.slots[k].dtype == s.dtype for k, s in want.items())
                and all(k in bank.objects or k in st.slots for k in flat))

    def read_into(self, flat: dict[str, Any], step: int | None = None) -> dict[str, Any]:
        """Copies the bank of ``step`` into ``flat``'s tensors (in place); returns the other leaves.

        The bank's bytes are checked against its CRC32s (when it is sealed) while they are copied.

        Raises:
            SnapshotDamaged: The bank changed since its snapshot was complete (``flat``'s tensors
                then hold some of its bytes: load them from elsewhere).
        """
        st = self.staging
        bank = st._holding(step if step is not None else st.valid_step)
        if bank is None or bank.buffer is None:
            raise SnapshotDamaged(f"no bank holds step {step}")
        if st.cuda and not bank.pinned:  # adopted, not pinned yet: through bounce buffers
            restore_bounced(bank.buffer, st.slots, st.nbytes, flat, expected=bank.crc32)
        else:
            check = (BackgroundCheck(bank.buffer, bank.crc32, st.sealer.pool())
                     if bank.crc32 is not None else None)
            with torch.no_grad():
                for key, value in flat.items():
                    if isinstance(value, torch.Tensor):
                        dst = _local(value)
                        dst.copy_(st.view(key, bank), non_blocking=dst.is_cuda)
            if st.cuda:
                torch.cuda.current_stream(st.device).synchronize()
            if check is not None:
                check.result()  # raises SnapshotDamaged
        return {k: copy.deepcopy(v) for k, v in bank.objects.items() if k in flat}

    def adopt(self, step: int, flat: dict[str, Any]) -> bool:
        """Takes over an earlier worker's sealed bank holding ``step`` (in-job restart).

        Only when this rank's manifest describes that step of this run, rank and world size, and
        exactly ``flat``'s layout; the bank is mapped (not pinned) as this process's kept bank,
        with the CRC32s the restore checks.
        """
        st = self.staging
        if st.banks:
            return False
        manifest = next((m for m in st.home.snapshots() if m["step"] == step), None)
        if manifest is None or _slot_rows(layout_of(flat)) != manifest["slots"]:
            return False
        try:  # mapped, not pinned: read_into() copies through bounce buffers, prepare() pins
            objects = decode_objects(manifest["objects"])
            crcs = [[int(o), int(n), int(c)] for o, n, c in manifest["crc32"]]
            st.home.ensure()
            bank = _Bank(int(manifest["bank"]), st.home.bank_path(int(manifest["bank"])))
            bank.map(int(manifest["nbytes"]), create=False)
        except (OSError, KeyError, TypeError, ValueError, StagingUnavailable, HostCopyUnavailable):
            return False
        self._take(bank, manifest, flat)
        bank.step, bank.objects, bank.crc32 = step, objects, crcs
        st.adopted_step = st.sealer.sealed_step = step
        for other in st.home.snapshots():  # older: never taken again (its file is reused by
            if other["bank"] != bank.index:  # the background allocation, not deleted here)
                st.home.withdraw(other["bank"])
        return True

    def _take(self, bank: _Bank, manifest: dict[str, Any], flat: dict[str, Any]) -> None:
        """Makes ``bank`` the staging's only, committed bank, under a new layout key."""
        st = self.staging
        st.generation += 1
        digest = hashlib.sha1(repr(manifest["slots"]).encode()).hexdigest()
        st.layout_key = f"{os.getpid()}-{st.generation}-{digest[:16]}"
        bank.key = f"{st.layout_key}-{bank.index}"
        st.slots, st.nbytes = layout_of(flat), int(manifest["nbytes"])
        st.banks = [bank]
        st.committed = st.target = bank
