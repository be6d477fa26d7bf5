"""The in-process restart's abort: NCCL aborts started on threads, torch's groups forgotten at once.

NVRx's ``AbortTorchDistributed`` aborts every NCCL communicator and then destroys the process
groups, waiting for both. ``ncclCommAbort`` sets the communicator's abort flag first (what
unblocks a rank stuck in a collective: its kernels exit) and then joins the communicator's
proxy-service and UDS threads, each of which sees the abort only when its 500 ms ``poll``
returns: 0.5-1.0 s of an in-process restart whatever the model (docs/benchmarks/NOTES.md), and
no NCCL or NVRx setting shortens it. Here the aborts and the groups' shutdown run on a thread,
and torch's process-group bookkeeping is cleared at once, as ``destroy_process_group`` clears
it, so that the next iteration's ``init_process_group`` (new communicators, on the wrapper's
next store prefix) proceeds while the old ones are torn down.

On by default (``resilience.quick_abort``; measured on an H100 at 1b: docs/benchmarks/NOTES.md).
Only where a group has an NCCL backend: a gloo collective cannot be aborted, and there the
wrapper's wait is for ``pg_timeout``, not for a teardown (NVRx's abort runs unchanged).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

#: The ``_world`` maps ``destroy_process_group`` clears (torch 2.6-2.13 have them all).
_WORLD_MAPS = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag",
               "tags_to_pg", "pg_coalesce_state")


def nccl_backends() -> list[Any]:
    """Every live process group's NCCL backend (empty without NCCL or without a group)."""
    if not (dist.is_available() and dist.is_initialized() and dist.is_nccl_available()):
        return []
    c10d = dist.distributed_c10d
    out = []
    for group in list(c10d._world.pg_names):
        try:
            backend = group._get_backend(torch.device("cuda"))
        except RuntimeError:  # the group has no CUDA backend
            continue
        if isinstance(backend, c10d.ProcessGroupNCCL):
            out.append(backend)
    return out


def can_forget() -> bool:
    """Whether this torch keeps its process groups where :func:`forget_process_groups` clears."""
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    return (world is not None and all(hasattr(world, name) for name in _WORLD_MAPS)
            and hasattr(c10d, "_update_default_pg")
            and hasattr(c10d, "_unregister_all_process_groups"))


def live_groups() -> list[Any]:
    """The live process groups, newest first (the order torch shuts them down in)."""
    world = dist.distributed_c10d._world
    return sorted(world.pg_names, key=lambda g: world.pg_names[g], reverse=True)


def forget_process_groups() -> None:
    """Clears torch's process-group bookkeeping as ``destroy_process_group()`` does, shutting none.

    The caller holds the groups (:func:`live_groups`) and shuts them down once aborted.
    """
    c10d = dist.distributed_c10d
    world = c10d._world
    c10d._update_default_pg(None)
    for name in _WORLD_MAPS:
        getattr(world, name).clear()
    c10d._unregister_all_process_groups()
    # Names of unnamed groups come from this counter: reset so that a restarted incarnation's
    # groups are named as the first one's were (torch does the same on destroy).
    world.group_count = 0


def abort_in_background(log: Callable[[str], None]) -> bool:
    """Starts the NCCL aborts and the groups' shutdown on a thread; forgets the groups now.

    Args:
        log: Where the teardown's line goes when it is done.

    Returns:
        False where nothing was done (no NCCL group, or a torch whose bookkeeping differs):
        the caller aborts the usual way.
    """
    backends = nccl_backends()
    if not backends or not can_forget():
        return False
    started, rank0 = threading.Event(), dist.get_rank() == 0
    # The aborts start before the groups are forgotten: their flags are what unblocks the
    # main thread if it waits in a collective.
    threading.Thread(target=_abort_then_shut, args=(backends, live_groups(), started, rank0, log),
                     name="nccl-teardown", daemon=True).start()
    started.wait(1.0)
    forget_process_groups()
    return True


def _abort_then_shut(backends: list[Any], groups: list[Any], started: threading.Event,
                     rank0: bool, log: Callable[[str], None]) -> None:
    """Aborts every backend (in parallel, as NVRx does), then shuts the groups down.

    A failed shutdown is logged on every rank, the teardown's time on rank 0 only.
    """
    t0 = time.perf_counter()
    aborts = [threading.Thread(target=b.abort, name="nccl-abort", daemon=True) for b in backends]
    for t in aborts:
        t.start()
    started.set()
    for t in aborts:
        t.join()
    for group in groups:  # nothing is left in flight after the abort: this returns at once
        try:
            group.shutdown()
        except RuntimeError as err:  # an aborted communicator may refuse; it is gone anyway
            log(f"[trainer] process group shutdown after its abort: {err}")
    if rank0:
        log(f"[trainer] in-process restart: the old NCCL communicators were torn down in "
            f"{time.perf_counter() - t0:.3f}s, beside the restart")
