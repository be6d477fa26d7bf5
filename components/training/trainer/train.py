"""The training loop of one worker process (one incarnation per (in-process) restart)."""

from __future__ import annotations

import datetime
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kfp_nvrx.components.core import events as ev
from kfp_nvrx.components.core.config import Config
from kfp_nvrx.components.core.events import EventLog, read_events
from kfp_nvrx.components.core.faults import Fault, When
from kfp_nvrx.components.core.pod_entry import GAVE_UP
from kfp_nvrx.components.training.checkpoint import Checkpointer, HostStaging, NvrxWriter
from kfp_nvrx.components.training.trainer.bootstrap import give_up
from kfp_nvrx.components.training.trainer.build import (
    TrainState,
    apply_state,
    build,
    check_compatible,
    env_int,
    full_state,
    warm_start,
)
from kfp_nvrx.components.training.trainer.data import TokenDataset
from kfp_nvrx.components.training.trainer.fault_injector import FaultInjector
from kfp_nvrx.components.training.trainer.resilience import Monitor, in_process_wrapper

#: Steps of an incarnation before its steps count as steady for the learned timeouts: the first
#: is the start-up (allocations, autotuning, compilation), the second may still compile.
STEADY_AFTER = 2



def agent_identity() -> str:
    """The agent (ft_launcher, torchrun) that started this worker, named for good.

    The machine's boot id, the agent's pid and its start time: a pid alone repeats across
    containers (ft_launcher is pid 12 in every pod here).
    """
    ppid = os.getppid()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        started = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""
    return f"{boot}/{ppid}/{started}"


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


@dataclass
class Job:
    """What every incarnation of this worker shares."""

    cfg: Config
    run_dir: Path
    faults: list[Fault]
    data: TokenDataset
    device: torch.device
    monitor: Monitor
    run_id: str = field(default_factory=lambda: os.environ.get("TORCHELASTIC_RUN_ID", ""))
    restart_count: int = 0  # in-job incarnation of this job (rank 0 derives it from events)
    # What checkpointing keeps across in-process restarts: the staging buffer (restore source)
    # and NVRx's writer (its processes, killed on abort, are reaped by a later incarnation).
    staging: HostStaging | None = None
    writer: NvrxWriter | None = None
    # The process's start-up before the first incarnation (seconds per part, in order), when it
    # began (process creation) and when those parts ended: the first ``start`` event adds its own.
    boot: dict[str, float] = field(default_factory=dict)
    boot_origin: float | None = None
    boot_mark: float | None = None


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


def log0(msg: str) -> None:
    """Prints on global rank 0 only."""
    if env_int("RANK", 0) == 0:
        print(f"[trainer] {msg}", flush=True)


def run(job: Job) -> None:
    """Runs training to ``train.steps``, directly or under NVRx in-process restart."""
    res = job.cfg.resilience
    if not res.in_process:
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
    wrapped = in_process_wrapper(res, store_port=port + 2)(incarnation)
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
    cfg, monitor = job.cfg, job.monitor
    iteration = call_wrapper.iteration if call_wrapper is not None else 0
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    backend = pg_backend(job.device)
    timeout = datetime.timedelta(seconds=cfg.resilience.pg_timeout)
    t_start = time.time()
    if base_store is not None:
        store = dist.PrefixStore(str(iteration), base_store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    # NCCL communicators are created lazily: their set-up lands in the first collective
    # (model build or first step), not in pg_init (the rendezvous on the store).
    marks = [("pg_init", time.time())]
    events = EventLog(job.run_dir, enabled=rank == 0)
    injector = FaultInjector(job.faults, job.run_dir, rank)
    monitor.connect()
    marks.append(("monitor_connect", time.time()))
    res = cfg.resilience
    ckpt = None
    try:
        with monitor.phase("setup", bound=res.setup_timeout):
            model, opt, sched = build(cfg, job.device)
            marks.append(("model_build", time.time()))

            def on_commit(step: int, blocking: float, total: float, nbytes: int) -> None:
                events.emit(ev.Checkpoint(step=step, blocking_s=round(blocking, 6),
                                          total_s=round(total, 6), bytes=nbytes))

            ckpt = Checkpointer(job.run_dir, cfg.checkpoint, job.device, on_commit=on_commit,
                                staging=job.staging, writer=job.writer, log=log0,
                                final_step=cfg.train.steps)
            job.staging, job.writer = ckpt.staging, ckpt.writer
            trainer = Trainer(job, model, opt, sched, TrainState(), ckpt, events, injector, rank,
                              world, iteration, call_wrapper)
            ckpt.warm_up()
            marks.append(("checkpointer", time.time()))
            agent, previous = agent_identity(), None
            if iteration == 0 and rank == 0:
                # Agents count restarts per node; the job-wide count is what rank 0 has logged.
                starts = [e for e in read_events(job.run_dir) if isinstance(e, ev.Start)
                          and e.run_id == job.run_id and e.iteration == 0]
                job.restart_count = len(starts)
                previous = starts[-1].agent if starts else None
            t_load = time.perf_counter()
            # checkpoint.load_step pins the launch's first start only (rank 0's word counts).
            resumed = trainer.resume(first_start=iteration == 0 and job.restart_count == 0)
            load_s = time.perf_counter() - t_load
            marks.append(("load", time.time()))
        layer = restart_kind(iteration, previous, agent)
        if job.restart_count or iteration:
            events.emit(ev.Restart(kind=layer, incarnation=job.restart_count, iteration=iteration))
        boot = boot_record(job, iteration, marks, t_start, time.time())
        events.emit(ev.Start(time=t_start, incarnation=job.restart_count, iteration=iteration,
                             world_size=world, resumed_from=resumed, load_s=round(load_s, 4),
                             from_memory=ckpt.restored_from_memory, pid=os.getpid(),
                             run_id=job.run_id, boot=boot, agent=agent,
                             layer=layer if job.restart_count or iteration else None))
        log0(boot_line(boot))
        source = " (from host memory)" if ckpt.restored_from_memory else ""
        log0(f"start: world_size={world} incarnation={job.restart_count}.{iteration} "
             f"resumed_from={resumed}{source} load={load_s:.2f}s device={job.device}")
        trainer.loop()
        # The final wait for the writer is no step: heartbeats continue while it lasts.
        with monitor.phase(None, bound=res.checkpoint_timeout):
            ckpt.close()
            ckpt.discard_host_copy()  # the run is over (unpinning 26 GB takes seconds)
        # Training is over: the teardown (process group, the in-process wrapper's completion
        # barrier) is no step, and the learned rhythm must not judge it.
        monitor.disconnect()
        if rank == 0:
            events.emit(ev.End(step=trainer.train.step, status="completed"))
        log0(f"done: step {trainer.train.step}/{cfg.train.steps}")
    except BaseException:
        # The rank monitor first: what follows (a started commit's file work, stopping the
        # writer process) is no step, and under a learned step timeout it once took long enough
        # to get the rank SIGKILLed, turning an in-process restart into an in-job one.
        if base_store is not None:
            # FT: in-process restart: the wrapper's soft/hard timeouts bound the teardown.
            monitor.disconnect()
        else:
            monitor.stop()
        if ckpt is not None:
            ckpt.abort()
        if base_store is not None:
            # FT: the wrapper's abort (a monitor thread) tears the process group down;
            # destroying it here as well races with that abort on another thread.
            raise
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    monitor.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class Trainer:
    """One incarnation's training: the objects it trains and the loop over its steps."""

    job: Job
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    train: TrainState
    ckpt: Checkpointer
    events: EventLog
    injector: FaultInjector
    rank: int
    world: int
    iteration: int = 0  # in-process restart iteration
    call_wrapper: Any = None  # NVRx in-process restart's CallWrapper, when it runs this

    def state(self) -> dict[str, Any]:
        """The whole training state, as checkpoints hold it."""
        return full_state(self.model, self.opt, self.sched, self.train,
                          self.job.monitor.state_dict(), self.rank)

    def resume(self, first_start: bool) -> int | None:
        """Restores the newest saved state (or warm-starts the weights); returns its step.

        Args:
            first_start: This is the launch's first start (``checkpoint.load_step`` applies).
        """
        resumed, state = self.ckpt.resume(
            self.state, check=lambda keys, step: check_compatible(self.model, keys, step),
            first_start=first_start)
        if state is not None:
            apply_state(self.model, self.opt, self.sched, self.train, state, self.rank)
            self.job.monitor.load_state_dict(state.get("ft", {}))
        elif self.job.cfg.checkpoint.init_from:
            warm_start(self.model, self.job.cfg.checkpoint.init_from)
        return resumed

    def loop(self) -> None:
        """Trains from the step after the restored one to ``train.steps``."""
        cfg, monitor, ckpt, t = self.job.cfg, self.job.monitor, self.ckpt, self.job.cfg.train
        tokens_per_step = cfg.data.seq_len * cfg.data.batch_size * self.world
        first, steps_here, t_first = self.train.step + 1, 0, time.perf_counter()
        last_beat: float | None = None  # the previous step's heartbeat (perf_counter)
        after_save = False  # the previous step saved: this one overlaps its copies

        for step in range(first, t.steps + 1):
            t0 = time.time()
            # The first step of an incarnation (allocations, autotuning, compilation) is part of
            # the start-up, not of the step rhythm the timeouts are learned from.
            timed = (monitor.phase("setup", bound=cfg.resilience.setup_timeout) if steps_here == 0
                     else monitor.section("step"))
            commits, pinning = ckpt.commits, ckpt.preparing()
            t_sec = time.perf_counter()
            with timed:
                self._fault(step, When.STEP)
                loss_value = self._step(step, tokens_per_step)
                if not math.isfinite(loss_value):
                    self._diverged(step, loss_value)
                ckpt.finalize(blocking=False)
            step_s = time.perf_counter() - t_sec
            monitor.heartbeat()
            now = time.perf_counter()
            # Steady: what a healthy run repeats (see Monitor.observe).
            steady = (steps_here >= STEADY_AFTER and not after_save and ckpt.commits == commits
                      and not pinning and not ckpt.preparing())
            monitor.observe(step_s, None if last_beat is None else now - last_beat, steady)
            last_beat = now
            if self.call_wrapper is not None:
                self.call_wrapper.ping()  # FT: in-process progress watchdog
            after_save = ckpt.should_save(step)
            if after_save:
                with monitor.phase("checkpoint", bound=cfg.resilience.checkpoint_timeout):
                    ckpt.save(step, self.state())
                    self._fault(step, When.CHECKPOINT)
                last_beat = time.perf_counter()  # the phase ends with a heartbeat
            self.events.emit(ev.Step(step=step, start=t0, end=time.time(),
                                     incarnation=self.job.restart_count, iteration=self.iteration,
                                     loss=round(loss_value, 6), tokens=tokens_per_step))
            steps_here += 1
            if steps_here == 1 and ckpt.periodic:  # the state's final layout exists (optimizer)
                ckpt.prepare(self.state)
            if steps_here >= STEADY_AFTER + cfg.resilience.learn_after \
                    and monitor.maybe_learn(self._reduce_max) and self.rank == 0:
                log0(f"learned NVRx timeouts: {monitor.timeouts()}")
            if step % t.log_every == 0 or step == t.steps:
                elapsed = time.perf_counter() - t_first
                tps = steps_here * tokens_per_step / max(elapsed, 1e-9)
                eta = (t.steps - step) * elapsed / steps_here
                log0(f"step {step}/{t.steps} loss {loss_value:.4f} tok/s {tps:,.0f} "
                     f"eta {eta:.0f}s")

    def _diverged(self, step: int, loss_value: float) -> None:
        """A non-finite loss ends the job in one line: a restart would only diverge again."""
        self.job.monitor.stop()  # the wait for the agent's stop is no hang
        if self.rank == 0:
            self.events.emit(ev.End(step=step, status="diverged"))
        give_up(f"{GAVE_UP} the loss is not finite ({loss_value}) at step {step} on rank "
                f"{self.rank}: training diverged, or started from non-finite weights; resume "
                "an earlier step (checkpoint.load_step) with e.g. a lower train.lr, or check "
                "checkpoint.init_from", self.job.cfg.resilience.workers_stop_timeout)

    def _reduce_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum of ``values`` over every rank (collective)."""
        device = self.job.device if self.job.device.type == "cuda" else "cpu"
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def _step(self, step: int, tokens_per_step: int) -> float:
        """One forward/backward/optimizer step; returns the loss."""
        cfg, device, t = self.job.cfg, self.job.device, self.job.cfg.train
        inputs, targets = self.job.data.batch(t.seed, step, self.rank, cfg.data.batch_size,
                                              cfg.data.seq_len)
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        logits = self.model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.ckpt.wait_before_update()  # a save's D2H copies overlap forward/backward, not this
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.train.step, self.train.tokens = step, self.train.tokens + tokens_per_step
        loss_value = loss.item()
        if t.step_sleep:
            time.sleep(t.step_sleep)
        return loss_value

    def _fault(self, step: int, when: When) -> None:
        """Fires the injected fault due at this point (``when``) of ``step``, if any."""
        fault = self.injector.due(step, when)
        if fault is None:
            return
        kind = fault.kind.name
        # The faulting rank writes its own event (rank 0's log is not the only writer here).
        EventLog(self.events.path.parent).emit(ev.Fault(kind=kind, step=step, rank=self.rank))
        print(f"[trainer] rank {self.rank}: injecting fault {kind} at step {step}", flush=True)
        self.injector.fire(fault)
