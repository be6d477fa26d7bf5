"""How an async save's data reaches NVRx's writer: planning, staging hand-off and finalisation.

Two paths, both DCP saves written by NVRx's persistent worker (:class:`~.writer.NvrxWriter`):

* staged: our pinned, shared buffer (:mod:`.staging`) holds the copy; NVRx plans the save and its
  writer reads from the buffer. The plan is cached while the layout stays the same.
* NVRx staging (``checkpoint.staging=nvrx``, or when the buffer is unavailable): NVRx's own
  ``FileSystemWriterAsync`` stages (GPU: D2H in its worker; CPU: a clone here, because NVRx <= 0.4
  does not snapshot CPU tensors).

Finalisation gathers the write results (collective); the coordinator's ``.metadata`` write is
handed back to the Checkpointer, which runs it off the loop (:mod:`.commit`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from kfp_nvrx.components.training.checkpoint.bank import _Bank
from kfp_nvrx.components.training.checkpoint.staged_write import (
    Seal,
    staged_writer,
    write_staged,
)
from kfp_nvrx.components.training.checkpoint.staging import HostStaging
from kfp_nvrx.components.training.checkpoint.writer import CheckpointError, NvrxWriter
from kfp_nvrx.components.training.ranks import all_ranks

#: A save's collective finalisation: gathers write results, returns the coordinator's file work.
Gather = Callable[[], Callable[[], None] | None]


class AsyncSaver:
    """Feeds one incarnation's async saves to the NVRx writer.

    Args:
        writer: The worker process's NVRx writer (outlives in-process restarts).
        device: The training device.
        rank: This rank.
        write_threads: Files (and writer threads) per rank for staged saves.
        start_timeout: Seconds the writer process may take to start.
    """

    def __init__(self, writer: NvrxWriter, device: torch.device, rank: int, write_threads: int,
                 start_timeout: float) -> None:
        self.writer = writer
        self.device = device
        self.rank = rank
        self.write_threads = write_threads
        self.start_timeout = start_timeout
        # (staging key, central plan, metadata, dist wrapper) of the last staged save. Per
        # incarnation: the dist wrapper belongs to this process group.
        self._plan_cache: tuple | None = None

    def staged(self, path: str, state: dict[str, Any], staging: HostStaging, bank: _Bank,
               seal: Seal, delay_s: float = 0.0) -> Gather:
        """Plans the write of the complete snapshot in ``bank``, hands it to the writer.

        ``state`` is a state dict of the snapshot's layout (the live one: the plan and the
        metadata come from it); the bytes come from the bank, whose copies must be complete.
        ``path`` is the store's spool folder; the writer process hands the files it wrote there
        to ``seal`` (the store's). ``delay_s`` slows the write (the ``slow-write`` fault).
        Returns the finalise step.
        """
        # FT: NVRx async DCP planning and writer, fed from our pinned staging bank.
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_plan,
        )
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        writer = staged_writer(path, staging, bank, seal, self.write_threads, delay_s)
        cache = self._plan_cache
        if cache is not None and all_ranks(cache[0] == staging.layout_key, self.device):
            # Same layout as the last save (same keys, shapes, shards): its plan and metadata hold;
            # only the bytes entries are resolved again. Planning is collective and pickles every
            # item: GPU idle time on every save (docs/benchmarks/NOTES.md has the figures).
            _, central_plan, metadata, dist_wrapper = cache
            planner = DefaultSavePlanner()
            planner.set_up_planner(state, is_coordinator=dist_wrapper.is_coordinator)
            writer.set_up_storage_writer(dist_wrapper.is_coordinator)
            writer.prepare_write_data(central_plan, planner)
            if metadata is not None and hasattr(writer, "storage_meta"):
                metadata.storage_meta = writer.storage_meta()
            plan = (writer, metadata, dist_wrapper)
        else:
            plan = save_state_dict_async_plan(state, writer)
            self._plan_cache = (staging.layout_key, writer.central_plan, plan[1], plan[2])
        # The writer process maps the bank's file by path and writes from it.
        self.writer.schedule(AsyncRequest(
            write_staged, (self.rank, writer.request(), writer.results_queue), []))
        return lambda: self._gather(*plan)

    def nvrx_staged(self, path: str, state: dict[str, Any], seal: Seal) -> Gather:
        """Starts a save staged by NVRx into the spool ``path``; returns the finalise step."""
        # FT: NVRx async DCP writer: plan collectively, stage, write in a persistent worker.
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
            FileSystemWriterAsync,
        )
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_plan,
        )

        self.writer.wait_started(self.start_timeout)
        kwargs = {}
        if "use_cached_data_structure" in inspect.signature(FileSystemWriterAsync).parameters:
            # NVRx >= 0.6 sends CUDA IPC handles to its worker, which does the D2H; cached, the
            # worker keeps them between saves (same plan and storages) instead of reopening
            # hundreds of handles inside every save's blocking part.
            kwargs["use_cached_data_structure"] = self.device.type == "cuda"
        writer = FileSystemWriterAsync(path, thread_count=1, **kwargs)
        plan = save_state_dict_async_plan(state, writer)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        if self.device.type != "cuda" and hasattr(writer, "write_buckets"):
            # CPU, NVRx <= 0.4: its staging assumes CUDA and would not copy CPU tensors:
            # snapshot here. (NVRx >= 0.6 clones CPU tensors itself and builds the write
            # buckets in its worker, from preload_fn.)
            writer.write_buckets = _snapshot(writer.write_buckets)
            args = [args[0], writer.write_buckets, *args[2:]]
            preload_fn = None
        if save_fn is not None:
            # Blocks until the worker staged the tensors (GPU D2H) or queued the snapshot.
            # The worker puts preload_fn's staged buckets in place of args[1]: keep it there.
            self.writer.schedule(AsyncRequest(functools.partial(_write_then_seal, save_fn, seal),
                                              tuple(args), [], preload_fn=preload_fn))
        return lambda: self._gather(*plan)

    def _gather(self, writer: Any, metadata: Any, dist_wrapper: Any) -> Callable[[], None] | None:
        """NVRx's ``save_state_dict_async_finalize``, split: returns the coordinator's file work.

        Collective: gathers every rank's write results and raises on any failure (the flag is
        reduced on our device: NVRx >= 0.6 broadcasts it on ``torch.cuda.current_device()``, which
        fails on CPU). The returned callable (coordinator only; None elsewhere) writes
        ``.metadata``; the Checkpointer runs it off the loop, before the commit marker.
        """
        from torch.distributed.checkpoint.utils import _get_failure_dict

        try:
            mine = writer.retrieve_write_results()
        except (OSError, EOFError, RuntimeError) as err:
            # The results queue's manager process died (a stop's SIGTERM reaches the whole
            # process group): told to every rank below, never raised before the collective.
            mine = f"the write results were lost ({type(err).__name__}: {err})"
        all_results = dist_wrapper.gather_object(mine)
        failures: dict[int, Any] = {}
        if dist_wrapper.is_coordinator:
            failures = {i: r for i, r in enumerate(all_results) if isinstance(r, str)}
            failures = failures or _get_failure_dict(all_results)
        if not all_ranks(not failures, self.device):  # only the coordinator can see failures
            raise CheckpointError(f"checkpoint write failed: {failures or 'on another rank'}")
        if not dist_wrapper.is_coordinator:
            return None
        return functools.partial(writer.finish, metadata, all_results)


def _write_then_seal(save_fn: Callable, seal: Seal, rank: int, write_buckets: list,
                     *rest: Any) -> None:
    """The writer process's job: NVRx's write, then the store takes the files it wrote."""
    save_fn(rank, write_buckets, *rest)
    seal([bucket[0] for bucket in write_buckets])


def _snapshot(obj: Any) -> Any:
    """Clones CPU tensors inside NVRx write buckets (the CPU path's staging)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, list):
        return [_snapshot(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_snapshot(x) for x in obj)
    return obj
