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
from kfp_nvrx.components.training.checkpoint.hostcopy import HostCopyDir, HostCopyUnavailable
from kfp_nvrx.components.training.checkpoint.integrity import Sealer, SnapshotDamaged

__all__ = ["HostStaging", "Slot", "SnapshotDamaged", "StagingUnavailable", "flat_state",
           "layout_of", "shm_free_bytes"]


class HostStaging:
    """The persistent staging banks of one worker process, reused by every save.

    Args:
        device: The training device (CUDA: pinned banks, copies on a side stream).
        home: This rank's host copy directory (None: a private one, never reused).
        banks: Banks at most (2: the committed state stays in memory while a save is written).
    """

    def __init__(self, device: torch.device, home: HostCopyDir | None = None,
                 banks: int = 2) -> None:
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
        self.staged_step: int | None = None
        self.adopted_step: int | None = None  # step adopted from an earlier worker's bank
        self._event: Any = None
        self._stream: Any = None
        self._prep: threading.Thread | None = None
        self._prep_error: BaseException | None = None
        self._lock = threading.Lock()
        self.sealer = Sealer(self.home, self._lock)

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

        Pinning 10+ GB takes seconds; done here, the first save does not pay for it.
        """
        slots = layout_of(flat_state(state))
        complete = (slots == self.slots and len(self.banks) == self._bank_count(slots, first=False)
                    and all(b.pinned for b in self.banks if self.cuda))
        if complete or (self._prep is not None and self._prep.is_alive()):
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
            self._allocate(slots)
        except BaseException as err:  # noqa: BLE001 - reported by the next ensure()
            self._prep_error = err

    def ensure(self, flat: dict[str, Any]) -> None:
        """Banks that fit ``flat``'s layout (waits for :meth:`prepare`, else allocates)."""
        if self._prep is not None:
            self._prep.join()
            self._prep = None
            if self._prep_error is not None:
                err, self._prep_error = self._prep_error, None
                if isinstance(err, StagingUnavailable):
                    raise err
        slots = layout_of(flat)
        unpinned = self.cuda and any(not b.pinned for b in self.banks)
        if slots != self.slots or not self.banks or unpinned or self._missing(slots):
            self._allocate(slots)

    def _missing(self, slots: dict[str, Slot]) -> bool:
        """Fewer banks than fit (an adopted bank alone, before its second one is allocated)."""
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

    def _allocate(self, slots: dict[str, Slot]) -> None:
        with self._lock:
            last = max(slots.values(), key=lambda s: s.offset, default=None)
            nbytes = max(_ALIGN, last.offset + last.nbytes if last else 0)
            first = self.generation == 0
            if slots != self.slots:
                self.release()
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
            if self.cuda:
                torch.cuda.set_device(self.device)  # prepare() runs this in its own thread
            if self.committed is None:  # nothing adopted: an earlier worker's files are stale
                self.home.withdraw()
                self.home.drop_banks(keep={b.index for b in self.banks})
            self._add_banks(slots, nbytes, count)

    def _add_banks(self, slots: dict[str, Slot], nbytes: int, count: int) -> None:
        """Pins the adopted banks and maps (and pins) new ones up to ``count`` (under the lock)."""
        ranges = _pin_ranges(slots, nbytes)
        for bank in self.banks:
            if self.cuda and not bank.pinned:  # adopted: pinned before a save copies in
                bank.pin(ranges)
        have = {b.index for b in self.banks}
        for index in range(self.max_banks):
            if len(have) >= count:
                break
            if index in have:
                continue  # adopted from an earlier worker, or allocated before
            bank = _Bank(index, self.home.bank_path(index))
            bank.map(nbytes, create=True)
            if self.cuda:
                bank.pin(ranges)
            bank.key = f"{self.layout_key}-{index}"
            self.banks.append(bank)
            have.add(index)

    def release(self) -> None:
        """Unpins and unmaps the banks and deletes their files (the layout changed, or the end)."""
        self.synchronize()
        self.sealer.wait()  # it reads the banks
        self.sealer.sealed_step = None
        for bank in self.banks:
            bank.unmap()
        self.banks, self.slots, self.target, self.committed = [], {}, None, None
        self.home.remove_rank_files()

    def view(self, key: str, bank: _Bank | None = None) -> torch.Tensor:
        """The region of one tensor in a bank (the one being staged by default), typed and shaped."""
        s = self.slots[key]
        owner = bank or self.target
        if owner is None or owner.buffer is None:
            raise RuntimeError(f"HostStaging.view({key!r}): no bank is mapped")
        return owner.buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)

    # ------------------------------------------------------------------ copies
    def stage(self, flat: dict[str, Any], step: int) -> None:
        """Starts copying ``flat`` into a bank (CUDA tensors on a side stream).

        The bank is the one not holding the newest committed step (with one bank, its manifest is
        withdrawn first). Call :meth:`ensure` for ``flat`` first (the save path does, once per
        save). CPU tensors and non-tensor leaves are captured before this returns; CUDA tensors
        are complete once :meth:`ready` (or after :meth:`synchronize`).
        """
        if not self.banks:
            raise RuntimeError("HostStaging.stage() before ensure()")
        free = [b for b in self.banks if b is not self.committed]
        if not free:  # one bank: the committed state is given up for this save
            self.home.withdraw()
            self.committed, free = None, self.banks
        bank = min(free, key=lambda b: -1 if b.step is None else b.step)
        self.target, self.staged_step = bank, step
        self.sealer.unseal(bank, self.banks)  # its manifest goes before its bytes change
        bank.step = None
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

    def ready(self) -> bool:
        """Whether the last stage()'s copies are complete (never blocks)."""
        return self._event is None or self._event.query()

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
