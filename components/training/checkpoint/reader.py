"""A faster reader for DCP checkpoints written by ``FileSystemWriter``.

Stock ``FileSystemReader.read_data`` ``torch.load``s one item after another from the file and
copies it into its target before the next read starts, so the disk idles while the host works.
``FastFileSystemReader`` reads the needed byte ranges in large chunks (``preadv``) on background
threads into reusable buffers (pinned for CUDA targets) while the calling thread takes each
chunk's items apart in memory: each ``torch.save`` item's small ``data.pkl`` goes through torch's
weights-only unpickler with its storage a view of the buffer, so the bytes are copied once,
buffer to target (``non_blocking`` from pinned memory). Items with stream transforms
(``transform_descriptors``) or a foreign byte order are deserialized the stock way, from memory.
"""

from __future__ import annotations

import io
import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

_WeightsOnlyUnpickler: Any
try:  # private, but stable since torch 2.1; without it read_data falls back to the stock path
    from torch._weights_only_unpickler import Unpickler as _WeightsOnlyUnpickler

    _FAST = hasattr(torch._C, "PyTorchFileReader") and hasattr(
        torch._C.PyTorchFileReader, "get_record_offset")
except ImportError:  # pragma: no cover - very old/new torch
    _WeightsOnlyUnpickler = None
    _FAST = False

CHUNK_BYTES = 256 << 20
MAX_BUFFER_BYTES = 1 << 30
MAX_GAP = 1 << 20  # unneeded bytes between two needed items that are read through, not skipped


@dataclass
class _Item:
    """One stored item (a ``torch.save`` blob or raw bytes) and the requests that read it."""

    offset: int
    length: int
    info: Any  # _StorageInfo
    reqs: list[ReadItem] = field(default_factory=list)


@dataclass
class _Chunk:
    """A byte range of one file, read with one call, covering whole items."""

    path: Path
    start: int
    end: int
    items: list[_Item] = field(default_factory=list)


class _MemFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview (no copy of the bytes)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """``narrow_tensor_by_index``: the sub-block of ``tensor`` at ``offsets`` of ``lengths``."""
    for dim, (off, length) in enumerate(zip(offsets, lengths, strict=True)):
        if off != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, off, length)
    return tensor


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a 1-D uint8 CPU tensor's bytes."""
    return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]  # numpy is a Buffer


def _read_at(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fills ``view`` from ``fd`` at ``offset``; a file that ends early is an error."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise OSError(f"{path}: file ends at byte {offset + got}, the checkpoint metadata "
                          f"needs bytes up to {offset + len(view)} (truncated or incomplete write?)")
        got += n


def _load_torch_save(buf: torch.Tensor, start: int, view: memoryview) -> torch.Tensor | None:
    """Unpickles the ``torch.save`` blob at ``buf[start:start+len(view)]``; storage is a view of buf.

    Returns None where the blob is not plain little/native-endian (the caller uses torch.load).
    """
    reader = torch._C.PyTorchFileReader(_MemFile(view))  # type: ignore[call-overload]
    if reader.has_record("byteorder") and reader.get_record("byteorder").decode() != sys.byteorder:
        return None
    base = buf.untyped_storage()
    storages: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(saved_id: Any) -> torch.storage.TypedStorage:
        typename, storage_type, key, _location, numel = saved_id
        typename = typename.decode("ascii") if isinstance(typename, bytes) else typename
        key = key.decode("ascii") if isinstance(key, bytes) else key
        if typename != "storage":
            raise RuntimeError(f"unexpected persistent id {typename!r} in a checkpoint item")
        if key not in storages:
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            nbytes = numel * dtype.itemsize
            name = f"data/{key}"
            off = reader.get_record_offset(name)
            size = reader.get_record_size(name) if hasattr(reader, "get_record_size") else nbytes
            if size != nbytes or off + nbytes > len(view):  # torch 2.11 has no get_record_size
                raise RuntimeError(f"checkpoint item record {name} is {size} bytes at {off}, "
                                   f"expected {nbytes} within the item's {len(view)}")
            pos = buf.storage_offset() + start + off
            storages[key] = torch.storage.TypedStorage(
                wrap_storage=base[pos:pos + nbytes], dtype=dtype, _internal=True)
        return storages[key]

    unpickler = _WeightsOnlyUnpickler(io.BytesIO(reader.get_record("data.pkl")), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    result = unpickler.load()
    if not isinstance(result, torch.Tensor):
        raise RuntimeError(f"checkpoint item holds a {type(result).__name__}, not a tensor")
    return result


class _Slot:
    """A reusable read buffer; ``events`` mark when in-flight copies out of it are done."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.events: list[Any] = []


class _Readers:
    """The background threads of one ``read_data``: each fills a free slot with the next chunk.

    Args:
        chunks: The chunks to read, in order.
        nthreads: Reader threads; one more slot than readers is the consuming thread's.
        pinned: Whether the buffers are pinned (the readers then use the current CUDA device).
        fill: Reads a chunk into a slot through the thread's open descriptors; returns the bytes.
    """

    def __init__(self, chunks: list[_Chunk], nthreads: int, pinned: bool,
                 fill: Callable[[_Slot, _Chunk, dict[Path, int]], torch.Tensor]) -> None:
        self.chunks = chunks
        self.fill = fill
        self.free: queue.Queue[_Slot] = queue.Queue()
        for _ in range(nthreads + 1):
            self.free.put(_Slot())
        self.cond = threading.Condition()
        self.ready: dict[int, Any] = {}
        self.next_index = 0
        self.stop = threading.Event()
        self.current = torch.cuda.current_device() if pinned else None
        self.threads = [threading.Thread(target=self.reader, name=f"dcp-read-{i}", daemon=True)
                        for i in range(nthreads)]

    def reader(self) -> None:
        """One reader thread, until every chunk is taken or :attr:`stop` is set."""
        if self.current is not None:
            torch.cuda.set_device(self.current)  # pinned allocations/events: no context on GPU 0
        fds: dict[Path, int] = {}
        try:
            while not self.stop.is_set():
                try:
                    slot = self.free.get(timeout=0.05)
                except queue.Empty:
                    continue
                with self.cond:  # the slot first, then the index: the oldest chunk always has one
                    index = self.next_index
                    self.next_index += 1
                if index >= len(self.chunks):
                    return
                try:
                    ready_item: Any = (slot, self.fill(slot, self.chunks[index], fds))
                except BaseException as err:  # noqa: B036 - handed to the consuming thread
                    ready_item = err
                with self.cond:
                    self.ready[index] = ready_item
                    self.cond.notify_all()
        finally:
            for fd in fds.values():
                os.close(fd)

    def take(self, index: int) -> tuple[_Slot, torch.Tensor]:
        """Waits for chunk ``index``: its slot and bytes; raises what its reader raised."""
        with self.cond:
            while index not in self.ready:
                if not any(t.is_alive() for t in self.threads):
                    raise RuntimeError("checkpoint reader threads exited early")
                self.cond.wait(timeout=0.5)
            got = self.ready.pop(index)
        if isinstance(got, BaseException):
            raise got
        return got


class FastFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_data`` reads large chunks in the background.

    Args:
        path: The checkpoint directory.
        chunk_bytes: Bytes of one read, at most, unless one item is larger (it is read whole).
        num_threads: Reader threads (chunks read concurrently, each through its own descriptor).
            Each holds a buffer of max(chunk_bytes, largest item) bytes, plus one the calling
            thread consumes: 5 x 256 MiB for a 1B-parameter model's full checkpoint.
        max_buffer_bytes: Items larger than this get a one-off (pageable) buffer, not a slot.
        pin_memory: Pin the buffers; None pins when CUDA is available and a target is on CUDA.
        **kwargs: Passed to ``FileSystemReader``.
    """

    def __init__(self, path: str | os.PathLike, chunk_bytes: int = CHUNK_BYTES,
                 num_threads: int = 4, pin_memory: bool | None = None,
                 max_buffer_bytes: int = MAX_BUFFER_BYTES, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.chunk_bytes = int(chunk_bytes)
        self.num_threads = max(1, int(num_threads))
        self.max_buffer_bytes = int(max_buffer_bytes)
        self.pin_memory = pin_memory

    def _chunks(self, plan: LoadPlan) -> list[_Chunk]:
        """Groups the plan's requests by stored item, then items into per-file read chunks."""
        items: dict[tuple[str, int, int], _Item] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            key = (info.relative_path, info.offset, info.length)
            items.setdefault(key, _Item(info.offset, info.length, info)).reqs.append(req)
        chunks: list[_Chunk] = []
        for (rel, _, _), item in sorted(items.items(), key=lambda kv: kv[0]):
            path = Path(self.fs.concat_path(self.path, rel))
            last = chunks[-1] if chunks else None
            if (last is None or last.path != path or item.offset - last.end > MAX_GAP
                    or item.offset + item.length - last.start > self.chunk_bytes):
                last = _Chunk(path, item.offset, item.offset)
                chunks.append(last)
            last.items.append(item)
            last.end = max(last.end, item.offset + item.length)
        return chunks

    def _want_pinned(self, plan: LoadPlan, planner: LoadPlanner) -> bool:
        if self.pin_memory is not None:
            return self.pin_memory and torch.cuda.is_available()
        if not torch.cuda.is_available():
            return False
        req = next((r for r in plan.items if r.type != LoadItemType.BYTE_IO), None)
        return req is not None and planner.resolve_tensor(req).device.type == "cuda"

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads the plan's items into the planner's tensors (and ``load_bytes``), see module doc."""
        if not _FAST or not plan.items:
            return super().read_data(plan, planner)
        chunks = self._chunks(plan)
        pinned = self._want_pinned(plan, planner)
        nthreads = min(self.num_threads, len(chunks))
        capacity = min(max(c.end - c.start for c in chunks), self.max_buffer_bytes)
        readers = _Readers(chunks, nthreads, pinned,
                           lambda slot, chunk, fds: self._fill(slot, chunk, fds, pinned, capacity))
        devices: set[torch.device] = set()
        current = readers.current
        for t in readers.threads:
            t.start()
        try:
            for index, chunk in enumerate(chunks):
                slot, buf = readers.take(index)
                for device in self._consume(chunk, buf, planner, pinned):
                    slot.events.append(torch.cuda.Event())
                    slot.events[-1].record(torch.cuda.current_stream(device))
                    devices.add(device)
                readers.free.put(slot)
        finally:
            readers.stop.set()
            for t in readers.threads:
                t.join()
            if pinned:  # also on errors: no copy may still read a buffer once it is freed
                for device in devices | {torch.device("cuda", current or 0)}:
                    torch.cuda.current_stream(device).synchronize()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _fill(self, slot: _Slot, chunk: _Chunk, fds: dict[Path, int], pinned: bool,
              capacity: int) -> torch.Tensor:
        """Reads ``chunk`` into the slot's buffer (or a one-off buffer if the chunk is larger)."""
        for event in slot.events:
            event.synchronize()  # copies out of this buffer have finished
        slot.events = []
        span = chunk.end - chunk.start
        if span > capacity:
            buf = torch.empty(span, dtype=torch.uint8)
        else:
            if slot.buf is None:
                slot.buf = torch.empty(capacity, dtype=torch.uint8, pin_memory=pinned)
            buf = slot.buf[:span]
        if chunk.path not in fds:
            fds[chunk.path] = os.open(chunk.path, os.O_RDONLY)
            os.posix_fadvise(fds[chunk.path], 0, 0, os.POSIX_FADV_SEQUENTIAL)
        _read_at(fds[chunk.path], _byte_view(buf), chunk.start, chunk.path)
        return buf

    def _consume(self, chunk: _Chunk, buf: torch.Tensor, planner: LoadPlanner,
                 pinned: bool) -> set[torch.device]:
        """Deserializes the chunk's items from memory and hands them to the planner.

        Returns:
            The CUDA devices that ``non_blocking`` copies out of ``buf`` went to.
        """
        mem = _byte_view(buf)
        devices: set[torch.device] = set()
        for item in chunk.items:
            start = item.offset - chunk.start
            view = mem[start:start + item.length]
            if item.reqs[0].type == LoadItemType.BYTE_IO:
                for req in item.reqs:
                    planner.load_bytes(req, io.BytesIO(self._stream(req, item, view).read()))
                continue
            tensor = None
            if not getattr(item.info, "transform_descriptors", None):
                tensor = _load_torch_save(buf, start, view)
            if tensor is None:  # transformed or foreign byte order: stock deserialization
                stream = self._stream(item.reqs[0], item, view)
                stream = stream if stream.seekable() else io.BytesIO(stream.read())
                tensor = torch.load(stream, map_location="cpu", weights_only=True)
            for req in item.reqs:
                src = _narrow(tensor, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != src.size():
                    raise AssertionError(f"req {req.storage_index} mismatch sizes "
                                         f"{target.size()} vs {src.size()}")
                async_copy = pinned and target.device.type == "cuda"
                target.copy_(src, non_blocking=async_copy)
                if async_copy:
                    devices.add(target.device)
                planner.commit_tensor(req, target)
        return devices

    def _stream(self, req: ReadItem, item: _Item, view: memoryview) -> Any:
        """The item's bytes as a file, through the reader's stream transforms if it has any."""
        raw = _MemFile(view)
        transforms = getattr(self, "transforms", None)
        descriptors = getattr(item.info, "transform_descriptors", None) or ()
        if transforms is None or not descriptors:
            return raw
        return transforms.transform_load_stream(req, descriptors, raw)


def load(state_dict: dict[str, Any], path: str | os.PathLike, process_group: Any = None,
         planner: Any = None, **reader_kwargs: Any) -> None:
    """``dcp.load(state_dict)`` from ``path`` through ``FastFileSystemReader``, in place.

    Args:
        state_dict: The state to load into (tensors are filled in place, as with ``dcp.load``).
        path: The checkpoint directory.
        process_group: Passed to ``dcp.load``.
        planner: Passed to ``dcp.load`` (None: the default planner).
        **reader_kwargs: ``FastFileSystemReader`` options (chunk_bytes, num_threads, pin_memory,
            max_buffer_bytes).
    """
    dcp.load(state_dict, storage_reader=FastFileSystemReader(path, **reader_kwargs),
             process_group=process_group, planner=planner)
