"""CRC-32C of a staging bank's pieces: taken when a snapshot is complete, checked when it is loaded.

A bank outlives the worker that staged it (a file under ``/dev/shm``), so what a restarted worker
loads from it must be the bytes that were staged, as the disk checkpoints' commit markers check
theirs. The pieces are the bank's pinning ranges (whole tensors, ~256 MiB), so a restore that
copies piece by piece checks each one as it goes. The check is on every restore's path: with
``zlib.crc32`` (2 GB/s a thread) eight threads took 0.8 s of a 13.25 GB in-process restore whose
copy to the GPU takes 0.24 s, so the banks use CRC-32C (Castagnoli), which the ``crc32c`` package
computes with the CPU's CRC instruction at ~10 GB/s a thread, releasing the GIL: the trainer's
loop thread is not held (the check of a new snapshot runs in the background). The disk tier keeps
zlib's CRC-32: its markers outlive the process and are read by every later version.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import crc32c
import torch

from kfp_nvrx.components.training.checkpoint.bank import _Bank, _pin_ranges, _slot_rows

if TYPE_CHECKING:
    from kfp_nvrx.components.training.checkpoint.bank import Slot
    from kfp_nvrx.components.training.checkpoint.hostcopy import HostCopyDir

#: Threads per rank: a share of the host's cores (8 local ranks share a p5's 192).
THREADS = max(1, min(8, (os.cpu_count() or 2) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))


#: Bytes per CRC-32C piece of a bank (whole tensors; a check runs one piece per thread).
CRC_CHUNK = 256 << 20


class SnapshotDamaged(RuntimeError):
    """A bank's bytes do not match the CRC-32C taken when its snapshot was complete."""


def crc_of(buffer: torch.Tensor) -> int:
    """CRC-32C of a contiguous host uint8 tensor's bytes (no copy; the GIL is released)."""
    return crc32c.crc32c(buffer.numpy().data) if buffer.numel() else 0


def piece_crcs(buffer: torch.Tensor, pieces: Iterable[tuple[int, int]],
               pool: ThreadPoolExecutor | None = None) -> list[list[int]]:
    """``[offset, length, crc]`` of every piece of ``buffer`` (threads when ``pool`` is given)."""
    pieces = list(pieces)
    views = [buffer[off:off + n] for off, n in pieces]
    crcs = list(pool.map(crc_of, views)) if pool is not None else [crc_of(v) for v in views]
    return [[off, n, crc] for (off, n), crc in zip(pieces, crcs, strict=True)]


def check_pieces(buffer: torch.Tensor, expected: list[list[int]],
                 pool: ThreadPoolExecutor | None = None) -> None:
    """Raises :class:`SnapshotDamaged` naming the first piece whose CRC-32C differs."""
    got = piece_crcs(buffer, [(off, n) for off, n, _ in expected], pool)
    for (off, n, want), (_, _, crc) in zip(expected, got, strict=True):
        if want != crc:
            raise SnapshotDamaged(f"bytes {off}..{off + n} changed since the snapshot was "
                                  f"taken (CRC-32C {crc:08x}, recorded {want:08x})")


class BackgroundCheck:
    """:func:`check_pieces` on a thread of its own (its pieces on ``pool``), started at once.

    A restore copies the bank out while this reads it: the check adds its share of memory
    bandwidth to the restore, not its time. :meth:`result` waits and raises what it found.
    """

    def __init__(self, buffer: torch.Tensor, expected: list[list[int]],
                 pool: ThreadPoolExecutor) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(buffer, expected, pool),
                                        name="bank-check", daemon=True)
        self._thread.start()

    def _run(self, buffer: torch.Tensor, expected: list[list[int]],
             pool: ThreadPoolExecutor) -> None:
        try:
            check_pieces(buffer, expected, pool)
        except BaseException as err:  # noqa: BLE001 - handed to result()
            self.error = err

    def result(self) -> None:
        """Waits for the check; raises :class:`SnapshotDamaged` (or what else it hit)."""
        self._thread.join()
        if self.error is not None:
            raise self.error


class Sealer:
    """Seals complete snapshots: takes their CRC-32Cs and publishes their manifests, off the loop.

    Args:
        home: The rank's host copy directory (where manifests are published).
        lock: The staging's lock (held while a manifest is published or withdrawn, so a bank
            being staged again is never described by a seal that started before).
    """

    def __init__(self, home: HostCopyDir, lock: threading.Lock) -> None:
        self.home = home
        self.lock = lock
        self.sealed_step: int | None = None  # newest snapshot whose CRC-32Cs are taken
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    def pool(self) -> ThreadPoolExecutor:
        """The CRC threads (made on first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="bank-crc")
        return self._pool

    def seal(self, bank: _Bank, slots: dict[str, Slot], nbytes: int) -> None:
        """Starts sealing ``bank``'s complete snapshot (its ``step``) in the background."""
        bank.crc32, bank.token = None, bank.token + 1
        self._thread = threading.Thread(
            target=self._run, args=(bank, bank.token, bank.step, slots, nbytes),
            name="ckpt-seal", daemon=True)
        self._thread.start()

    def _run(self, bank: _Bank, token: int, step: int | None, slots: dict[str, Slot],
             nbytes: int) -> None:
        buffer = bank.buffer
        if buffer is None or step is None:
            return
        try:
            crcs = piece_crcs(buffer, _pin_ranges(slots, nbytes, CRC_CHUNK), self.pool())
        except Exception:  # noqa: BLE001 - unmapped meanwhile (released): nothing to describe
            return
        with self.lock:
            if bank.token != token or bank.step != step:
                return  # staged again meanwhile: these CRCs describe nothing
            bank.crc32 = crcs
            self.home.publish(bank.index, step=step, nbytes=nbytes, slots=_slot_rows(slots),
                              objects=bank.objects, crc32=crcs)
            self.sealed_step = max(step, self.sealed_step or step)

    def unseal(self, bank: _Bank, banks: list[_Bank]) -> None:
        """Before ``bank`` is staged again: no manifest, no CRCs, no seal in flight for it."""
        with self.lock:
            bank.token += 1
            bank.crc32 = None
            self.home.withdraw(bank.index)
            if self.sealed_step is not None and self.sealed_step == bank.step:
                others = [b.step for b in banks
                          if b is not bank and b.crc32 is not None and b.step is not None]
                self.sealed_step = max(others) if others else None

    def wait(self) -> None:
        """Waits for the seal in flight, if any (before the banks are unmapped; tests)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
