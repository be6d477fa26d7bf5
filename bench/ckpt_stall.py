"""Checkpoint stall on one GPU, all figures from one process and one training state.

The model, optimizer and state dict come from the shipped trainer (``state.build``,
``state.full_state``) and the async path is the shipped :class:`Checkpointer`. Measured, in order:
the pinned D2H copy of the same state (the floor), the shipped async DCP save inside a training
loop for each ``checkpoint.staging`` mode (blocking: the plain path; overlap: D2H on a side stream
during the next forward/backward; nvrx: NVRx's own staging) with seconds blocked per save, the
visible cost and the step time while a write is in flight, the checkpoint load, torch
``dcp.async_save`` with its default stager, torch's ``DefaultStager(StagingOptions(...))`` with the
process checkpointer, sync ``dcp.save`` and sync ``torch.save``.

``python -m bench.ckpt_stall --config 1b --out ckpt_stall.json``
"""

from __future__ import annotations

import argparse
import gc
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.ckpt_load import cold_load
from bench.ckpt_peers import _tensors, torch_async, torch_sync
from bench.common import init_single_gpu, log, machine_info, median, write_json

RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def _trainer(config: str, device):
    """The shipped model/optimizer/schedule and a step that mirrors the trainer's loop."""
    import torch
    import torch.nn.functional as F

    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.training.trainer.build import TrainState, build

    cfg = load_config(config)
    model, opt, sched = build(cfg, device)
    gen = torch.Generator(device=device).manual_seed(0)
    window = torch.randint(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.data.seq_len + 1),
                           device=device, generator=gen)
    inputs, targets = window[:, :-1], window[:, 1:]

    def fwd_bwd() -> torch.Tensor:
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        return loss

    def opt_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    def step() -> float:
        loss = fwd_bwd()
        opt_step()
        return loss.item()

    return cfg, model, opt, sched, TrainState(), step, fwd_bwd, opt_step


def d2h_floor(state: dict, reps: int) -> dict[str, float]:
    """Pinned, pre-allocated host buffers; all tensors copied non-blocking, then one sync."""
    import torch

    src = [t for t in _tensors(state) if t.is_cuda]
    t0 = time.perf_counter()
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in src]
    alloc_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b, t in zip(bufs, src, strict=True):
            b.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    nbytes = sum(t.numel() * t.element_size() for t in src)
    del bufs
    gc.collect()
    return {"floor_s": min(times), "median_s": median(times), "runs_s": times,
            "pinned_alloc_s": alloc_s, "gb_per_s": nbytes / min(times) / 1e9}


@dataclass(frozen=True)
class Loop:
    """The training step's parts the shipped path runs between saves, and the state it saves."""

    fwd_bwd: Callable[[], Any]
    opt_step: Callable[[], None]
    state_fn: Callable[[int], dict]


@dataclass(frozen=True)
class SavePlan:
    """When :func:`shipped_async` saves.

    Attributes:
        saves: Saves to measure.
        gap: Steps at least between a commit and the next save.
        max_steps: Steps at most.
        quiet_steps: The first steps save nothing (a clean baseline, see :func:`shipped_async`).
        profile_save: cProfile one more save after the measured ones.
    """

    saves: int
    gap: int
    max_steps: int
    quiet_steps: int = 20
    profile_save: bool = False


@dataclass
class _Samples:
    """What the loop of :func:`shipped_async` measured."""

    commits: list[dict[str, float]] = field(default_factory=list)
    blocking: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)
    quiet: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    trace: list[tuple] = field(default_factory=list)
    split: list[dict[str, Any]] = field(default_factory=list)
    state_dict_s: list[float] = field(default_factory=list)

    def on_commit(self, st: int, blocking: float, total: float, nbytes: int) -> None:
        self.commits.append({"step": st, "blocking_s": blocking, "total_s": total, "bytes": nbytes})

    def result(self, ckpt: Any, warm_up_s: float, save_profile: str | None) -> dict[str, Any]:
        """The figures of one mode (see :func:`shipped_async`)."""
        blocking, after, quiet, busy, commits = (self.blocking, self.after, self.quiet, self.busy,
                                                 self.commits)
        base = median(quiet)
        visible = [b + max(0.0, a - base) for b, a in zip(blocking, after, strict=False)]
        return {
            "mode": ckpt.mode, "warm_up_s": warm_up_s, "blocking_s": blocking, "commits": commits,
            "next_step_s": after, "visible_s": visible,
            "first_s": blocking[0] if blocking else None,
            "steady_s": median(blocking[1:]) if len(blocking) > 1 else (blocking or [None])[0],
            "steady_visible_s": median(visible[1:]) if len(visible) > 1 else (visible or [None])[0],
            "step_quiet_median_s": base, "step_inflight_median_s": median(busy),
            "step_inflight_max_s": max(busy) if busy else 0.0, "steps_quiet": len(quiet),
            "steps_inflight": len(busy),
            "slowdown_median": median(busy) / base - 1 if busy and base else 0.0,
            "slowdown_max": max(busy) / base - 1 if busy and base else 0.0,
            "next_step_slowdown_max": max(after[1:] or after or [base]) / base - 1 if base else 0.0,
            "commit_s": ckpt.commit_s, "save_steps": [c["step"] for c in commits],
            "trace": self.trace,  # (step, seconds, write in flight, commits so far)
            "split": self.split, "save_profile": save_profile, "state_dict_s": self.state_dict_s,
        }


def shipped_async(cfg, loop: Loop, root: Path, device, mode: str,
                  plan: SavePlan) -> tuple[Any, dict[str, Any]]:
    """The shipped Checkpointer inside a training loop: a save whenever the last one committed.

    ``mode`` is ``checkpoint.staging``. The first ``plan.quiet_steps`` steps save nothing: with
    13 GB writes a write is in flight nearly all the time, and the few quiet steps between a
    commit and the next save (all right after a commit) alone made a biased baseline. Returns per
    save the seconds ``save()`` blocked, the time of the step right after it (where overlapped D2H
    copies run) and the visible cost (blocking + that step's excess over a quiet step), and step
    times with and without a write in flight.
    """
    import torch

    from kfp_nvrx.components.training.checkpoint import Checkpointer, Reports

    got = _Samples()
    cfg.checkpoint.keep = 1
    cfg.checkpoint.staging = mode
    ckpt = Checkpointer(root, cfg.checkpoint, device, reports=Reports(got.on_commit, log=log))
    t0 = time.perf_counter()
    ckpt.warm_up()
    warm_up_s = time.perf_counter() - t0
    ckpt.prepare(lambda: loop.state_fn(0))  # as the trainer does after its first step
    since, done, saved_at = 0, 0, -1
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    for s in range(1, plan.max_steps + 1):
        inflight, dt = _timed_step(ckpt, loop, ev, s, got)
        if s == saved_at + 1:
            got.after.append(dt)
        elif s > 2:  # the first steps after building still warm caches
            (got.busy if inflight else got.quiet).append(dt)
        since = 0 if ckpt.inflight is not None else since + 1
        if done < plan.saves and ckpt.inflight is None and since >= plan.gap \
                and s > plan.quiet_steps:
            t_sd = time.perf_counter()
            st = loop.state_fn(s)  # the trainer's loop builds the state dict too: timed apart
            got.state_dict_s.append(time.perf_counter() - t_sd)
            got.blocking.append(ckpt.save(s, st))
            done, since, saved_at = done + 1, 0, s
        if done == plan.saves and ckpt.inflight is None and s > saved_at + 1:
            break
    save_profile = None
    if plan.profile_save:  # one more save, outside the measured loop: where save()'s CPU time goes
        from bench.ckpt_load import _profiled

        extra = plan.max_steps + 1
        blocked, save_profile = _profiled(lambda: ckpt.save(extra, loop.state_fn(extra)))
        save_profile = f"save() {blocked:.4f}s\n{save_profile}"
        ckpt.finalize(blocking=True)
    ckpt.close()
    return ckpt, got.result(ckpt, warm_up_s, save_profile)


def _timed_step(ckpt: Any, loop: Loop, ev: list, s: int, got: _Samples) -> tuple[bool, float]:
    """One training step of :func:`shipped_async`, timed and split; (write in flight, seconds)."""
    import torch

    inflight, pinning = ckpt.inflight is not None, ckpt.preparing()
    torch.cuda.synchronize()
    ru0, cpu0 = resource.getrusage(RUSAGE_THREAD), time.thread_time()
    t0 = time.perf_counter()
    ev[0].record()
    loss = loop.fwd_bwd()
    ev[1].record()
    ckpt.wait_before_update()  # as the trainer's loop: the optimizer waits for staging
    loop.opt_step()
    ev[2].record()
    t_launch = time.perf_counter() - t0
    loss.item()
    t1 = time.perf_counter()
    ckpt.finalize(blocking=False)
    dt = time.perf_counter() - t0
    got.trace.append((s, round(dt, 5), inflight, ckpt.commits))
    ru1 = resource.getrusage(RUSAGE_THREAD)
    # Where a slow step's time went: GPU time of forward/backward and of the optimizer
    # (CUDA events), the loop thread's CPU time and its involuntary context switches (a
    # descheduled launcher thread), the CPU time to queue the step, and finalize().
    got.split.append({"step": s, "wall_s": round(dt, 5), "inflight": inflight, "pinning": pinning,
                      "gpu_fwd_bwd_s": round(ev[0].elapsed_time(ev[1]) / 1e3, 5),
                      "gpu_opt_s": round(ev[1].elapsed_time(ev[2]) / 1e3, 5),
                      "launch_s": round(t_launch, 5), "finalize_s": round(dt - (t1 - t0), 5),
                      "thread_cpu_s": round(time.thread_time() - cpu0, 5),
                      "nivcsw": ru1.ru_nivcsw - ru0.ru_nivcsw,
                      "nvcsw": ru1.ru_nvcsw - ru0.ru_nvcsw})
    return inflight, dt


@dataclass
class _Bench:
    """One run of this bench: its flags, the trainer's loop, the checkpoint root and the results."""

    args: argparse.Namespace
    cfg: Any
    loop: Loop
    root: Path
    device: Any
    res: dict[str, Any]

    @property
    def skip(self) -> set[str]:
        return set(filter(None, self.args.skip.split(",")))

    def shipped(self, mode: str) -> None:
        """The shipped path in ``mode``, then (once) the load of its newest checkpoint."""
        args, res = self.args, self.res
        plan = SavePlan(args.saves, gap=3, max_steps=230,
                        profile_save=args.profile_save and mode == "overlap")
        ckpt, row = shipped_async(self.cfg, self.loop, self.root / "shipped", self.device, mode,
                                  plan)
        res["modes"][mode] = row
        log(f"shipped[{mode}] blocking {[round(b, 4) for b in row['blocking_s']]} visible "
            f"{[round(v, 4) for v in row['visible_s']]} next step {[round(a, 4) for a in row['next_step_s']]}"
            f" quiet {row['step_quiet_median_s']:.4f}s in flight {row['step_inflight_median_s']:.4f}s "
            f"(max {row['step_inflight_max_s']:.4f}s, {row['steps_inflight']} steps) commits "
            f"{[round(c['total_s'], 2) for c in row['commits']]}")
        res["shipped"] = res["modes"].get("blocking", row)  # the plain (non-overlapped) path
        write_json(args.out, res)
        if row["save_profile"]:
            log(row["save_profile"])
        if ckpt.last_commit_step > 0 and "load" not in self.skip and "load" not in res:
            self.load(ckpt)
        shutil.rmtree(self.root / "shipped", ignore_errors=True)
        if ckpt.staging is not None:
            ckpt.staging.release()
        gc.collect()

    def load(self, ckpt: Any) -> None:
        """The cold (and warm) load of ``ckpt``'s newest checkpoint."""
        args, res = self.args, self.res
        try:
            res["load"] = cold_load(ckpt, ckpt.last_commit_step, self.loop.state_fn(0),
                                    args.profile_load)
        except Exception as err:
            res["load"] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
        log(f"load: { {k: v for k, v in res['load'].items() if k != 'warm_profile'} }")
        if "warm_profile" in res["load"]:
            log(res["load"]["warm_profile"])
        write_json(args.out, res)

    def peers(self) -> None:
        """torch's own ways to save the same state, each after the other."""
        res, root, loop = self.res, self.root, self.loop
        fwd_bwd, opt_step = loop.fwd_bwd, loop.opt_step
        state = loop.state_fn(0)
        for name, fn in (("torch_save", lambda: torch_sync(state, root, "torch")),
                         ("dcp_save", lambda: torch_sync(state, root, "dcp")),
                         ("dcp_async", lambda: torch_async(state, root, 2, False, fwd_bwd, opt_step)),
                         ("stager", lambda: torch_async(state, root, 2, True, fwd_bwd, opt_step))):
            if name in self.skip:
                continue
            try:
                res[name] = fn()
            except Exception as err:  # one failing peer must not lose the others' figures
                res[name] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
            log(f"{name}: {res[name]}")
            write_json(self.args.out, res)
            gc.collect()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="1b")
    p.add_argument("--out", required=True)
    p.add_argument("--dir", default="/tmp/kfp-nvrx-bench-ckpt", help="checkpoint directory")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--modes", default="blocking,overlap,nvrx",
                   help="checkpoint.staging modes of the shipped path, in order")
    p.add_argument("--skip", default="",
                   help="comma list of: load,torch_save,dcp_save,dcp_async,stager")
    p.add_argument("--profile-load", action="store_true", help="cProfile a warm load too")
    p.add_argument("--profile-save", action="store_true",
                   help="cProfile one more overlapped save after the measured ones")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs every measurement and writes one JSON file."""
    args = _parser().parse_args(argv)

    import torch
    import torch.distributed as dist

    from kfp_nvrx.components.training.trainer.build import full_state

    device = init_single_gpu()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cfg, model, opt, sched, train, step, fwd_bwd, opt_step = _trainer(args.config, device)
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / 3

    def state_fn(s: int) -> dict:
        train.step = s
        return full_state(model, opt, sched, train, {}, 0)

    state = state_fn(0)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    res: dict[str, Any] = {"bench": "ckpt_stall", "config": args.config, "machine": machine_info(),
                           "state_bytes": nbytes, "warm_step_s": step_s}
    log(f"ckpt_stall {args.config}: state {nbytes / 1e9:.2f} GB, step {step_s:.3f}s")
    res["d2h"] = d2h_floor(state, reps=5)
    log(f"d2h floor {res['d2h']['floor_s']:.3f}s ({res['d2h']['gb_per_s']:.1f} GB/s)")
    write_json(args.out, res)  # partial results survive a timeout
    res["modes"] = {}
    bench = _Bench(args, cfg, Loop(fwd_bwd, opt_step, state_fn), root, device, res)
    for mode in filter(None, args.modes.split(",")):
        bench.shipped(mode)
    shutil.rmtree(root / "shipped", ignore_errors=True)
    gc.collect()
    bench.peers()
    write_json(args.out, res)
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)
    return 0
if __name__ == "__main__":  # required: NVRx's and torch's checkpoint workers are spawned
    raise SystemExit(main())
