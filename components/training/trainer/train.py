"""One worker process: its job, and one incarnation per (in-process) restart.

The process's shared state is the :class:`Job`; each entry of the training function (the first,
and every in-process re-entry) is an :func:`incarnation`: process group, monitor, model, newest
state, then :class:`.loop.Trainer`'s steps.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from kfp_nvrx.components.core import events as ev
from kfp_nvrx.components.core.config import Config
from kfp_nvrx.components.core.elastic_env import env_int
from kfp_nvrx.components.core.events import EventLog, read_events
from kfp_nvrx.components.core.rounds import agent_identity
from kfp_nvrx.components.core.sources import source_words
from kfp_nvrx.components.training.checkpoint import (
    Checkpointer,
    Kept,
    Reports,
)
from kfp_nvrx.components.training.trainer.build import TrainState, build
from kfp_nvrx.components.training.trainer.fault_injector import FaultInjector
from kfp_nvrx.components.training.trainer.job import Job
from kfp_nvrx.components.training.trainer.loop import Place, Replica, Trainer, log0
from kfp_nvrx.components.training.trainer.resilience import in_process_wrapper


def restart_kind(iteration: int, previous_agent: str | None, agent: str) -> str:
    """Which layer restarted this incarnation (the ``restart`` event's kind).

    ``in-process``: NVRx's Wrapper re-entered the training function (iteration > 0).
    ``in-job``: the agent that started rank 0 before started it again (ft_launcher restarted its
    worker group; ``TORCHELASTIC_RESTART_COUNT`` cannot tell: NVRx leaves it at 0).
    ``pod``: another agent: the pods were recreated (JobSet restart, a pod the Job controller or
    the operator replaced) or the job was launched again. Seen from rank 0: in a PyTorchJob whose
    worker-1 was recreated, rank 0's agent only restarted its workers, so that reads ``in-job``.
    """
    if iteration:
        return ev.IN_PROCESS
    if not previous_agent or not agent or previous_agent == agent:
        return ev.IN_JOB
    return ev.POD


def make_deterministic() -> None:
    """``train.deterministic``: the same inputs give bitwise the same weights, run after run.

    Deterministic kernels (embedding backward and friends without atomics), the math SDPA
    backend (flash/efficient attention backward accumulate with atomics), no cuDNN autotuning,
    and a fixed cuBLAS workspace (read when the first cuBLAS handle is made, so set before
    the first matmul). NCCL reductions are deterministic for a fixed world size and sizes.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for backend in ("flash", "mem_efficient", "cudnn"):
        getattr(torch.backends.cuda, f"enable_{backend}_sdp")(False)
    torch.backends.cuda.enable_math_sdp(True)


def pg_backend(device: torch.device) -> str:
    """The process group's backend for the training device."""
    return "nccl" if device.type == "cuda" else "gloo"


def pick_device(cfg: Config) -> torch.device:
    """``train.device``: auto picks CUDA when present."""
    if cfg.train.deterministic:
        make_deterministic()
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(env_int("LOCAL_RANK", 0))
        return torch.device("cuda", env_int("LOCAL_RANK", 0))
    return torch.device("cpu")


def run(job: Job) -> None:
    """Runs training to ``train.steps``, directly or under NVRx in-process restart."""
    res = job.cfg.resilience
    if not res.in_process:
        # FT: a stopped pod's workers save first (in-process restart would take the stop for a
        # fault and re-enter: there a stop ends the workers at once, as before).
        job.watch_stops(res.stop_save_timeout)
        incarnation(job)
        return
    port = env_int("MASTER_PORT", 29500)
    # FT: the application's TCPStore (MASTER_PORT + 1) outlives in-process restarts; every
    # iteration builds its process group on a PrefixStore of it.
    base_store = dist.TCPStore(
        host_name=os.environ.get("MASTER_ADDR", "127.0.0.1"), port=port + 1,
        world_size=env_int("WORLD_SIZE", 1), is_master=env_int("RANK", 0) == 0,
        multi_tenant=True, wait_for_workers=True, use_libuv=True,
        timeout=datetime.timedelta(seconds=res.barrier_timeout),
    )
    # FT: once the wrapper decides to restart, the rank monitor stops judging this rank (a healthy
    # rank may still be blocked in a collective with the faulted one): the wrapper's timeouts do.
    wrapped = in_process_wrapper(res, store_port=port + 2, on_abort=job.monitor.disconnect)(
        incarnation)
    wrapped(job, base_store)


def boot_line(parts: dict[str, float]) -> str:
    """The start-up in parts on one line (an in-job restart's share of the recovery)."""
    body = ", ".join(f"{k} {v:.2f}s" for k, v in parts.items() if k != "total")
    return f"boot: {body}; total {parts['total']:.2f}s"  # log0 adds the [trainer] tag


def boot_record(job: Job, iteration: int, marks: list[tuple[str, float]], t_start: float,
                now: float) -> dict[str, float]:
    """Seconds per start-up part of this incarnation, in order, with their ``total``.

    The first incarnation of a process also carries the process's own parts (interpreter,
    imports, checks, CUDA context, NVRx client) and ``wrapper`` (from those to this function:
    the in-process wrapper and its store, when on); its total runs from process creation. An
    in-process restart's parts start at its re-entry. The parts are disjoint intervals, so they
    sum to no more than the total.
    """
    parts: dict[str, float] = {}
    origin = t_start
    if iteration == 0 and job.boot_mark is not None:
        parts.update(job.boot)
        parts["wrapper"] = t_start - job.boot_mark
        origin = job.boot_origin or job.boot_mark
    prev = t_start
    for name, t in marks:
        parts[name] = t - prev
        prev = t
    parts["total"] = now - origin
    return {k: round(v, 4) for k, v in parts.items()}


def incarnation(job: Job, base_store: Any = None, call_wrapper: Any = None) -> None:
    """One entry of the training function: init PG, load newest checkpoint, train, save."""
    Incarnation(job, base_store, call_wrapper).run()


class Incarnation:
    """One entry of the training function and what it owns.

    Its process group, event log, checkpointer and :class:`.loop.Trainer`.

    Args:
        job: What every incarnation of this worker shares.
        base_store: The in-process wrapper's store (None: no in-process restart).
        call_wrapper: NVRx's CallWrapper when the in-process wrapper runs this entry.
    """

    def __init__(self, job: Job, base_store: Any = None, call_wrapper: Any = None) -> None:
        self.job = job
        self.base_store = base_store
        self.call_wrapper = call_wrapper
        self.iteration = call_wrapper.iteration if call_wrapper is not None else 0
        self.rank, self.world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
        self.events = EventLog(job.run_dir, enabled=self.rank == 0)
        self.marks: list[tuple[str, float]] = []
        self.ckpt: Checkpointer | None = None
        self.t_start = time.time()

    def run(self) -> None:
        """Sets up, trains to the last step, ends; on any exception tears down and re-raises."""
        monitor = self.job.monitor
        self._init_pg()
        monitor.connect()
        self.marks.append(("monitor_connect", time.time()))
        try:
            trainer = self._set_up()
            trainer.loop()
            self._finish(trainer)
        except BaseException:
            self._fail()
            raise
        monitor.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


    def _init_pg(self) -> None:
        timeout = datetime.timedelta(seconds=self.job.cfg.resilience.pg_timeout)
        backend = pg_backend(self.job.device)
        if self.base_store is not None:
            store = dist.PrefixStore(str(self.iteration), self.base_store)
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world,
                                    timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
        # NCCL communicators are created lazily: their set-up lands in the first collective
        # (model build or first step), not in pg_init (the rendezvous on the store).
        self.marks.append(("pg_init", time.time()))

    def _set_up(self) -> Trainer:
        """Model, checkpointer and the newest state, inside the ``setup`` phase; the start event."""
        job, cfg, events = self.job, self.job.cfg, self.events
        with job.monitor.phase("setup", bound=cfg.resilience.setup_timeout):
            model, opt, sched = build(cfg, job.device)
            self.marks.append(("model_build", time.time()))

            def on_commit(step: int, blocking: float, total: float, nbytes: int) -> None:
                events.emit(ev.Checkpoint(step=step, blocking_s=round(blocking, 6),
                                          total_s=round(total, 6), bytes=nbytes))

            def on_snapshot(step: int, stall: float, skipped: str) -> None:
                events.emit(ev.Snapshot(step=step, stall_s=round(stall, 6), skipped=skipped))

            def on_replica(step: int, seconds: float, nbytes: int, ok: bool, loop: float) -> None:
                events.emit(ev.Replica(step=step, seconds=round(seconds, 6), bytes=nbytes, ok=ok,
                                       loop_s=round(loop, 6)))

            self.ckpt = ckpt = Checkpointer(
                job.run_dir, cfg.checkpoint, job.device, Kept(job.staging, job.writer),
                Reports(on_commit, on_snapshot, log0, lambda: job.stop.deadline is not None,
                        on_replica),
                final_step=cfg.train.steps)
            job.keep(ckpt.staging, ckpt.writer)
            trainer = Trainer(job, Place(self.rank, self.world, self.iteration, self.call_wrapper),
                              Replica(model, opt, sched, TrainState()), ckpt, events,
                              FaultInjector(job.faults, job.run_dir, self.rank))
            ckpt.warm_up()
            self.marks.append(("checkpointer", time.time()))
            previous = self._count_restarts()
            t_load = time.perf_counter()
            # checkpoint.load_step pins the launch's first start only (rank 0's word counts).
            resumed = trainer.resume(first_start=self.iteration == 0 and job.restart_count == 0)
            load_s = time.perf_counter() - t_load
            self.marks.append(("load", time.time()))
        self._record_start(ckpt, resumed, load_s, previous)
        return trainer

    def _count_restarts(self) -> str | None:
        """Rank 0, first entry: the job-wide restarts so far; returns the previous start's agent.

        Agents count restarts per node; the job-wide count is what rank 0 has logged.
        """
        if self.iteration or self.rank:
            return None
        job = self.job
        starts = [e for e in read_events(job.run_dir) if isinstance(e, ev.Start)
                  and e.run_id == job.run_id and e.iteration == 0]
        job.counted_restarts(len(starts))
        return starts[-1].agent if starts else None

    def _record_start(self, ckpt: Checkpointer, resumed: int | None, load_s: float,
                      previous: str | None) -> None:
        job, iteration = self.job, self.iteration
        agent = agent_identity()
        layer = restart_kind(iteration, previous, agent)
        restarted = bool(job.restart_count or iteration)
        if restarted:
            self.events.emit(ev.Restart(kind=layer, incarnation=job.restart_count,
                                        iteration=iteration))
        boot = boot_record(job, iteration, self.marks, self.t_start, time.time())
        self.events.emit(ev.Start(
            time=self.t_start, incarnation=job.restart_count, iteration=iteration,
            world_size=self.world, resumed_from=resumed, load_s=round(load_s, 4),
            from_memory=ckpt.restored_from_memory, sources=ckpt.sources,
            peer_bytes=ckpt.peer_bytes if "peer" in (ckpt.sources or ()) else None,
            pid=os.getpid(), run_id=job.run_id, boot=boot, agent=agent,
            layer=layer if restarted else None))
        log0(boot_line(boot))
        source = source_words(ckpt.sources, ckpt.peer_bytes)
        log0(f"start: world_size={self.world} incarnation={job.restart_count}.{iteration} "
             f"resumed_from={resumed}{source} load={load_s:.2f}s device={job.device}")

    def _finish(self, trainer: Trainer) -> None:
        job, ckpt = self.job, trainer.ckpt
        # The final wait for the writer is no step: heartbeats continue while it lasts.
        with job.monitor.phase(None, bound=job.cfg.resilience.checkpoint_timeout):
            ckpt.close()
            ckpt.discard_host_copy()  # the run is over (unpinning 26 GB takes seconds)
        # Training is over: the teardown (process group, the in-process wrapper's completion
        # barrier) is no step, and the learned rhythm must not judge it.
        job.monitor.disconnect()
        if self.rank == 0:
            self.events.emit(ev.End(step=trainer.replica.train.step, status="completed"))
        log0(f"done: step {trainer.replica.train.step}/{job.cfg.train.steps}")

    def _fail(self) -> None:
        """The error path, before the exception goes on (to the in-process wrapper or out)."""
        # The rank monitor first: what follows (a started commit's file work, stopping the
        # writer process) is no step, and under a learned step timeout it once took long enough
        # to get the rank SIGKILLed, turning an in-process restart into an in-job one.
        if self.base_store is not None:
            # FT: in-process restart: the wrapper's soft/hard timeouts bound the teardown.
            self.job.monitor.disconnect()
        else:
            self.job.monitor.stop()
        if self.ckpt is not None:
            self.ckpt.abort()
        # FT: under in-process restart the wrapper's abort (a monitor thread) tears the process
        # group down; destroying it here as well races with that abort on another thread.
        if self.base_store is None and dist.is_initialized():
            dist.destroy_process_group()
