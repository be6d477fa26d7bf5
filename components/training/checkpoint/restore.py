"""Restoring a bank that is not pinned (adopted from an earlier worker) at memory speed.

Pinning a 13 GB bank that is already resident takes seconds (``cudaHostRegister`` walks every
page); copying it to the GPU straight from the pageable mapping is a synchronous, driver-staged
copy. Instead, reader threads copy whole-tensor pieces of the bank into a few pinned bounce
buffers (CPU memcpy, several at once) while the calling thread issues the asynchronous H2D copies
out of the filled ones; the bank itself is pinned later, in the background, before a save needs
it.
"""

from __future__ import annotations

import bisect
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kfp_nvrx.components.training.checkpoint.bank import Slot, _local, _pin_ranges
from kfp_nvrx.components.training.checkpoint.integrity import (
    THREADS,
    BackgroundCheck,
)

#: Reader threads; each fills one bounce buffer at a time (plus one the GPU copies from).
READERS = 4
#: Bytes per bounce buffer piece (whole tensors): 4 readers x 256 MiB restored 13.25 GB at
#: 11 GB/s on an H200 host.
BOUNCE_CHUNK = 256 << 20


def restore_bounced(buffer: torch.Tensor, slots: dict[str, Slot], nbytes: int,
                    flat: dict[str, Any], threads: int = READERS,
                    expected: list[list[int]] | None = None) -> None:
    """Copies every tensor of ``flat`` from the pageable ``buffer`` (at ``slots``) to its device.

    Args:
        buffer: The bank's bytes (uint8, host, not pinned).
        slots: Where each tensor lives in ``buffer``.
        nbytes: The bank's size.
        flat: Flattened state whose tensors (CUDA) are filled in place.
        threads: Reader threads (each fills one bounce buffer at a time; one more buffer is the
            GPU's to copy from).
        expected: The bank's ``[offset, length, crc]`` pieces, checked on other threads while
            the readers copy (the tensors are filled either way: on a mismatch, load them from
            elsewhere).

    Raises:
        SnapshotDamaged: A piece's CRC32 differs from ``expected``.
    """
    pool = ThreadPoolExecutor(THREADS, thread_name_prefix="bank-check") if expected else None
    checker = BackgroundCheck(buffer, expected, pool) if pool and expected else None
    pieces = _pin_ranges(slots, nbytes, BOUNCE_CHUNK)
    targets = _targets_by_piece(pieces, slots, flat)
    bounce = _Bounce(buffer, pieces, max(1, min(threads, len(pieces))))
    workers = bounce.start()
    stream = torch.cuda.current_stream()
    try:
        for index in range(len(pieces)):
            got = bounce.take(index)
            if isinstance(got, BaseException):
                raise got
            buf, off = got
            _copy_to_device(buf, off, targets[index])
            event = torch.cuda.Event()
            event.record(stream)
            bounce.free.put((buf, event))
    finally:
        bounce.stop.set()
        for w in workers:
            w.join()
        stream.synchronize()
    if checker is not None and pool is not None:
        try:
            checker.result()  # raises SnapshotDamaged
        finally:
            pool.shutdown(wait=False)


def _targets_by_piece(pieces: list[tuple[int, int]], slots: dict[str, Slot],
                      flat: dict[str, Any]) -> list[list[tuple[torch.Tensor, Slot]]]:
    """The tensors of ``flat`` each bounce piece holds, with where they are in the bank."""
    targets: list[list[tuple[torch.Tensor, Slot]]] = [[] for _ in pieces]
    starts = [off for off, _ in pieces]
    for key, value in flat.items():
        if isinstance(value, torch.Tensor) and key in slots:
            s = slots[key]
            targets[bisect.bisect_right(starts, s.offset) - 1].append((_local(value), s))
    return targets


def _copy_to_device(buf: torch.Tensor, off: int, targets: list[tuple[torch.Tensor, Slot]]) -> None:
    """Issues the asynchronous H2D copies out of one filled bounce buffer (bank offset ``off``)."""
    with torch.no_grad():
        for dst, s in targets:
            src = buf[s.offset - off:s.offset - off + s.nbytes].view(s.dtype).view(s.shape)
            dst.copy_(src, non_blocking=True)


class _Bounce:
    """The pinned bounce buffers of one restore and the reader threads that fill them.

    A buffer cycles through ``free`` (with the event of the GPU copies out of it, or None) to a
    reader, which fills it with the next piece and puts it in ``ready`` under that piece's index.

    Args:
        buffer: The bank's bytes (uint8, host, not pinned).
        pieces: The ``(offset, length)`` pieces to copy, in order.
        nthreads: Reader threads (one more buffer than readers: the GPU's to copy from).
    """

    def __init__(self, buffer: torch.Tensor, pieces: list[tuple[int, int]], nthreads: int) -> None:
        self.buffer = buffer
        self.pieces = pieces
        self.nthreads = nthreads
        size = max((n for _, n in pieces), default=0)
        self.free: queue.Queue = queue.Queue()
        for _ in range(nthreads + 1):
            self.free.put((torch.empty(size, dtype=torch.uint8, pin_memory=True), None))
        self.ready: dict[int, Any] = {}
        self.cond = threading.Condition()
        self.next_index = 0
        self.device = torch.cuda.current_device()
        self.stop = threading.Event()

    def start(self) -> list[threading.Thread]:
        """Starts the reader threads; returns them (join them after :attr:`stop` is set)."""
        workers = [threading.Thread(target=self.reader, name=f"bank-restore-{i}", daemon=True)
                   for i in range(self.nthreads)]
        for w in workers:
            w.start()
        return workers

    def reader(self) -> None:
        """One reader thread: fills free buffers with the next pieces until none is left."""
        torch.cuda.set_device(self.device)
        while not self.stop.is_set():
            try:  # the buffer first, then the index: the oldest piece always has one
                buf, event = self.free.get(timeout=0.05)
            except queue.Empty:
                continue
            with self.cond:
                index = self.next_index
                self.next_index += 1
            if index >= len(self.pieces):
                self.free.put((buf, event))
                return
            try:
                if event is not None:
                    event.synchronize()  # the GPU copies out of this buffer are done
                off, n = self.pieces[index]
                buf[:n].copy_(self.buffer[off:off + n])
                got: Any = (buf, off)
            except BaseException as err:  # noqa: BLE001 - handed to the calling thread
                got = err
            with self.cond:
                self.ready[index] = got
                self.cond.notify_all()

    def take(self, index: int) -> Any:
        """Waits for piece ``index``: ``(buffer, bank offset)``, or the reader's exception."""
        with self.cond:
            while index not in self.ready:
                self.cond.wait(timeout=0.5)
            return self.ready.pop(index)
