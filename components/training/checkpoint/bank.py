"""Staging banks: the layout of a flattened state in a host buffer, and one buffer (a *bank*).

A bank is a file under the host copy directory (:mod:`.hostcopy`), mapped shared (NVRx's writer
process maps the same file) and, on CUDA, pinned in pieces of whole tensors.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from kfp_nvrx.components.training.checkpoint.gpu_waits import GpuWaits

# Every tensor starts on its own page: the banks are pinned in page-aligned ranges of whole
# tensors (see _pin_ranges), and two registrations may not share a page.
_ALIGN = 4096
#: Bytes per cudaHostRegister call (a piece holds whole tensors, so a larger tensor is a piece of
#: its own). Registrations back to back starve the training thread of the driver: on an H200 a
#: 13 GB bank pinned in 256 MiB pieces held one step of a matmul loop for the whole 4.6 s
#: (docs/benchmarks/pin_stall.json) and restarted 1b workers had 4-5 s steps; 32 MiB pieces,
#: each followed by a pause as long as it took (:data:`PIN_DUTY`), held no step at all.
PIN_CHUNK = 32 << 20
#: Seconds paused after a registration, per second it took.
PIN_DUTY = 1.0
#: madvise(MADV_POPULATE_WRITE) (Linux 5.14): maps a piece's pages outside the driver, so its
#: registration only pins (Python's mmap module names it from 3.13 on).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: Bytes per second a piece is assumed to pin at before one was timed (H100/H200: 2.5-3 GB/s).
PIN_RATE_GUESS = 1e9
#: Headroom left in /dev/shm beyond the banks (NCCL, DataLoader workers use it too).
SHM_RESERVE = 1 << 30
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in the staging buffer."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _local(t: torch.Tensor) -> torch.Tensor:
    # DTensor's local shard without to_local()'s autograd bookkeeping (~40 us each, 600+ a save).
    return t._local_tensor if isinstance(t, DTensor) else t


def flat_state(state: dict[str, Any]) -> dict[str, Any]:
    """The state dict flattened exactly as DCP's default planner flattens it (same keys)."""
    return flatten_state_dict(state)[0]


def layout_of(flat: dict[str, Any]) -> dict[str, Slot]:
    """A buffer layout for every tensor leaf of a flattened state dict."""
    slots, offset = {}, 0
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            t = _local(value)
            nbytes = t.numel() * t.element_size()
            slots[key] = Slot(offset, nbytes, tuple(t.shape), t.dtype)
            offset += -(-nbytes // _ALIGN) * _ALIGN
    return slots


def _slot_rows(slots: dict[str, Slot]) -> list[list[Any]]:
    return [[k, s.offset, s.nbytes, list(s.shape), str(s.dtype).removeprefix("torch.")]
            for k, s in slots.items()]


def _pin_ranges(slots: dict[str, Slot], nbytes: int,
                chunk: int = PIN_CHUNK) -> list[tuple[int, int]]:
    """(offset, length) pieces of about ``chunk`` bytes, each holding whole tensors."""
    ranges: list[tuple[int, int]] = []
    start = end = 0
    for s in sorted(slots.values(), key=lambda s: s.offset):
        if end > start and s.offset + s.nbytes - start > chunk:
            ranges.append((start, s.offset - start))
            start = s.offset
        end = s.offset + s.nbytes
    if nbytes > start:
        ranges.append((start, nbytes - start))
    return ranges


def _populate(address: int, length: int) -> None:
    """Maps a piece's pages now; best effort (the registration maps what is left).

    Through ctypes, which lets go of the GIL: Python's ``mmap.madvise`` holds it, and the loop's
    thread could not even return from its wait for the GPU meanwhile.
    """
    page = mmap.PAGESIZE
    start = address - address % page
    _libc.madvise(start, length + address - start, _MADV_POPULATE_WRITE)


def shm_free_bytes(path: str = "/dev/shm") -> int:
    """Free bytes of the shared-memory filesystem the staging buffer is allocated from."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class StagingUnavailable(RuntimeError):
    """The buffer cannot be allocated here (e.g. ``/dev/shm`` too small); use NVRx's staging."""


def cudart_path(maps: str) -> str | None:
    """The CUDA runtime library this process has loaded, from ``/proc/self/maps`` text."""
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "/libcudart.so" in path:
            return path
    return None


@functools.cache
def _host_register() -> Callable[[int, int, int], int]:
    """``cudaHostRegister`` that releases the GIL while it pins.

    Pinning gigabytes takes seconds, and torch's binding holds the GIL meanwhile: a background
    allocation then stalled the training thread for as long (docs/benchmarks/NOTES.md). A ctypes
    call into the same runtime library releases it; torch's binding is the fallback.
    """
    try:
        with open("/proc/self/maps") as fh:
            path = cudart_path(fh.read())
        if path is not None:
            lib = ctypes.CDLL(path)
            fn, clear = lib.cudaHostRegister, lib.cudaGetLastError
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            fn.restype = clear.restype = ctypes.c_int

            def register(ptr: int, n: int, flags: int) -> int:
                rc = int(fn(ptr, n, flags))
                if rc != 0:  # the runtime keeps it as this thread's last error, which torch's
                    clear()  # next kernel launch here would raise as its own (seen on an H100)
                return rc

            return register
    except (OSError, AttributeError):
        pass
    cudart = torch.cuda.cudart()
    return lambda ptr, n, flags: int(cudart.cudaHostRegister(ptr, n, flags))


class _Bank:
    """One staging buffer: a file under the host copy directory, mapped (and pinned on CUDA)."""

    def __init__(self, index: int, path: Path) -> None:
        self.index = index
        self.path = path
        self.buffer: torch.Tensor | None = None
        self.key = ""  # what the writer process maps the file under
        self.step: int | None = None  # step of the complete snapshot it holds
        self.objects: dict[str, Any] = {}  # non-tensor leaves of that snapshot
        self.pinned: list[int] = []  # base addresses of its cudaHostRegister pieces
        # Mapped and, on CUDA, pinned whole: a snapshot may copy into it (set by its allocator).
        self.ready = False
        self.crc32: list[list[int]] | None = None  # [offset, length, crc] once sealed
        self.token = 0  # bumped whenever it is staged or sealed (a stale seal does not publish)
        self._mm: mmap.mmap | None = None

    def map(self, nbytes: int, create: bool) -> None:
        """Maps the bank's file (created and allocated first when ``create``).

        Raises:
            StagingUnavailable: Naming the file and the file system's own error (a read-only or
                full /dev/shm is host memory, not the checkpoint disk).
        """
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_TRUNC if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
            try:
                if create:  # allocates the pages now: a full tmpfs fails here, not with SIGBUS
                    os.posix_fallocate(fd, 0, nbytes)
                self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED,
                                     mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError as err:
            raise StagingUnavailable(
                f"host memory for the staging buffers: {self.path}: {err.strerror or err} "
                f"({nbytes / 1e9:.2f} GB; mount a larger, writable /dev/shm, e.g. a "
                "memory-backed emptyDir, or set checkpoint.staging=nvrx)") from None
        self.buffer = torch.frombuffer(self._mm, dtype=torch.uint8)

    def pin(self, ranges: list[tuple[int, int]], waits: GpuWaits | None = None) -> int:
        """Page-locks the bank piece by piece, so the training thread is never starved.

        Each piece's pages are mapped first (``MADV_POPULATE_WRITE``, no data changes), then
        registered: both hold the process's memory map and the driver, so a kernel launch of the
        training thread issued meanwhile waits. A piece that finds the loop's thread waiting for
        the GPU with room left in its wait (``waits``, a background allocation:
        :class:`.gpu_waits.GpuWaits`) runs at once and is followed by the next; any other piece
        is followed by a pause as long as it took, so the loop gets the driver half the time.

        Returns:
            How many pieces were pinned inside the loop's waits.
        """
        if self.buffer is None:
            raise RuntimeError("_Bank.pin() before map()")
        register = _host_register()
        base = self.buffer.data_ptr()
        per_byte = 1 / PIN_RATE_GUESS  # seconds per byte of the slowest recent piece
        in_waits = 0
        for offset, length in ranges:
            in_wait = waits is not None and waits.room(per_byte * length)
            t0 = time.perf_counter()
            _populate(base + offset, length)
            # Portable: page-locked for every device context of this process.
            rc = register(base + offset, length, 1)
            if rc != 0:
                raise StagingUnavailable(f"cudaHostRegister of {length / 1e9:.2f} GB failed "
                                         f"(error {rc})")
            self.pinned.append(base + offset)
            took = time.perf_counter() - t0
            per_byte = max(per_byte * 0.5, took / max(length, 1))  # slower pieces count at once
            if in_wait:
                in_waits += 1
            else:
                time.sleep(PIN_DUTY * took)
        return in_waits

    def unmap(self) -> None:
        if self.pinned:
            cudart = torch.cuda.cudart()
            for ptr in self.pinned:
                cudart.cudaHostUnregister(ptr)
            self.pinned = []
        self.buffer, self.step, self.objects, self.crc32 = None, None, {}, None
        self.ready = False
        self.token += 1
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere: the GC unmaps it later
                pass
            self._mm = None


