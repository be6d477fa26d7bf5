"""The writer side of a staged save: the DCP writer fed from a staging bank, and its worker job.

DCP plans with the live state (so the metadata, e.g. DTensor shards, is the real one); the write
items then read from the staging bank (:mod:`.staging`) instead of the tensors. NVRx's persistent
writer process maps each bank file once (by path, the first request naming it) and writes from
zero-copy views with storages of exactly each tensor's bytes (``torch.save`` serialises a view's
whole storage, which would be the whole buffer).
"""

from __future__ import annotations

import ctypes
import inspect
import mmap
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kfp_nvrx.components.training.checkpoint.staging import Slot

#: The store's hand-over of one rank's written files (:meth:`.CheckpointStore.seal_files` with
#: the step and rank bound): run in the writer process, so it is pickled with the request.
Seal = Callable[[list[str]], None]

if TYPE_CHECKING:
    from kfp_nvrx.components.training.checkpoint.bank import _Bank
    from kfp_nvrx.components.training.checkpoint.staging import HostStaging


def _split(items: list[tuple[Any, Slot]], n: int) -> list[list[tuple[Any, Slot]]]:
    """Greedy split into ``n`` buckets of similar byte size (largest items first)."""
    buckets: list[list[tuple[Any, Slot]]] = [[] for _ in range(max(1, n))]
    sizes = [0] * len(buckets)
    for entry in sorted(items, key=lambda e: -e[1].nbytes):
        i = sizes.index(min(sizes))
        buckets[i].append(entry)
        sizes[i] += entry[1].nbytes
    return [b for b in buckets if b] or [[]]


def staged_writer(path: str, staging: HostStaging, bank: _Bank, seal: Seal, threads: int = 1,
                  delay_s: float = 0.0) -> Any:
    """An NVRx ``FileSystemWriterAsync`` whose data comes from ``bank`` of ``staging``.

    DCP plans with the live state (so the metadata, e.g. DTensor shards, is the real one); instead
    of resolving (and, NVRx >= 0.6, cloning) tensors, ``prepare_write_data`` records which buffer
    slot each write item reads, split into ``threads`` files written in parallel; the non-tensor
    leaves are the ones the bank captured with its snapshot (the live state may be steps newer).
    ``request`` then describes the write for :func:`write_staged`, which hands the files to the
    store's ``seal``; ``delay_s`` slows it (the ``slow-write`` fault).
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
                    fqn = item.index.fqn
                    data = (planner.transform_object(item, bank.objects[fqn])
                            if fqn in bank.objects else planner.resolve_data(item))
                    byte_data.append((item, data))
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

        def request(self) -> dict[str, Any]:
            req = {"key": bank.key, "path": str(bank.path), "nbytes": staging.nbytes,
                   "buckets": self.staged, "delay_s": delay_s, "seal": seal}
            # torch >= 2.6 passes its stream transforms to _write_item (as NVRx itself does)
            req["transforms"] = [self.transforms] if hasattr(self, "transforms") else []
            return req

    return StagedWriter(path, thread_count=max(1, threads))


# ---------------------------------------------------------------------- writer process side
# The banks this writer process has mapped, by key. NVRx runs write_staged as a plain function in
# its persistent child process, which holds no object of ours: the mapping has to outlive one
# request in the process itself.
_WORKER_BUFFERS: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}


def _mapped(key: str, path: str, nbytes: int) -> torch.Tensor:
    """The bank file ``path`` mapped into this (writer) process, once per key."""
    if key not in _WORKER_BUFFERS:
        generation = key.rsplit("-", 2)[0]  # pid-generation: another layout's banks are dead
        for old in [k for k in _WORKER_BUFFERS if not k.startswith(generation + "-")]:
            del _WORKER_BUFFERS[old]
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _WORKER_BUFFERS[key] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
    return _WORKER_BUFFERS[key][1]


def _region(base: torch.Tensor, slot: Slot) -> torch.Tensor:
    """A tensor whose storage is exactly ``slot``'s bytes of ``base`` (zero copy)."""
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    raw = (ctypes.c_char * slot.nbytes).from_address(base.data_ptr() + slot.offset)
    return torch.frombuffer(raw, dtype=slot.dtype).view(slot.shape)


def write_staged(rank: int, request: dict[str, Any], results_queue: Any) -> None:
    """Runs in NVRx's writer process: writes this rank's files from the bank, then seals them.

    The writing itself is NVRx's (``FileSystemWriterAsync`` bucket writer, which puts the
    DCP write results on ``results_queue``).
    """
    import time
    import warnings

    time.sleep(request.get("delay_s", 0.0))  # the slow-write fault: a slow store, on purpose
    base = _mapped(request["key"], request["path"], request["nbytes"])
    with warnings.catch_warnings():  # frombuffer on a ctypes array: "not writable" is fine here
        warnings.simplefilter("ignore", UserWarning)
        buckets = [(path, name, (byte_data, [(item, _region(base, slot)) for item, slot in tensors]))
                   for path, name, byte_data, tensors in request["buckets"]]
    nvrx_write_buckets(rank, buckets, results_queue, request.get("transforms", []))
    request["seal"]([b[0] for b in buckets])  # the store's: checksums, or an upload


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
