"""Where the time of one training step goes, and what the step costs with other FSDP/optimizer knobs.

One process, one GPU, the shipped model (``build_model``) sharded as the trainer does
(``parallelize``), a fixed random batch. Each variant changes one knob against the shipped loop:
the optimizer (``foreach`` AdamW as shipped, or ``fused``), FSDP's ``reshard_after_forward`` for
all blocks (on one GPU there is nothing to save by resharding: the backward's all-gather is a copy)
and ``torch.compile`` of each block. For the first variant a torch profiler trace of three steps is
summarised by kernel family (GEMM, attention, Triton/elementwise, optimizer, copies, NCCL) with the
GPU's idle share of the step.

``python -m bench.step_profile --config 1b --out step_profile.json``
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

from bench.common import PEAK_BF16_FLOPS, init_single_gpu, log, machine_info, median, write_json

#: name -> (compile, optimizer, reshard_after_forward of the blocks: "shipped" or False)
VARIANTS = {
    "shipped compile": (True, "foreach", "shipped"),
    "fused adamw compile": (True, "fused", "shipped"),
    "no reshard compile": (True, "foreach", False),
    "fused + no reshard compile": (True, "fused", False),
    "shipped eager": (False, "foreach", "shipped"),
    "fused + no reshard eager": (False, "fused", False),
}

_FAMILIES = (("nccl", ("nccl",)), ("attention", ("flash", "fmha", "attention", "sdpa")),
             ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "sm100", "cublas")),
             ("optimizer", ("multi_tensor", "adam", "fused_adam")),
             ("copy", ("memcpy", "memset", "copy", "cat", "split_with_sizes", "chunk_cat")),
             ("triton", ("triton",)))


def _family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in _FAMILIES if any(k in low for k in keys)), "other")


def _build(cfg, device, compile: bool, optim: str, reshard: Any):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from kfp_nvrx.components.training.model import build_model
    from kfp_nvrx.components.training.trainer.build import _init
    from kfp_nvrx.components.training.trainer.parallelize import compile_blocks

    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(cfg.model)
    if compile:
        compile_blocks(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        keep = i < len(blocks) - 1 if reshard == "shipped" else bool(reshard)
        fully_shard(block, mp_policy=mp, reshard_after_forward=keep)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)
    with torch.no_grad():
        _init(model)
    t = cfg.train
    kw = {"fused": True} if optim == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                            weight_decay=t.weight_decay, **kw)
    return model, opt


def _stepper(model, opt, inputs, targets, grad_clip: float):
    """The trainer's step: forward, fp32 loss, backward, clip, AdamW, zero grads; returns the loss."""
    import torch
    import torch.nn.functional as F

    def step() -> float:
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _profile(step, steps: int) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    fam: dict[str, float] = {}
    top = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", 0.0) or 0.0
        if dev <= 0:
            continue
        fam[_family(e.key)] = fam.get(_family(e.key), 0.0) + dev / 1e6 / steps
        top.append((dev / 1e6 / steps, e.count // steps, e.key[:120]))
    busy = sum(fam.values())
    top.sort(reverse=True)
    return {"wall_per_step_s": wall, "gpu_busy_per_step_s": busy, "gpu_idle_share": 1 - busy / wall,
            "families_s": dict(sorted(fam.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"s": round(s, 5), "calls": c, "name": n} for s, c, n in top[:25]]}


def main(argv: list[str] | None = None) -> int:
    """Times every variant (median of ``--steps`` after ``--warmup``); profiles the first one."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="1b")
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)

    import torch

    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.training.model import flops_per_token

    device = init_single_gpu()
    cfg = load_config(args.config)
    seq, bsz = cfg.data.seq_len, cfg.data.batch_size
    fpt = flops_per_token(cfg.model, seq)
    res: dict[str, Any] = {"bench": "step_profile", "config": args.config, "seq_len": seq,
                           "batch_size": bsz, "machine": machine_info(), "variants": {}}
    gen = torch.Generator(device=device).manual_seed(0)
    window = torch.randint(0, cfg.model.vocab_size, (bsz, seq + 1), device=device, generator=gen)
    inputs, targets = window[:, :-1], window[:, 1:]
    for i, name in enumerate(filter(None, args.variants.split(","))):
        comp, optim, reshard = VARIANTS[name]
        t0 = time.perf_counter()
        step = _stepper(*_build(cfg, device, comp, optim, reshard), inputs, targets,
                        cfg.train.grad_clip)
        for _ in range(args.warmup):
            step()
        warm_s = time.perf_counter() - t0
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t1)
        st = median(times)
        row = {"compile": comp, "optimizer": optim, "reshard_after_forward": str(reshard),
               "step_median_s": st, "steps_s": times, "build_and_warmup_s": warm_s,
               "tokens_per_s": seq * bsz / st, "mfu": fpt * seq * bsz / st / PEAK_BF16_FLOPS,
               "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
        if i == 0:
            row["profile"] = _profile(step, 3)
        res["variants"][name] = row
        log(f"{name}: step {st:.4f}s MFU {row['mfu']:.1%} mem {row['max_memory_gib']:.1f} GiB")
        if "profile" in row:
            log(f"profile: {row['profile']['families_s']} idle {row['profile']['gpu_idle_share']:.1%}")
        write_json(args.out, res)
        del step
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
