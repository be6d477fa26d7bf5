"""Host staging for async checkpoints: persistent pinned, shared banks that outlive the worker.

A save copies every tensor of the (flattened) state dict into a host buffer (a *bank*) that lives
as long as the worker process: a file under ``/dev/shm`` (see :mod:`.hostcopy`), so NVRx's
persistent writer process maps it and writes straight from it, and a restarted worker on the same
node can load from it; pinned (``cudaHostRegister``), so the device-to-host copies run at DMA
speed. On CUDA the copies are issued on a side stream:

* ``blocking``: ``save()`` waits for them (the visible stall is the D2H copy itself);
* ``overlap``: ``save()`` returns at once; the next step's forward/backward runs beside the copy and
  only the optimizer step waits for it, on the GPU (``wait_before_update``), never the CPU.

Two banks where ``/dev/shm`` has room: a save is staged into the bank that does *not* hold the
newest committed state, so that state stays in host memory while the next save is written. Once a
bank's copies are complete it is *sealed* in the background: the CRC32 of its pieces is taken and
its manifest published (:mod:`.hostcopy`). The banks restore an in-process restart (H2D, the
newest complete snapshot every rank holds) and an in-job restart on the same node (the newest
sealed snapshot every rank holds), even one whose write to the volume the fault interrupted,
instead of a read from disk; every restore checks the CRC32s. This module fills the banks; what
they hold is read, adopted and withdrawn through :class:`.host_tier.HostTier`, the host-memory
tier of the checkpoint-store interface.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kfp_nvrx.components.training.checkpoint.bank import (
    _ALIGN,
    SHM_RESERVE,
    Slot,
    StagingUnavailable,
    _Bank,
    _local,
    _pin_ranges,
    _slot_rows,
    flat_state,
    layout_of,
    shm_free_bytes,
)
from kfp_nvrx.components.training.checkpoint.gpu_waits import GpuWaits
from kfp_nvrx.components.training.checkpoint.hostcopy import HostCopyDir, HostCopyUnavailable
from kfp_nvrx.components.training.checkpoint.integrity import Sealer, SnapshotDamaged
from kfp_nvrx.components.training.checkpoint.snapshots import BUSY, PINNING

__all__ = ["HostStaging", "Slot", "SnapshotDamaged", "StagingUnavailable", "flat_state",
           "layout_of", "shm_free_bytes"]


class HostStaging:
    """The persistent staging banks of one worker process, reused by every save.

    Args:
        device: The training device (CUDA: pinned banks, copies on a side stream).
        home: This rank's host copy directory (None: a private one, never reused).
        banks: Banks at most (3: one being written, the newest snapshot, the next snapshot).
    """

    def __init__(self, device: torch.device, home: HostCopyDir | None = None,
                 banks: int = 3) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.home = home if home is not None else HostCopyDir(None, 0, 1)
        self.max_banks = max(1, banks)
        self.slots: dict[str, Slot] = {}
        self.nbytes = 0
        self.banks: list[_Bank] = []
        self.layout_key = ""  # layout + allocation identity (the save plan cache's key)
        self.generation = 0
        self.target: _Bank | None = None  # bank being staged, or staged last
        self.committed: _Bank | None = None  # bank holding the newest committed step
        self.writing: _Bank | None = None  # bank the writer process reads: never staged into
        self.replicating: _Bank | None = None  # bank a peer copy reads: never staged into
        self._peer_join: Callable[[float | None], None] | None = None
        self.staged_step: int | None = None
        self.adopted_step: int | None = None  # step adopted from an earlier worker's bank
        self._event: Any = None
        self._stream: Any = None
        self._prep: threading.Thread | None = None
        self._prep_error: BaseException | None = None
        self._notes: list[str] = []  # bank-ready lines for the loop thread to log
        self._lock = threading.Lock()
        self.sealer = Sealer(self.home, self._lock)
        # The loop's waits for the GPU: the background allocation pins in them (:mod:`.gpu_waits`).
        self.gpu_waits = GpuWaits()

    # ------------------------------------------------------------------ views of the banks
    @property
    def buffer(self) -> torch.Tensor | None:
        """The buffer of the bank staged last (else the first)."""
        bank = self.target or (self.banks[0] if self.banks else None)
        return bank.buffer if bank is not None else None

    @property
    def key(self) -> str:
        """The writer-side key of the bank staged last."""
        return self.target.key if self.target is not None else ""

    @property
    def valid_step(self) -> int | None:
        """The newest complete snapshot held in any bank."""
        steps = [b.step for b in self.banks if b.step is not None]
        return max(steps) if steps else None

    def _holding(self, step: int | None) -> _Bank | None:
        return next((b for b in self.banks if b.step is not None and b.step == step), None)

    # ------------------------------------------------------------------ allocation
    def prepare(self, state: dict[str, Any]) -> None:
        """Allocates (and pins) the banks for ``state``'s layout in a background thread.

        Pinning 10+ GB takes seconds; done here, no snapshot pays for it. Each bank is usable
        as soon as it is pinned (:meth:`free_bank`), so the first snapshot waits for one bank's
        pinning, not for all of them.
        """
        self._prepare(layout_of(flat_state(state)))

    def _prepare(self, slots: dict[str, Slot]) -> None:
        if self._complete(slots) or self.preparing():
            return
        self._prep_error = None
        self._prep = threading.Thread(target=self._allocate_quietly, args=(slots,), daemon=True,
                                      name="ckpt-staging-alloc")
        self._prep.start()

    def preparing(self) -> bool:
        """Whether the background allocation is still running (its steps are not steady)."""
        return self._prep is not None and self._prep.is_alive()

    def _allocate_quietly(self, slots: dict[str, Slot]) -> None:
        try:
            self._allocate(slots, self.gpu_waits)
        except BaseException as err:  # noqa: BLE001 - reported by the next ensure()
            self._prep_error = err

    def _join_prep(self) -> None:
        """Waits for the background allocation; raises what made the banks unavailable."""
        if self._prep is not None:
            self._prep.join()
            self._prep = None
        if self._prep_error is not None:
            err, self._prep_error = self._prep_error, None
            if isinstance(err, StagingUnavailable):
                raise err

    def ensure(self, flat: dict[str, Any]) -> None:
        """Every bank that fits ``flat``'s layout, allocated and pinned now (waits for :meth:`prepare`)."""
        self._join_prep()
        slots = layout_of(flat)
        if not self._complete(slots):
            self._allocate(slots)

    def why_not_now(self, flat: dict[str, Any]) -> str | None:
        """None when a snapshot of ``flat`` can be taken now without waiting; else why not.

        Never blocks: banks that are missing for this layout are allocated in the background
        (:meth:`prepare`) meanwhile, and a snapshot asked for before one is ready is skipped.

        Raises:
            StagingUnavailable: The background allocation found no room (use NVRx's staging).
        """
        if self._prep_error is not None and not self.preparing():
            self._join_prep()
        slots = layout_of(flat)
        complete = self._complete(slots)
        if not complete:
            self._prepare(slots)  # more banks to come (an adopted one alone, a new layout)
        if slots == self.slots and self.free_bank() is not None:
            return None
        return BUSY if complete else PINNING

    def _complete(self, slots: dict[str, Slot]) -> bool:
        """Whether as many banks as fit for ``slots`` are allocated and ready."""
        return (slots == self.slots and bool(self.banks) and all(b.ready for b in self.banks)
                and not self._missing(slots))

    def _missing(self, slots: dict[str, Slot]) -> bool:
        """Fewer banks than fit (an adopted bank alone, before the others are allocated)."""
        return len(self.banks) < self.max_banks and self._bank_count(slots, False) > len(self.banks)

    def _bank_count(self, slots: dict[str, Slot], first: bool) -> int:
        """How many banks fit in /dev/shm (every local rank allocates at about the same time)."""
        last = max(slots.values(), key=lambda s: s.offset, default=None)
        nbytes = max(_ALIGN, last.offset + last.nbytes if last else 0)
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if first else 1
        have = len(self.banks) if slots == self.slots else 0
        free = shm_free_bytes(str(self.home.root)) + have * nbytes
        for n in range(self.max_banks, 0, -1):
            reserve = SHM_RESERVE if n > 1 else 0
            if free >= n * nbytes * ranks * 1.05 + reserve:
                return n
        return 0

    def _allocate(self, slots: dict[str, Slot], waits: GpuWaits | None = None) -> None:
        """Lays the banks out for ``slots`` and brings as many as fit to ready, one at a time.

        The lock is held only while the bank list and the layout change: a bank is mapped and
        pinned before it joins :attr:`banks` (or, adopted, before it is marked ready), so the
        loop thread snapshots into a ready bank meanwhile without waiting for the others.

        Args:
            slots: The layout.
            waits: The loop's waits for the GPU, where the pinning is done beside the loop (the
                background allocation); None when the loop's own thread allocates.
        """
        last = max(slots.values(), key=lambda s: s.offset, default=None)
        nbytes = max(_ALIGN, last.offset + last.nbytes if last else 0)
        if slots != self.slots:
            self.release()
        with self._lock:
            first = self.generation == 0
            count = self._bank_count(slots, first)
            if count == 0:
                ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if first else 1
                raise StagingUnavailable(
                    f"/dev/shm has {shm_free_bytes(str(self.home.root)) / 1e9:.2f} GB free, the "
                    f"staging buffers need {nbytes / 1e9:.2f} GB x {ranks} local rank(s) (mount "
                    "a larger /dev/shm, e.g. --shm-size, or set checkpoint.staging=nvrx)")
            try:
                self.home.ensure()
            except HostCopyUnavailable as err:
                raise StagingUnavailable(str(err)) from None
            if slots != self.slots:
                self.generation += 1
                digest = hashlib.sha1(repr(_slot_rows(slots)).encode()).hexdigest()
                self.layout_key = f"{os.getpid()}-{self.generation}-{digest[:16]}"
            self.slots, self.nbytes = slots, nbytes
            if self.committed is None:  # nothing adopted: an earlier worker's files are stale
                self.home.withdraw()
                self.home.drop_banks(keep={b.index for b in self.banks})
            adopted = [b for b in self.banks if not b.ready]
        if self.cuda:
            torch.cuda.set_device(self.device)  # prepare() runs this in its own thread
        self._add_banks(slots, nbytes, count, adopted, waits)

    def _add_banks(self, slots: dict[str, Slot], nbytes: int, count: int,
                   adopted: list[_Bank], waits: GpuWaits | None) -> None:
        """Readies the adopted banks, then maps (and pins) new ones up to ``count``."""
        ranges = _pin_ranges(slots, nbytes)
        for bank in adopted:  # adopted from an earlier worker: pinned before a save copies in
            t0 = time.perf_counter()
            in_waits = bank.pin(ranges, waits) if self.cuda else 0
            bank.ready = True
            self._said_ready(bank, nbytes, time.perf_counter() - t0, in_waits, len(ranges))
        have = {b.index for b in self.banks}
        for index in range(self.max_banks):
            if len(have) >= count:
                break
            if index in have:
                continue  # adopted from an earlier worker, or allocated before
            t0 = time.perf_counter()
            bank = _Bank(index, self.home.bank_path(index))
            bank.map(nbytes, create=True)
            in_waits = bank.pin(ranges, waits) if self.cuda else 0
            bank.key = f"{self.layout_key}-{index}"
            bank.ready = True
            with self._lock:
                self.banks.append(bank)
            have.add(index)
            self._said_ready(bank, nbytes, time.perf_counter() - t0, in_waits, len(ranges))

    def _said_ready(self, bank: _Bank, nbytes: int, seconds: float, in_waits: int,
                    pieces: int) -> None:
        """Notes a bank ready (the loop thread logs the notes: :meth:`take_notes`)."""
        how = (f"mapped and pinned ({in_waits} of {pieces} pieces while the loop waited for the "
               "GPU)") if self.cuda else "mapped"
        self._notes.append(f"staging bank {bank.index} ready: {nbytes / 1e9:.2f} GB {how} in "
                           f"{seconds:.1f} s ({len(self.banks)} ready)")

    def take_notes(self) -> list[str]:
        """What the background allocation has to say since the last call (bank ready lines)."""
        notes, self._notes = self._notes, []
        return notes

    def release(self) -> None:
        """Unpins and unmaps the banks and deletes their files (the layout changed, or the end)."""
        if self._prep is not None and self._prep is not threading.current_thread():
            self._prep.join()  # it maps and pins banks: none may join the list after this
            self._prep = None
        self.synchronize()
        self.sealer.wait()  # it reads the banks
        if self._peer_join is not None:  # so does a copy to a peer
            self._peer_join(None)
            self.replicating = self._peer_join = None
        self.sealer.sealed_step = None
        for bank in self.banks:
            bank.unmap()
        self.banks, self.slots, self.target, self.committed = [], {}, None, None
        self.writing = None
        self.home.remove_rank_files()

    def lend(self, bank: _Bank | None) -> None:
        """``bank`` is read by the writer process from now on (None: none is): never staged into."""
        self.writing = bank

    def lend_peer(self, bank: _Bank | None, join: Callable[[float | None], None] | None) -> None:
        """``bank`` is read by a copy to peers (``join`` waits for it); None: none is."""
        self.replicating, self._peer_join = bank, join

    def view(self, key: str, bank: _Bank | None = None) -> torch.Tensor:
        """The region of one tensor in a bank (the one being staged by default), typed and shaped."""
        s = self.slots[key]
        owner = bank or self.target
        if owner is None or owner.buffer is None:
            raise RuntimeError(f"HostStaging.view({key!r}): no bank is mapped")
        return owner.buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)

    # ------------------------------------------------------------------ copies
    def free_bank(self) -> _Bank | None:
        """The bank the next snapshot goes into; None when no ready bank is free.

        Never a bank the writer or a copy to peers reads (:attr:`writing`,
        :attr:`replicating`); where another bank is free, not the
        one holding the newest complete snapshot either, so a recovery point stays in memory
        while the next snapshot is copied. Else the oldest.
        """
        free = [b for b in self.banks
                if b.ready and b is not self.writing and b is not self.replicating]
        spare = [b for b in free if b.step is None or b.step != self.valid_step]
        pool = spare or free
        return min(pool, key=lambda b: -1 if b.step is None else b.step) if pool else None

    def can_lend(self, bank: _Bank) -> bool:
        """Whether ``bank`` may go to the writer now.

        Yes when another ready bank takes the snapshots meanwhile, or when no second bank fits
        (then snapshots are skipped while it is written).
        """
        others = any(b.ready and b is not bank for b in self.banks)
        return others or (not self.preparing() and self._complete(self.slots))

    def stage(self, flat: dict[str, Any], step: int) -> None:
        """Starts copying ``flat`` into :meth:`free_bank` (CUDA tensors on a side stream).

        Call :meth:`ensure` for ``flat`` first and check that a bank is free. CPU tensors and
        non-tensor leaves are captured before this returns; CUDA tensors are complete once
        :meth:`ready` (then :meth:`settle` seals the bank) or after :meth:`synchronize`.
        """
        bank = self._take_bank(step)
        bank.objects = {k: copy.deepcopy(v) for k, v in flat.items()
                        if not isinstance(v, torch.Tensor)}
        if self.cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext(), torch.no_grad():
            for key, value in flat.items():
                if isinstance(value, torch.Tensor):
                    src = _local(value)
                    if src.is_cuda:  # keeps the source's memory from reuse until the copy ran
                        src.record_stream(self._stream)
                    self.view(key).copy_(src, non_blocking=src.is_cuda)
            if self.cuda:
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
        if not self.cuda:
            bank.step = step  # CPU copies are complete on return
            self.sealer.seal(bank, self.slots, self.nbytes)

    def _take_bank(self, step: int) -> _Bank:
        """The bank :meth:`stage` copies ``step`` into, its manifest withdrawn first."""
        if not self.banks:
            raise RuntimeError("HostStaging.stage() before ensure()")
        self.synchronize()  # the previous snapshot's copies: sealed before another starts
        bank = self.free_bank()
        if bank is None:
            raise RuntimeError("HostStaging.stage(): every bank is being written")
        if bank is self.committed:  # its state is given up for this snapshot
            self.committed = None
        self.target, self.staged_step = bank, step
        self.sealer.unseal(bank, self.banks)  # its manifest goes before its bytes change
        bank.step = None
        return bank

    def ready(self) -> bool:
        """Whether the last stage()'s copies are complete (never blocks)."""
        return self._event is None or self._event.query()

    def copying(self) -> bool:
        """Whether the last stage()'s copies may still run (the optimizer must wait for them)."""
        return self._event is not None

    def settle(self) -> None:
        """Seals the last stage()'s bank once its copies are complete (never blocks)."""
        if self._event is not None and self._event.query():
            self.synchronize()

    def wait_before_update(self) -> None:
        """Makes the current CUDA stream wait for the copies (GPU-side; the CPU does not block)."""
        if self._event is not None and self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._event)

    def synchronize(self) -> None:
        """Blocks the CPU until the last stage()'s copies are complete."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
            if self.target is not None:
                self.target.step = self.staged_step
                self.sealer.seal(self.target, self.slots, self.nbytes)

    def invalidate(self) -> None:
        """After a fault while staging: the bank being staged may hold a torn snapshot."""
        self._event = None
        if self.target is not None and self.target is not self.committed:
            self.target.step = None
        self.staged_step = None

    def commit(self, step: int) -> None:
        """Save ``step`` is committed: its bank is the one kept while the next save is staged."""
        bank = self._holding(step)
        if bank is not None:
            self.committed = bank
