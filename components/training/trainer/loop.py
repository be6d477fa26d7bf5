"""The steps of one incarnation: the loop, its saves, its faults, its stop and its end."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kfp_nvrx.components.core import events as ev
from kfp_nvrx.components.core.elastic_env import env_int
from kfp_nvrx.components.core.events import EventLog
from kfp_nvrx.components.core.exits import GAVE_UP
from kfp_nvrx.components.core.faults import When
from kfp_nvrx.components.training.checkpoint import Checkpointer
from kfp_nvrx.components.training.ranks import max_over_ranks
from kfp_nvrx.components.training.trainer.build import (
    TrainState,
    apply_state,
    check_compatible,
    full_state,
    warm_start,
)
from kfp_nvrx.components.training.trainer.fault_injector import FaultInjector
from kfp_nvrx.components.training.trainer.heap import freeze_heap
from kfp_nvrx.components.training.trainer.job import give_up
from kfp_nvrx.components.training.trainer.rhythm import STARTUP_STEPS
from kfp_nvrx.components.training.trainer.step_parts import StepParts
from kfp_nvrx.components.training.trainer.stopping import StopRequested

if TYPE_CHECKING:
    from kfp_nvrx.components.training.trainer.job import Job

#: Steps of an incarnation before its steps count as steady for the learned timeouts: the first
#: is the start-up (allocations, autotuning, compilation), the second may still compile.
STEADY_AFTER = STARTUP_STEPS


def log0(msg: str) -> None:
    """Prints on global rank 0 only."""
    if env_int("RANK", 0) == 0:
        print(f"[trainer] {msg}", flush=True)


@dataclass(frozen=True)
class Place:
    """Where an incarnation runs: its rank, the world size and which entry of the function."""

    rank: int
    world: int
    iteration: int = 0  # in-process restart iteration
    call_wrapper: Any = None  # NVRx in-process restart's CallWrapper, when it runs this


@dataclass
class Replica:
    """What one rank trains: its shard of the model, the optimizer, the schedule, the counters."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    train: TrainState


@dataclass
class Trainer:
    """One incarnation's training: the objects it trains and the loop over its steps."""

    job: Job
    place: Place
    replica: Replica
    ckpt: Checkpointer
    events: EventLog
    injector: FaultInjector

    def state(self) -> dict[str, Any]:
        """The whole training state, as checkpoints hold it."""
        r = self.replica
        return full_state(r.model, r.opt, r.sched, r.train, self.job.monitor.state_dict(),
                          self.place.rank)

    def resume(self, first_start: bool) -> int | None:
        """Restores the newest saved state (or warm-starts the weights); returns its step.

        Args:
            first_start: This is the launch's first start (``checkpoint.load_step`` applies).
        """
        resumed, state = self.ckpt.resume(
            self.state, check=lambda keys, step: check_compatible(self.replica.model, keys, step),
            first_start=first_start)
        if state is not None:
            r = self.replica
            apply_state(r.model, r.opt, r.sched, r.train, state, self.place.rank)
            self.job.monitor.load_state_dict(state.get("ft", {}))
        elif self.job.cfg.checkpoint.init_from:
            warm_start(self.replica.model, self.job.cfg.checkpoint.init_from)
        return resumed

    def loop(self) -> None:
        """Trains from the step after the restored one to ``train.steps``."""
        cfg, monitor, ckpt, t = self.job.cfg, self.job.monitor, self.ckpt, self.job.cfg.train
        tokens_per_step = cfg.data.seq_len * cfg.data.batch_size * self.place.world
        first, steps_here, t_first = self.replica.train.step + 1, 0, time.perf_counter()
        last_beat: float | None = None  # the previous step's heartbeat (perf_counter)
        after_save = False  # the previous step saved: this one overlaps its copies
        parts = StepParts(t.step_parts, self.job.device)

        for step in range(first, t.steps + 1):
            t0 = time.time()
            parts.begin()
            writes, pinning = ckpt.write_events, ckpt.preparing()
            t_sec = time.perf_counter()
            # FT: the step's bound is its kind's (the first steps of an incarnation, steps while
            # the staging banks pin, steady steps): resilience.Monitor.step_section.
            with monitor.step_section(steps_here, pinning):
                self._fault(step, When.STEP)
                loss_value, froze_s = self._step(step, tokens_per_step, parts,
                                                 freeze=steps_here == 1
                                                 and self.place.call_wrapper is None)
                if not math.isfinite(loss_value):
                    self._diverged(step, loss_value)
                ckpt.tick()  # the durable write behind the snapshots: moved on, never waited for
                parts.mark("tick")
            # The heap's one-time freeze ran under the start-up bound; it is no part of the
            # rhythm the later steps' bounds are made of.
            step_s = time.perf_counter() - t_sec - froze_s
            monitor.heartbeat()
            now = time.perf_counter()
            # Steady: what a healthy run repeats (see Monitor.observe).
            steady = (steps_here >= STEADY_AFTER and not after_save
                      and ckpt.write_events == writes and not pinning and not ckpt.preparing())
            monitor.observe(step_s, None if last_beat is None else now - last_beat, steady)
            last_beat = now
            if self.place.call_wrapper is not None:
                self.place.call_wrapper.ping()  # FT: in-process progress watchdog
            # Every collective of the step comes before the snapshot: once its device-to-host
            # copies are queued, a collective's small copy of its result waits behind them.
            if self.job.stop.enabled:
                asked, left = self.job.stop.agree(self._reduce_max)
                if asked:
                    self._emit_step(step, t0, loss_value, tokens_per_step)
                    self._stop(step, left)
            steps_here += 1
            if steps_here >= STEADY_AFTER + cfg.resilience.learn_after \
                    and monitor.maybe_learn(self._reduce_max) and self.place.rank == 0:
                log0(f"learned NVRx timeouts: {monitor.timeouts()}")
            after_save = ckpt.should_save(step)
            parts.mark("monitor")
            if after_save:
                with monitor.phase("checkpoint", bound=cfg.resilience.checkpoint_timeout):
                    ckpt.save(step, self.state())
                    self._fault(step, When.CHECKPOINT)
                last_beat = time.perf_counter()  # the phase ends with a heartbeat
                parts.mark("snapshot")
            self._emit_step(step, t0, loss_value, tokens_per_step, parts.take())
            if steps_here == 1 and ckpt.periodic:  # the state's final layout exists (optimizer)
                ckpt.prepare(self.state)
            if step % t.log_every == 0 or step == t.steps:
                elapsed = time.perf_counter() - t_first
                tps = steps_here * tokens_per_step / max(elapsed, 1e-9)
                eta = (t.steps - step) * elapsed / steps_here
                log0(f"step {step}/{t.steps} loss {loss_value:.4f} tok/s {tps:,.0f} "
                     f"eta {eta:.0f}s")

    def _freeze_heap(self) -> float:
        """The incarnation's built heap leaves the garbage collector's full passes (:mod:`.heap`).

        Called in the second step while the GPU runs it (the first step after a restore is
        part of the recovery, and is not lengthened); not under the in-process wrapper.
        """
        frozen, seconds = freeze_heap()
        log0(f"froze the start-up heap ({frozen:,} objects, {seconds:.2f}s, while the GPU ran "
             "step 2): no later step pays a full garbage collection of it")
        return seconds

    def _emit_step(self, step: int, t0: float, loss_value: float, tokens: int,
                   parts: dict[str, float] | None = None) -> None:
        """The step's event: from its start to now (its snapshot, if any, included)."""
        self.events.emit(ev.Step(step=step, start=t0, end=time.time(),
                                 incarnation=self.job.restart_count,
                                 iteration=self.place.iteration,
                                 loss=round(loss_value, 6), tokens=tokens, parts=parts))

    def _stop(self, step: int, seconds: float) -> None:
        """A node is being stopped: every rank saves ``step`` if it fits, then leaves the loop."""
        t0 = time.perf_counter()
        with self.job.monitor.phase("checkpoint", bound=max(1.0, seconds)):
            saved = self.ckpt.save_on_stop(step, self.state, seconds)
        asked = self.job.stop.deadline is not None
        if self.place.rank == 0:
            self.events.emit(ev.End(step=step, status=ev.STOPPED))
        kept = f"step {saved} is committed" if saved is not None else "nothing is committed"
        who = "this node was asked to stop" if asked else "a peer node was asked to stop"
        raise StopRequested(asked, saved, f"[trainer] stopping at step {step} ({who}): {kept} "
                            f"({time.perf_counter() - t0:.1f} s of {seconds:.0f} s); a relaunch "
                            "resumes from it")

    def _diverged(self, step: int, loss_value: float) -> None:
        """A non-finite loss ends the job in one line: a restart would only diverge again."""
        self.job.monitor.stop()  # the wait for the agent's stop is no hang
        # Each rank that sees it writes its own event (as a faulting rank does): whichever gives
        # up first stops the job, and rank 0 may be stopped before it sees its own loss.
        EventLog(self.events.path.parent).emit(ev.End(step=step, status="diverged"))
        give_up(f"{GAVE_UP} the loss is not finite ({loss_value}) at step {step} on rank "
                f"{self.place.rank}: training diverged, or started from non-finite weights; resume "
                "an earlier step (checkpoint.load_step) with e.g. a lower train.lr, or check "
                "checkpoint.init_from", self.job.cfg.resilience.workers_stop_timeout)

    def _reduce_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum of ``values`` over every rank (collective)."""
        return max_over_ranks(values, self.job.device)

    def _step(self, step: int, tokens_per_step: int, parts: StepParts,
              freeze: bool) -> tuple[float, float]:
        """One forward/backward/optimizer step; returns the loss and the seconds of ``freeze``.

        ``freeze``: the heap is frozen while the GPU runs the step (:meth:`_freeze_heap`).
        """
        cfg, device, t = self.job.cfg, self.job.device, self.job.cfg.train
        inputs, targets = self.job.data.batch(t.seed, step, self.place.rank, cfg.data.batch_size,
                                              cfg.data.seq_len)
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        parts.mark("data")
        logits = self.replica.model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        parts.mark("forward_backward")
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.replica.model.parameters(), t.grad_clip)
        self.ckpt.wait_before_update()  # a save's D2H copies overlap forward/backward, not this
        self.replica.opt.step()
        self.replica.sched.step()
        self.replica.opt.zero_grad(set_to_none=True)
        counters = self.replica.train
        counters.step, counters.tokens = step, counters.tokens + tokens_per_step
        parts.gpu_end()
        parts.mark("optimizer")
        froze_s = self._freeze_heap() if freeze else 0.0
        with self.ckpt.gpu_wait():  # the loop's idle stretch: background pinning runs in it
            loss_value = loss.item()
        parts.mark("sync")
        if t.step_sleep:
            time.sleep(t.step_sleep)
        return loss_value, froze_s

    def _fault(self, step: int, when: When) -> None:
        """Fires the injected fault due at this point (``when``) of ``step``, if any."""
        fault = self.injector.due(step, when)
        if fault is None:
            return
        kind = fault.kind.name
        # The faulting rank writes its own event (rank 0's log is not the only writer here).
        EventLog(self.events.path.parent).emit(ev.Fault(kind=kind, step=step, rank=self.place.rank))
        print(f"[trainer] rank {self.place.rank}: injecting fault {kind} at step {step}", flush=True)
        self.injector.fire(fault)
