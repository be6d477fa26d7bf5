"""NVRx's opt-in in-process restart: the wrapper, configured from ``resilience``.

The wrapped function must create its process group itself, on a
``PrefixStore(str(call_wrapper.iteration), base_store)``, and reload the newest state every time it
is entered (:func:`.train.incarnation` does).
"""

from __future__ import annotations

import datetime
import gc
import logging
from collections.abc import Callable
from typing import Any

from kfp_nvrx.components.core.config import ResilienceConfig
from kfp_nvrx.components.training.trainer.restart_clock import RestartClock, clock_hooks

log = logging.getLogger(__name__)

#: Seconds between the in-process wrapper's polls (monitor thread, monitor process, watchdog).
WRAPPER_POLL_S = 0.25


def in_process_wrapper(cfg: ResilienceConfig, store_port: int,
                       on_abort: Callable[[], None] | None = None) -> Callable[[Callable], Callable]:
    """The NVRx in-process restart decorator configured from ``resilience``.

    The wrapped function must create its process group itself, on a
    ``PrefixStore(str(call_wrapper.iteration), base_store)``, and reload the newest checkpoint
    every time it is entered.

    Restart latency: NVRx waits ``last_call_wait`` (its default: 1 s, a large share of the
    wrapper's restart time; the figures are in docs/benchmarks/NOTES.md) after the first fault
    report before it aborts and restarts, only so that
    concurrent faults of other ranks appear in the logged attribution; ``resilience.last_call_wait``
    (0.1 s) keeps that for faults within 0.1 s. The monitor-thread, monitor-process and progress
    watchdog intervals are ``WRAPPER_POLL_S`` (NVRx: 1 s); the heartbeat interval keeps its default.
    The abort (NCCL communicators, process group) is timed and its share printed with the restart;
    ``on_abort`` runs first (the rank monitor's disconnect: from then on the wrapper's timeouts
    bound the restart, not the learned step rhythm).
    """
    # FT: in-process restart; the wrapper's own TCPStore listens on MASTER_PORT + 2.
    from nvidia_resiliency_ext import inprocess

    clock = RestartClock()
    wrapper = _nvrx_wrapper(inprocess, cfg, store_port, clock, on_abort)
    _fit_health_check(wrapper)

    def decorate(fn: Callable) -> Callable:
        return _restartable(fn, wrapper, clock, inprocess.CallWrapper)

    return decorate


def _nvrx_wrapper(inprocess: Any, cfg: ResilienceConfig, store_port: int,
                  clock: RestartClock, on_abort: Callable[[], None] | None) -> Any:
    """NVRx's ``inprocess.Wrapper`` with the timeouts, polls and hooks described above."""
    initialize, finalize, abort = clock_hooks(inprocess, clock, on_abort, cfg.quick_abort)
    poll = datetime.timedelta(seconds=WRAPPER_POLL_S)
    return inprocess.Wrapper(
        store_kwargs={"port": store_port},
        soft_timeout=datetime.timedelta(seconds=cfg.soft_timeout),
        hard_timeout=datetime.timedelta(seconds=cfg.hard_timeout),
        barrier_timeout=datetime.timedelta(seconds=cfg.barrier_timeout),
        completion_timeout=datetime.timedelta(seconds=cfg.barrier_timeout),
        heartbeat_timeout=datetime.timedelta(seconds=max(cfg.soft_timeout / 2, 5)),
        last_call_wait=datetime.timedelta(seconds=cfg.last_call_wait),
        # The fault report travels rank -> monitor process -> store -> monitor thread, and the
        # progress watchdog must pause before the restart: polled every second by default.
        monitor_thread_interval=poll, monitor_process_interval=poll,
        progress_watchdog_interval=poll,
        abort=abort,
        initialize=inprocess.Compose(
            inprocess.initialize.RetryController(max_iterations=cfg.in_process_max_iterations),
            initialize),
        finalize=finalize,
        health_check=_health_check(),
    )


def _fit_health_check(wrapper: Any) -> None:
    """NVRx >= 0.6's restart health checks: off without CUDA, NVML held with it."""
    import torch

    if getattr(wrapper, "restart_health_check", None) is not None:
        if not torch.cuda.is_available():
            # NVRx >= 0.6 chains NVML GPU/NVLink/NIC checks whenever LOCAL_RANK is set; on a host
            # without NVML every restart would fail its health check and end the process.
            wrapper.restart_health_check = None
        else:
            _hold_nvml()


def _restartable(fn: Callable, wrapper: Any, clock: RestartClock,
                 call_wrapper_type: type) -> Callable:
    """``fn`` under ``wrapper``, its entries and exits timed by ``clock``, the heap frozen first."""

    def entry(*args: Any, call_wrapper: Any = None) -> Any:
        clock.entered(call_wrapper.iteration if call_wrapper is not None else 0)
        try:
            return fn(*args, call_wrapper=call_wrapper)
        except BaseException:
            clock.exited()
            raise

    # NVRx finds the argument to inject by its annotation, which must be the real class
    # (this module's annotations are strings under `from __future__ import annotations`).
    entry.__annotations__ = {"call_wrapper": call_wrapper_type}
    wrapped = wrapper(entry)

    def start(*args: Any) -> Any:
        # Before every re-entry NVRx runs `gc.collect()` until nothing is left to free, which
        # walks the whole heap (torch, DTensor, sympy, dynamo; at least two passes, each
        # a noticeable part of an in-process restart). Freezing what exists now (modules,
        # the Job) leaves those passes only the objects created since, among them every
        # incarnation's model and optimizer, which are still collected.
        gc.collect()
        gc.freeze()
        return wrapped(*args)

    return start


def _hold_nvml() -> None:
    """Keeps NVML initialised for the life of the process (CUDA hosts, NVRx >= 0.6).

    NVRx's restart health checks (GPU recovery action, NVLink state) each start and shut down
    NVML, so every restart initialised NVML twice. NVML counts initialisations and shuts down only
    when the count returns to zero: with one reference held here both become count updates.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - best effort: without it the checks only run slower
        log.debug("NVML not initialised ahead of the restart health checks", exc_info=True)


def _health_check() -> Any:
    import torch
    from nvidia_resiliency_ext import inprocess

    if torch.cuda.is_available():
        return inprocess.health_check.CudaHealthCheck()
    return None
