"""Host staging for async checkpoints: persistent pinned, shared buffers and their writer request.

A save copies every tensor of the (flattened) state dict into one host buffer that lives as long as
the worker process (it survives in-process restarts): shared memory, so NVRx's persistent writer
process maps it once and writes straight from it; pinned (``cudaHostRegister``), so the
device-to-host copies run at DMA speed. On CUDA the copies are issued on a side stream:

* ``blocking``: ``save()`` waits for them (the visible stall is the D2H copy itself);
* ``overlap``: ``save()`` returns at once; the next step's forward/backward runs beside the copy and
  only the optimizer step waits for it, on the GPU (``wait_before_update``), never the CPU.

The buffer also holds the newest complete snapshot in host memory: an in-process restart restores
from it (H2D) instead of reading a checkpoint back from disk when every rank holds the same step,
even one whose write to disk the fault interrupted (the snapshot of every rank is complete).

The writer request carries the buffer once per writer process; afterwards only the layout. In the
writer, every tensor becomes a zero-copy view with a storage of exactly its own bytes (``torch.save``
serialises a view's whole storage, which would be the whole buffer).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import hashlib
import inspect
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from kfp_nvrx.components.train_fsdp.trainer.checkpoint.files import write_checksums

_ALIGN = 64


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


def shm_free_bytes(path: str = "/dev/shm") -> int:
    """Free bytes of the shared-memory filesystem the staging buffer is allocated from."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class StagingUnavailable(RuntimeError):
    """The buffer cannot be allocated here (e.g. ``/dev/shm`` too small); use NVRx's staging."""


class HostStaging:
    """The persistent staging buffer of one worker process, reused by every save.

    Args:
        device: The training device (CUDA: pinned buffer, copies on a side stream).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots: dict[str, Slot] = {}
        self.buffer: torch.Tensor | None = None  # uint8, shared memory (pinned on CUDA)
        self.key = ""  # layout + allocation identity, what the writer process caches under
        self.generation = 0
        self.valid_step: int | None = None  # step of the complete snapshot held (restore source)
        self.staged_step: int | None = None  # step being staged or written
        self._objects: dict[str, Any] = {}  # non-tensor leaves of the staged state
        self._event: Any = None
        self._stream: Any = None
        self._prep: threading.Thread | None = None
        self._prep_error: BaseException | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ buffer
    def prepare(self, state: dict[str, Any]) -> None:
        """Allocates (and pins) the buffer for ``state``'s layout in a background thread.

        Pinning 10+ GB takes seconds; done here, the first save does not pay for it.
        """
        slots = layout_of(flat_state(state))
        if slots == self.slots or (self._prep is not None and self._prep.is_alive()):
            return
        self._prep_error = None
        self._prep = threading.Thread(target=self._allocate_quietly, args=(slots,), daemon=True,
                                      name="ckpt-staging-alloc")
        self._prep.start()

    def _allocate_quietly(self, slots: dict[str, Slot]) -> None:
        try:
            self._allocate(slots)
        except BaseException as err:  # noqa: BLE001 - reported by the next ensure()
            self._prep_error = err

    def ensure(self, flat: dict[str, Any]) -> None:
        """A buffer that fits ``flat``'s layout (waits for :meth:`prepare`, else allocates)."""
        if self._prep is not None:
            self._prep.join()
            self._prep = None
            if self._prep_error is not None:
                err, self._prep_error = self._prep_error, None
                if isinstance(err, StagingUnavailable):
                    raise err
        slots = layout_of(flat)
        if slots != self.slots or self.buffer is None:
            self._allocate(slots)

    def _allocate(self, slots: dict[str, Slot]) -> None:
        with self._lock:
            if slots == self.slots and self.buffer is not None:
                return
            last = max(slots.values(), key=lambda s: s.offset, default=None)
            nbytes = max(_ALIGN, last.offset + last.nbytes if last else 0)
            first = self.generation == 0
            self.release()
            # The first allocation of every local rank happens at about the same time, so each
            # must see room for all of them: a tmpfs that fills up while pages are touched kills
            # the process with SIGBUS instead of failing the allocation.
            ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if first else 1
            free = shm_free_bytes()
            if free < nbytes * ranks * 1.05:
                raise StagingUnavailable(
                    f"/dev/shm has {free / 1e9:.2f} GB free, the staging buffers need "
                    f"{nbytes / 1e9:.2f} GB x {ranks} local rank(s) (mount a larger /dev/shm, e.g. "
                    "--shm-size, or set checkpoint.staging=nvrx)")
            storage = torch.UntypedStorage._new_shared(nbytes)
            buf = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
            if self.cuda:
                torch.cuda.set_device(self.device)  # prepare() runs this in its own thread
                # Page-locked (portable: for every device context of this process), so the D2H
                # copies run at DMA speed, as the floor measures.
                rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 1)
                if int(rc) != 0:
                    raise StagingUnavailable(f"cudaHostRegister of {nbytes / 1e9:.2f} GB failed "
                                             f"(error {int(rc)})")
            self.buffer, self.slots = buf, slots
            self.generation += 1
            digest = hashlib.sha1(repr(sorted((k, s.offset, s.nbytes, s.shape, str(s.dtype))
                                              for k, s in slots.items())).encode()).hexdigest()
            self.key = f"{os.getpid()}-{self.generation}-{digest[:16]}"
            self.valid_step = None

    def release(self) -> None:
        """Unpins and drops the buffer (the writer process may still map it until it exits)."""
        if self.buffer is not None and self.cuda:
            self.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.buffer, self.slots, self.valid_step = None, {}, None

    def view(self, key: str) -> torch.Tensor:
        """The buffer region of one tensor, typed and shaped (training side)."""
        s = self.slots[key]
        region = self.buffer[s.offset:s.offset + s.nbytes]
        return region.view(s.dtype).view(s.shape)

    # ------------------------------------------------------------------ copies
    def stage(self, flat: dict[str, Any], step: int) -> None:
        """Starts copying ``flat`` into the buffer (CUDA tensors on a side stream).

        Call :meth:`ensure` for ``flat`` first (the save path does, once per save). CPU tensors
        and non-tensor leaves are captured before this returns; CUDA tensors are complete once
        :meth:`ready` (or after :meth:`synchronize`).
        """
        if self.buffer is None:
            raise RuntimeError("HostStaging.stage() before ensure()")
        self.valid_step, self.staged_step = None, step
        self._objects = {k: copy.deepcopy(v) for k, v in flat.items()
                         if not isinstance(v, torch.Tensor)}
        if self.cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext(), \
                torch.no_grad():
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
            self.valid_step = step  # CPU copies are complete on return

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
            self.valid_step = self.staged_step

    def invalidate(self) -> None:
        """After a fault while staging: the buffer may hold a torn snapshot."""
        self.valid_step = self.staged_step = None

    def keys(self) -> set[str]:
        """The flattened keys of the snapshot held (as a DCP checkpoint's metadata lists them)."""
        return set(self.slots) | set(self._objects)

    def can_restore(self, flat: dict[str, Any], step: int) -> bool:
        """Whether ``flat`` can be filled from the buffer holding ``step`` (same layout)."""
        if self.buffer is None or self.valid_step != step:
            return False
        want = layout_of({k: v for k, v in flat.items() if isinstance(v, torch.Tensor)})
        return (all(self.slots.get(k) is not None and self.slots[k].shape == s.shape
                    and self.slots[k].dtype == s.dtype for k, s in want.items())
                and all(k in self._objects or k in self.slots for k in flat))

    def restore(self, flat: dict[str, Any]) -> dict[str, Any]:
        """Copies the buffer into ``flat``'s tensors (in place); returns the non-tensor leaves."""
        with torch.no_grad():
            for key, value in flat.items():
                if isinstance(value, torch.Tensor):
                    dst = _local(value)
                    dst.copy_(self.view(key), non_blocking=dst.is_cuda)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return {k: copy.deepcopy(v) for k, v in self._objects.items() if k in flat}


def _split(items: list[tuple[Any, Slot]], n: int) -> list[list[tuple[Any, Slot]]]:
    """Greedy split into ``n`` buckets of similar byte size (largest items first)."""
    buckets: list[list[tuple[Any, Slot]]] = [[] for _ in range(max(1, n))]
    sizes = [0] * len(buckets)
    for entry in sorted(items, key=lambda e: -e[1].nbytes):
        i = sizes.index(min(sizes))
        buckets[i].append(entry)
        sizes[i] += entry[1].nbytes
    return [b for b in buckets if b] or [[]]


def staged_writer(path: str, staging: HostStaging, threads: int = 1) -> Any:
    """An NVRx ``FileSystemWriterAsync`` whose data comes from ``staging``'s buffer.

    DCP plans with the live state (so the metadata, e.g. DTensor shards, is the real one); instead
    of resolving (and, NVRx >= 0.6, cloning) tensors, ``prepare_write_data`` records which buffer
    slot each write item reads, split into ``threads`` files written in parallel. ``request`` then
    describes the write for :func:`write_staged`.
    """
    # FT: NVRx's async DCP writer (planning, results queue, finish/metadata) with our staging.
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fsa
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
    from torch.distributed.checkpoint.planner import WriteItemType

    class StagedWriter(fsa.FileSystemWriterAsync):
        def prepare_write_data(self, plan: Any, planner: Any) -> None:
            items, byte_data = [], []
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    byte_data.append((item, planner.resolve_data(item)))
                    continue
                slot = staging.slots.get(item.index.fqn)
                chunk = tuple(item.tensor_data.chunk.sizes) if item.tensor_data else None
                if slot is None or chunk != slot.shape:
                    raise RuntimeError(f"staged save: {item.index.fqn} is not one whole local "
                                       f"tensor (chunk {chunk}, staged {slot})")
                items.append((item, slot))
            prefix = plan.storage_data.prefix
            self.central_plan = plan  # reused by the next saves of the same layout
            self.staged = [(os.path.join(str(self.checkpoint_dir), f"{prefix}{i}{DEFAULT_SUFFIX}"),
                            f"{prefix}{i}{DEFAULT_SUFFIX}", byte_data if i == 0 else [], bucket)
                           for i, bucket in enumerate(_split(items, threads))]
            self.has_data_to_write = bool(plan.items)
            self.write_buckets = self.staged if plan.items else []  # NVRx 0.4 counts results
            self.consistent_data_identifier = None
            queue_fn = getattr(fsa, "get_write_results_queue", None) or fsa._get_write_results_queue
            self.results_queue = queue_fn() if plan.items else None

        def request(self, send_buffer: bool) -> dict[str, Any]:
            req = {"key": staging.key, "buffer": staging.buffer if send_buffer else None,
                   "buckets": self.staged}
            # torch >= 2.6 passes its stream transforms to _write_item (as NVRx itself does)
            req["transforms"] = [self.transforms] if hasattr(self, "transforms") else []
            return req

    return StagedWriter(path, thread_count=max(1, threads))


# ---------------------------------------------------------------------- writer process side
# The buffers this writer process has mapped, by staging key. NVRx runs write_staged as a plain
# function in its persistent child process, which holds no object of ours: the mapping has to
# outlive one request (the buffer is sent with the first request only) in the process itself.
_WORKER_BUFFERS: dict[str, torch.Tensor] = {}


def _region(base: torch.Tensor, slot: Slot) -> torch.Tensor:
    """A tensor whose storage is exactly ``slot``'s bytes of ``base`` (zero copy)."""
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    raw = (ctypes.c_char * slot.nbytes).from_address(base.data_ptr() + slot.offset)
    return torch.frombuffer(raw, dtype=slot.dtype).view(slot.shape)


def write_staged(rank: int, request: dict[str, Any], results_queue: Any) -> None:
    """Runs in NVRx's writer process: writes this rank's files from the shared buffer, then CRCs.

    The writing itself is NVRx's (``FileSystemWriterAsync`` bucket writer, which puts the
    DCP write results on ``results_queue``).
    """
    import warnings

    if request["buffer"] is not None:
        _WORKER_BUFFERS.clear()  # one buffer per training process: an older one is dead
        _WORKER_BUFFERS[request["key"]] = request["buffer"]
    base = _WORKER_BUFFERS.get(request["key"])
    if base is None:
        raise RuntimeError("the checkpoint writer lost its staging buffer (restarted?)")
    with warnings.catch_warnings():  # frombuffer on a ctypes array: "not writable" is fine here
        warnings.simplefilter("ignore", UserWarning)
        buckets = [(path, name, (byte_data, [(item, _region(base, slot)) for item, slot in tensors]))
                   for path, name, byte_data, tensors in request["buckets"]]
    nvrx_write_buckets(rank, buckets, results_queue, request.get("transforms", []))
    write_checksums([b[0] for b in buckets], rank)


def nvrx_write_buckets(rank: int, buckets: list, results_queue: Any, transforms: list) -> None:
    """NVRx's bucket writer, whichever this version has (0.4: multiproc, 0.6+: multithread)."""
    # FT: NVRx writes the DCP files (threads or processes per bucket) and reports WriteResults.
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
        FileSystemWriterAsync,
    )

    fn = getattr(FileSystemWriterAsync, "write_preloaded_data_multithread", None)
    if fn is None:
        fn = FileSystemWriterAsync.write_preloaded_data_multiproc
    if "open_file" in inspect.signature(fn).parameters:
        fn(transforms, False, open, rank, buckets, results_queue)
    else:
        fn(transforms, False, rank, buckets, results_queue)
