"""The NVRx side of :class:`~checkpoint.Checkpointer`: its persistent writer process and save paths.

Mixed into ``Checkpointer`` (which holds the state: ``cfg``, ``device``, ``rank``, ``staging``,
``_caller``, ``_pending``, ``_plan_cache``, ``inflight``): starting NVRx's persistent async worker,
the staged save (our pinned buffer, NVRx's planning and writer), NVRx's own staging (``nvrx``) and
the collective finalisation of a DCP save.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kfp_nvrx.components.train_fsdp.trainer.checkpoint_files import (
    CheckpointError,
    _snapshot,
    _track,
    _write_then_checksum,
)
from kfp_nvrx.components.train_fsdp.trainer.staging import staged_writer, write_staged


def _prime_results_queue(queue: Any) -> None:
    """Makes the Manager behind NVRx's write-results queue import the DCP result classes now.

    The Manager's server unpickles a call's arguments before it runs the call: ``qsize(probe)``
    with a ``WriteResult`` makes it import torch and DCP, then fails with a ``TypeError`` (qsize
    takes no argument) without touching the queue, so it cannot take or add an item even if the
    writer's first results arrive meanwhile. Nothing waits for this: the writer's first ``put`` at
    most waits for the rest of the import.
    """
    # FT: NVRx's results queue (filesystem_async), warmed before the first async save.
    try:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.storage import WriteResult

        probe = WriteResult(index=MetadataIndex("kfp-nvrx-warm-up"), size_in_bytes=0,
                            storage_data=_StorageInfo("", 0, 0))
        queue.qsize(probe)
    except Exception:  # noqa: BLE001 - the expected TypeError, or a failure the save will report
        pass


class NvrxWriterMixin:
    """NVRx's persistent writer and the save paths that feed it."""

    def warm_up(self) -> None:
        """Starts NVRx's persistent writer process now.

        The first save then does not pay for spawning a Python interpreter (seconds) inside the
        training loop.
        """
        if not self.cfg.async_save or self._caller is not None:
            return
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

        # The warm-up call imports the DCP writer in the worker, so the first real save does not
        # pay for that either (seconds on a busy host).
        writer_module = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"
        self._schedule(AsyncRequest(importlib.import_module, (writer_module,), []))
        self._warming = True
        try:  # the writer's results queue is a multiprocessing Manager: another process to spawn
            from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

            queue = filesystem_async._get_write_results_queue()
        except (ImportError, AttributeError):  # other NVRx versions: created on first save
            return
        # The Manager process unpickles every call's arguments: the writer's first results made
        # it import torch and DCP, which held the first commit back by seconds (until the next
        # save waited for it). Priming it in the background moves that off the first save.
        self._priming = threading.Thread(target=_prime_results_queue, args=(queue,),
                                         name="kfp-nvrx-results-queue", daemon=True)
        self._priming.start()

    def _schedule(self, request: Any) -> None:
        """Hands ``request`` to NVRx's persistent writer process, starting it if there is none.

        On CPU the worker skips its CUDA setup where NVRx has that switch (NVRx >= 0.6 makes it
        call ``torch.cuda.set_device`` unless ``cpu_shm_mode``).
        """
        if self._caller is None:
            from nvidia_resiliency_ext.checkpointing.async_ckpt.core import PersistentAsyncCaller

            # FT: NVRx persistent async checkpoint worker (spawned once, reused by every save).
            cpu = self.device.type != "cuda"
            if cpu and "cpu_shm_mode" in inspect.signature(PersistentAsyncCaller).parameters:
                self._caller = PersistentAsyncCaller(cpu_shm_mode=True)
            else:
                self._caller = PersistentAsyncCaller()
        self._caller.schedule_async_call(request)
        _track(self._caller)

    def _finish_warm_up(self) -> None:
        if self._warming:
            deadline = time.monotonic() + self.cfg.finalize_timeout
            while not self._caller.is_current_async_call_done(blocking=False, no_dist=True):
                if not self._caller.process.is_alive() or time.monotonic() > deadline:
                    raise CheckpointError("the NVRx checkpoint writer process did not start")
                time.sleep(0.01)
            self._warming = False

    # ---------------------------------------------------------------- save

    def _save_staged(self, path: Path, state: dict[str, Any], flat: dict[str, Any],
                     step: int) -> list[Callable[[], None]]:
        # FT: NVRx async DCP planning and writer, fed from our pinned staging buffer.
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_plan,
        )
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        # The writer process must be up before the copies are handed to it. Waiting here keeps that
        # (seconds, on the first save only) inside the checkpoint section: waited for in the next
        # step's _submit, it inflated the learned step timeout (hang detection 6 s -> 16 s).
        self._finish_warm_up()
        writer = staged_writer(str(path), self.staging, self.cfg.write_threads)
        cache = self._plan_cache
        if cache is not None and self._all(cache[0] == self.staging.key):
            # Same layout as the last save (same keys, shapes, shards): its plan and metadata hold;
            # only the bytes entries are resolved again. Planning is collective and pickles every
            # item: ~0.1 s of GPU idle time per save for a 1B model.
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
            self._plan_cache = (self.staging.key, writer.central_plan, plan[1], plan[2])
        # D2H starts now, after planning: planning's collectives sync on small device-to-host
        # copies, which would queue behind the staging copies on the copy engine.
        self.staging.stage(flat, step)
        self._pending = writer
        if self.mode == "blocking":
            self._submit()
        return [lambda: self._finalize_dcp(*plan)]

    def _submit(self) -> None:
        """Hands the staged save to NVRx's persistent writer (the buffer once per writer)."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

        writer, self._pending = self._pending, None
        self.staging.synchronize()  # the writer reads the buffer: the copies must be complete
        send = getattr(self._caller, "_kfp_staging_key", None) != self.staging.key
        self._schedule(AsyncRequest(
            write_staged, (self.rank, writer.request(send), writer.results_queue), []))
        self._caller._kfp_staging_key = self.staging.key

    def _save_async(self, path: Path, state: dict[str, Any]) -> list[Callable[[], None]]:
        # FT: NVRx async DCP writer: plan collectively, stage, write in a persistent worker.
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
            FileSystemWriterAsync,
        )
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_plan,
        )

        self._finish_warm_up()
        kwargs = {}
        if "use_cached_data_structure" in inspect.signature(FileSystemWriterAsync).parameters:
            # NVRx >= 0.6 sends CUDA IPC handles to its worker, which does the D2H; cached, the
            # worker keeps them between saves (same plan and storages) instead of reopening
            # hundreds of handles inside every save's blocking part.
            kwargs["use_cached_data_structure"] = self.device.type == "cuda"
        writer = FileSystemWriterAsync(str(path), thread_count=1, **kwargs)
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
            self._schedule(AsyncRequest(functools.partial(_write_then_checksum, save_fn),
                                        tuple(args), [], preload_fn=preload_fn))
        return [lambda: self._finalize_dcp(*plan)]

    def _finalize_dcp(self, writer: Any, metadata: Any, dist_wrapper: Any) -> None:
        """NVRx's ``save_state_dict_async_finalize``, with the failure flag on our device.

        Collective: gathers every rank's write results; the coordinator writes ``.metadata``.
        (NVRx >= 0.6 broadcasts the flag on ``torch.cuda.current_device()``, which fails on CPU.)
        """
        from torch.distributed.checkpoint.utils import _get_failure_dict

        all_results = dist_wrapper.gather_object(writer.retrieve_write_results())
        failures = {}
        if dist_wrapper.is_coordinator:
            failures = _get_failure_dict(all_results)
            if not failures:
                writer.finish(metadata, all_results)
        if not self._all(not failures):  # MIN over ranks: only the coordinator can see failures
            raise CheckpointError(f"checkpoint write failed: {failures or 'on another rank'}")
