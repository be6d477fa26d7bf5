"""NVRx's persistent checkpoint writer process, owned by one :class:`NvrxWriter` per worker process.

The writer outlives in-process restarts (like the staging buffer): an incarnation that aborts kills
its process, and the next incarnation's first save starts a new one. Every process it started stays
on its list until reaped, so a kill that an async exception interrupted is finished by the next
``kill()`` or at interpreter exit. Writer processes are not daemons: one left running would block
interpreter exit (multiprocessing joins its children) forever.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import os
import signal
import threading
import time
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A save that failed or did not finish in time (never swallowed)."""


@functools.cache
def _caller_class() -> type:
    """NVRx's ``PersistentAsyncCaller``, made safe to drop after its process was killed.

    NVRx's ``__del__`` runs ``close()``, which joins the writer's request queue: after a kill that
    waits forever (an in-process restart's async exception can land while the caller is being
    dropped; the rank then went unresponsive and the wrapper dropped it from the world).
    """
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import PersistentAsyncCaller

    class Caller(PersistentAsyncCaller):
        abandoned = False  # its process was killed: nothing to close

        def __del__(self) -> None:
            if not self.abandoned:
                super().__del__()

    return Caller


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


class NvrxWriter:
    """NVRx's persistent async writer process: started once, fed save requests, killed on abort.

    Args:
        device: The training device (on CPU the worker skips its CUDA setup where NVRx allows).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Whether the writer process needs CUDA: only NVRx's own staging (D2H in the worker
        # from CUDA IPC handles). Writing from our host banks needs none, and a CUDA context
        # there holds GPU memory that ft_launcher waits to see freed before every restart.
        self.worker_cuda = device.type == "cuda"
        self._caller: Any = None  # the running Caller, None until the first request
        self._warming = False  # the warm-up request may still be running
        self._procs: list[Any] = []  # processes started here and not yet seen reaped
        # Registered after multiprocessing's own exit hook (imported with torch), so it runs first.
        atexit.register(self.kill)

    @property
    def started(self) -> bool:
        """Whether a writer process is running (or starting)."""
        return self._caller is not None

    def warm_up(self) -> None:
        """Starts the writer process now, so the first save does not pay for spawning it (seconds).

        The warm-up request imports the DCP writer in the worker, so the first real save does not
        pay for that either (seconds on a busy host).
        """
        if self._caller is not None:
            return
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

        writer_module = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"
        self.schedule(AsyncRequest(importlib.import_module, (writer_module,), []))
        self._warming = True
        try:  # the writer's results queue is a multiprocessing Manager: another process to spawn
            from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

            queue = filesystem_async._get_write_results_queue()
        except (ImportError, AttributeError):  # other NVRx versions: created on first save
            return
        # The Manager process unpickles every call's arguments: the writer's first results made
        # it import torch and DCP, which held the first commit back by seconds (until the next
        # save waited for it). Priming it in the background moves that off the first save.
        threading.Thread(target=_prime_results_queue, args=(queue,),
                         name="kfp-nvrx-results-queue", daemon=True).start()

    def wait_started(self, timeout: float) -> None:
        """Waits for the warm-up request (the process is up and has imported the DCP writer)."""
        if not self._warming:
            return
        deadline = time.monotonic() + timeout
        while not self._caller.is_current_async_call_done(blocking=False, no_dist=True):
            if not self._caller.process.is_alive() or time.monotonic() > deadline:
                raise CheckpointError("the NVRx checkpoint writer process did not start")
            time.sleep(0.01)
        self._warming = False

    def up(self) -> bool:
        """Whether the writer process is up and idle (never blocks); starts it if none runs."""
        if self._caller is None:
            self.warm_up()
            return False
        if self._warming:
            if not self._caller.is_current_async_call_done(blocking=False, no_dist=True):
                return False
            self._warming = False
        return True

    def schedule(self, request: Any) -> None:
        """Hands ``request`` (an NVRx ``AsyncRequest``) to the writer process, starting it if needed.

        On CPU, and on CUDA when our staging banks feed the writer (:meth:`use_cuda`), the worker
        skips its CUDA setup where NVRx has that switch (NVRx >= 0.6 makes it call
        ``torch.cuda.set_device`` unless ``cpu_shm_mode``).
        """
        if self._caller is None:
            # FT: NVRx persistent async checkpoint worker (spawned once, reused by every save).
            caller_cls = _caller_class()
            cpu = self.device.type != "cuda" or not self.worker_cuda
            if cpu and "cpu_shm_mode" in inspect.signature(caller_cls).parameters:
                self._caller = caller_cls(cpu_shm_mode=True)
            else:
                self._caller = caller_cls()
        self._caller.schedule_async_call(request)
        self.track(self._caller.process)

    def use_cuda(self, wanted: bool) -> None:
        """Sets whether the writer process gets a CUDA context.

        A running writer of the other kind is replaced (killed now; the next request starts one).
        """
        wanted = wanted and self.device.type == "cuda"
        if wanted != self.worker_cuda:
            self.worker_cuda = wanted
            if self.started:
                self.abort()

    def done(self, wait_s: float, what: str) -> bool:
        """Whether the current request finished, waiting at most ``wait_s`` seconds.

        Raises:
            CheckpointError: The writer process died (``what`` names the save in the message).
        """
        caller = self._caller
        deadline = time.monotonic() + wait_s
        while True:
            if caller is None or caller.is_current_async_call_done(blocking=False, no_dist=True):
                return True
            if caller.process is not None and not caller.process.is_alive():
                raise CheckpointError(f"{what}: the NVRx writer process died "
                                      f"(exit code {caller.process.exitcode})")
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        """Stops the writer process after its queued requests (NVRx's orderly shutdown)."""
        caller, self._caller, self._warming = self._caller, None, False
        if caller is not None:
            caller.close()
        self.kill()  # reaps the closed process (and any an interrupted abort left)

    def abort(self) -> None:
        """Kills the writer process now (error path).

        NVRx's own shutdown joins its queue and would hang forever after a failed collective.
        """
        if self._caller is not None:
            # FT: NVRx's writer is killed, not closed: flagged before the last reference goes.
            self._caller.abandoned = True
        self._caller, self._warming = None, False
        self.kill()

    def track(self, process: Any) -> None:
        """Takes charge of ``process``: :meth:`kill` (and interpreter exit) kills and reaps it."""
        if process is not None and process not in self._procs:
            self._procs.append(process)

    def kill(self, reap_timeout: float = 5.0) -> None:
        """Kills and reaps every process still tracked (abort path and interpreter exit).

        A process leaves the list only once reaped (or after ``reap_timeout`` seconds, e.g. stuck
        in uninterruptible I/O), so an async exception (in-process restart) that interrupts this
        leaves the rest for the next call.
        """
        for proc in list(self._procs):
            if proc.exitcode is None:
                _kill_tree(proc.pid)
            # Not join(): NVRx's writer forks child write processes that inherit the write end of
            # its exit-sentinel pipe, so join() sat out its whole timeout (10 s, longer than a
            # learned heartbeat timeout during an in-process restart). exitcode polls waitpid.
            deadline = time.monotonic() + reap_timeout
            while proc.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.005)
            self._procs.remove(proc)

    @property
    def processes(self) -> tuple[Any, ...]:
        """The processes tracked (started and not yet reaped)."""
        return tuple(self._procs)


def _kill_tree(pid: int) -> None:
    """SIGKILLs a writer and all its descendants (NVRx's forked write processes).

    The writer is stopped first so it cannot fork more while its tree is listed. psutil comes
    with nvidia-resiliency-ext, the only source of tracked writers.
    """
    import psutil

    try:
        writer = psutil.Process(pid)
        writer.suspend()
        procs = [*writer.children(recursive=True), writer]
    except psutil.Error:  # already gone (or a zombie waiting to be reaped)
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    if not procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
