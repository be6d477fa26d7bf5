"""Checkpoint stall on one GPU, all figures from one process and one training state.

The model, optimizer and state dict come from the shipped trainer (``state.build``,
``state.full_state``) and the async path is the shipped :class:`Checkpointer`. Measured, in order:
the pinned D2H copy of the same state (the floor), the shipped async DCP save inside a training
loop (blocking seconds per save and the step time while a write is in flight), torch
``dcp.async_save`` with its default stager, torch's ``DefaultStager(StagingOptions(...))`` with the
process checkpointer, sync ``dcp.save`` and sync ``torch.save``.

``python -m bench.ckpt_stall --config 1b --out ckpt_stall.json``
"""

from __future__ import annotations

import argparse
import gc
import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import init_single_gpu, log, machine_info, median, write_json


def _trainer(config: str, device):
    """The shipped model/optimizer/schedule and a step that mirrors the trainer's loop."""
    import torch
    import torch.nn.functional as F

    from kfp_nvrx.components.train_fsdp.trainer.config import load_config
    from kfp_nvrx.components.train_fsdp.trainer.state import TrainState, build

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


def _tensors(obj: Any) -> list:
    """Local tensors of a (nested) state dict; DTensors contribute their local shard."""
    import torch
    from torch.distributed.tensor import DTensor

    out = []
    if isinstance(obj, DTensor):
        out.append(obj.to_local())
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            out.extend(_tensors(v))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(_tensors(v))
    return out


def _plain(obj: Any) -> Any:
    """The state with DTensors replaced by their local tensors (what torch.save can pickle)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


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


def shipped_async(cfg, step, state_fn, root: Path, device, saves: int, gap: int,
                  max_steps: int) -> tuple[Any, dict[str, Any]]:
    """The shipped Checkpointer inside a training loop: a save whenever the last one committed.

    Returns per-save blocking seconds and total (stage+write+commit) seconds, and step times
    split into steps with and without a write in flight.
    """
    import torch

    from kfp_nvrx.components.train_fsdp.trainer.checkpoint import Checkpointer

    commits: list[dict[str, float]] = []

    def on_commit(st: int, blocking: float, total: float, nbytes: int) -> None:
        commits.append({"step": st, "blocking_s": blocking, "total_s": total, "bytes": nbytes})

    cfg.checkpoint.keep = 1
    ckpt = Checkpointer(root, cfg.checkpoint, device, on_commit=on_commit)
    t0 = time.perf_counter()
    ckpt.warm_up()
    warm_up_s = time.perf_counter() - t0
    blocking, quiet, busy = [], [], []
    since, done = 0, 0
    for s in range(1, max_steps + 1):
        inflight = ckpt.inflight is not None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        ckpt.finalize(blocking=False)
        dt = time.perf_counter() - t0
        if s > 2:  # the first steps after building still warm caches
            (busy if inflight else quiet).append(dt)
        since = 0 if ckpt.inflight is not None else since + 1
        if done < saves and ckpt.inflight is None and since >= gap:
            blocking.append(ckpt.save(s, state_fn(s)))
            done += 1
            since = 0
        if done == saves and ckpt.inflight is None and s > gap:
            break
    ckpt.close()
    base = median(quiet)
    return ckpt, {
        "warm_up_s": warm_up_s, "blocking_s": blocking, "commits": commits,
        "first_s": blocking[0] if blocking else None,
        "steady_s": median(blocking[1:]) if len(blocking) > 1 else (blocking or [None])[0],
        "step_quiet_median_s": base, "step_inflight_median_s": median(busy),
        "step_inflight_max_s": max(busy) if busy else 0.0, "steps_quiet": len(quiet),
        "steps_inflight": len(busy),
        "slowdown_median": median(busy) / base - 1 if busy and base else 0.0,
        "slowdown_max": max(busy) / base - 1 if busy and base else 0.0,
    }


def _evict(files: list[Path]) -> None:
    """Drops the files' pages from the page cache, so the next read comes from the disk."""
    import os

    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _profiled(fn, top: int = 18) -> tuple[float, str]:
    """Runs ``fn`` under cProfile; returns its seconds and the top functions by cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(fn)
    dt = time.perf_counter() - t0
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    return dt, buf.getvalue()


def cold_load(ckpt, step: int, state: dict, profile: bool = False) -> dict[str, Any]:
    """Disk read bandwidth of the checkpoint's own files vs ``Checkpointer.load`` of them, cold.

    Both read the same bytes after evicting them from the page cache.
    """
    import subprocess

    import torch

    from kfp_nvrx.components.train_fsdp.trainer.checkpoint import step_dir

    path = step_dir(ckpt.root, step)
    files = [f for f in sorted(path.iterdir()) if f.is_file()]
    nbytes = sum(f.stat().st_size for f in files)
    _evict(files)
    buf = bytearray(64 << 20)
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    raw = time.perf_counter() - t0
    out: dict[str, Any] = {"bytes": nbytes, "raw_read_s": raw, "raw_gb_per_s": nbytes / raw / 1e9}
    for label in ("cold", "warm"):
        if label == "cold":
            _evict(files)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if profile and label == "warm":
            _, out["warm_profile"] = _profiled(lambda: ckpt.load(step, state))
        else:
            ckpt.load(step, state)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out[f"{label}_load_s"] = dt
        out[f"{label}_load_gb_per_s"] = nbytes / dt / 1e9
        if not profile:
            break
    out["load_over_disk_read"] = out["cold_load_gb_per_s"] / out["raw_gb_per_s"]
    df = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout
    out["filesystem"] = " ".join(df.splitlines()[-1].split()[:2]) if df else ""
    return out


def torch_async(state: dict, root: Path, reps: int, stager_opts: bool, fwd_bwd, opt_step) -> dict:
    """torch ``dcp.async_save``: default stager (thread), or DefaultStager + process checkpointer.

    Per save: seconds until the call returns, seconds until staging is complete (the state may
    only change after that) and seconds until the upload finished. With the stager, the second
    save runs the next forward/backward before waiting for staging, as a loop would.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    out: dict[str, Any] = {"runs": [], "errors": []}
    stager = None
    kwargs: dict[str, Any] = {}
    if stager_opts:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(True, True, True, True))
        kwargs = {"async_checkpointer_type": AsyncCheckpointerType.PROCESS}
    for i in range(reps):
        path = root / f"torch_async_{i}"
        shutil.rmtree(path, ignore_errors=True)
        overlap = stager_opts and i > 0
        for attempt in ("reused", "fresh"):
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = dcp.async_save(state, checkpoint_id=str(path),
                                     **({"async_stager": stager} if stager else {}), **kwargs)
                ret = time.perf_counter() - t0
                staged_fut = getattr(res, "staging_completion", None)
                upload = getattr(res, "upload_completion", res)
                fb = 0.0
                if overlap:
                    t1 = time.perf_counter()
                    fwd_bwd()
                    torch.cuda.synchronize()
                    fb = time.perf_counter() - t1
                t2 = time.perf_counter()
                if staged_fut is not None:
                    staged_fut.result()
                wait = time.perf_counter() - t2
                staged = time.perf_counter() - t0
                if overlap:
                    opt_step()
                upload.result()
                out["runs"].append({"return_s": ret, "staged_s": staged, "wait_after_fwd_bwd_s":
                                    wait if overlap else None, "fwd_bwd_s": fb if overlap else None,
                                    "upload_done_s": time.perf_counter() - t0, "stager": attempt})
                break
            except Exception as err:  # recorded: torch 2.11's reused stager failed here before
                out["errors"].append(f"save {i} ({attempt} stager): {type(err).__name__}: "
                                     f"{str(err)[:300]}")
                if not stager_opts or attempt == "fresh":
                    break
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                stager = DefaultStager(StagingOptions(True, True, True, True))
        shutil.rmtree(path, ignore_errors=True)
    if stager is not None:
        stager.close()
    rets = [r["return_s"] for r in out["runs"]]
    out["first_s"] = rets[0] if rets else None
    out["steady_s"] = median(rets[1:]) if len(rets) > 1 else out["first_s"]
    return out


def torch_sync(state: dict, root: Path, kind: str) -> dict[str, float]:
    """Sync ``dcp.save`` or ``torch.save`` (GPU tensors, as a naive loop would call it)."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = root / f"sync_{kind}"
    shutil.rmtree(path, ignore_errors=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if kind == "dcp":
        dcp.save(state, checkpoint_id=str(path))
    else:
        path.mkdir(parents=True)
        torch.save(_plain(state), path / "model.pt")
    dt = time.perf_counter() - t0
    shutil.rmtree(path, ignore_errors=True)
    return {"blocking_s": dt}


def main(argv: list[str] | None = None) -> int:
    """Runs every measurement and writes one JSON file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="1b")
    p.add_argument("--out", required=True)
    p.add_argument("--dir", default="/tmp/kfp-nvrx-bench-ckpt", help="checkpoint directory")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--skip", default="",
                   help="comma list of: load,torch_save,dcp_save,dcp_async,stager")
    p.add_argument("--profile-load", action="store_true", help="cProfile a warm load too")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    import torch
    import torch.distributed as dist

    from kfp_nvrx.components.train_fsdp.trainer.state import full_state

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
    ckpt, res["shipped"] = shipped_async(cfg, step, state_fn, root / "shipped", device,
                                         args.saves, gap=3, max_steps=200)
    sh = res["shipped"]
    log(f"shipped blocking {sh['blocking_s']} commits {sh['commits']} step quiet "
        f"{sh['step_quiet_median_s']:.4f}s in flight {sh['step_inflight_median_s']:.4f}s "
        f"(max {sh['step_inflight_max_s']:.4f}s, {sh['steps_inflight']} steps)")
    write_json(args.out, res)
    if ckpt.last_commit_step > 0 and "load" not in skip:
        try:
            res["load"] = cold_load(ckpt, ckpt.last_commit_step, state_fn(0), args.profile_load)
        except Exception as err:
            res["load"] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
        log(f"load: { {k: v for k, v in res['load'].items() if k != 'warm_profile'} }")
        if "warm_profile" in res["load"]:
            log(res["load"]["warm_profile"])
        write_json(args.out, res)
    shutil.rmtree(root / "shipped", ignore_errors=True)
    gc.collect()
    state = state_fn(0)
    for name, fn in (("torch_save", lambda: torch_sync(state, root, "torch")),
                     ("dcp_save", lambda: torch_sync(state, root, "dcp")),
                     ("dcp_async", lambda: torch_async(state, root, 2, False, fwd_bwd, opt_step)),
                     ("stager", lambda: torch_async(state, root, 2, True, fwd_bwd, opt_step))):
        if name in skip:
            continue
        try:
            res[name] = fn()
        except Exception as err:  # one failing peer must not lose the others' figures
            res[name] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
        log(f"{name}: {res[name]}")
        write_json(args.out, res)
        gc.collect()
    write_json(args.out, res)
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":  # required: NVRx's and torch's checkpoint workers are spawned
    raise SystemExit(main())
