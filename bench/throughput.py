"""Throughput (tokens/s, MFU) and NVRx overhead of the shipped training loop.

Every figure comes from the step events of real trainer runs on the bundled sample corpus:

- throughput: ``direct`` runs (no launcher, monitor off, no checkpoints) of ``125m`` and ``1b``,
  torch.compile off and on; MFU = FLOPs/token (``model.flops_per_token``) x tokens/s over the
  dense bf16 peak, and over the bf16 matmul rate measured here;
- overhead: the ``1b`` baseline against the same loop under ``ft_launcher`` with the rank monitor
  (sections + heartbeats), plus the in-process wrapper, plus async saves every N steps;
- scaling (``--gpus 2``): the throughput runs again on 2 GPUs (``launch-local --nodes 2``, one GPU
  per local node, monitor off as in the direct runs), in the same run as the 1-GPU ones, so
  tokens/s/GPU at 2 over at 1 is a ratio within one run. MFU is per GPU.

``python -m bench.throughput --out throughput.json [--gpus 2]``
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import PEAK_BF16_FLOPS, log, machine_info, make_dataset, write_json
from bench.runs import Training, run_trainer, step_summary

PLAIN = ["resilience.monitor=off", "checkpoint.interval=0", "checkpoint.save_final=false"]


def matmul_tflops(n: int = 8192, reps: int = 20) -> float:
    """bf16 matmul rate on random data (the achievable ceiling on this GPU)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def _variants(steps: dict[str, int], interval: int, skip: int,
              gpus: int = 1) -> list[dict[str, Any]]:
    out = []
    for g in range(1, gpus + 1):
        for preset in ("125m", "1b"):
            for comp in (False, True):
                out.append({"name": f"{preset} compile={'on' if comp else 'off'}"
                                    + (f" {g}gpu" if g > 1 else ""),
                            "preset": preset, "mode": "direct" if g == 1 else "ft",
                            "kind": "throughput", "skip": skip, "gpus": g, "compile": comp,
                            "set": [*PLAIN, f"train.compile={str(comp).lower()}",
                                    f"train.steps={steps[preset]}"]})
    ft = ["checkpoint.interval=0", "checkpoint.save_final=false", f"train.steps={steps['1b']}"]
    # The save variant times the steps after the first save (which also pays for the worker's
    # first CUDA IPC mapping and pinned buffers, once per incarnation): one steady-state save
    # lies in the window.
    out += [
        {"name": "1b ft_launcher + sections/heartbeats", "preset": "1b", "mode": "ft", "skip": skip,
         "kind": "overhead", "set": ["resilience.monitor=sections", *ft]},
        {"name": "1b ft_launcher + sections + in-process wrapper", "preset": "1b", "mode": "ft",
         "kind": "overhead", "skip": skip,
         "set": ["resilience.monitor=sections", "resilience.in_process=true", *ft]},
        {"name": f"1b ft_launcher + sections + async save every {interval}", "preset": "1b",
         "mode": "ft", "kind": "overhead", "skip": interval + 5,
         "set": ["resilience.monitor=sections", f"checkpoint.interval={interval}",
                 "checkpoint.save_final=false", "checkpoint.keep=1",
                 f"train.steps={2 * interval + 10}"]},
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    """Runs the variants and writes one JSON file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps-125m", type=int, default=40)
    p.add_argument("--steps-1b", type=int, default=50)
    p.add_argument("--interval", type=int, default=50, help="save interval of the overhead run")
    p.add_argument("--skip", type=int, default=8, help="warm-up steps left out")
    p.add_argument("--only", default="", help="comma list of variant-name prefixes")
    p.add_argument("--gpus", type=int, choices=(1, 2), default=1,
                   help="also run the throughput variants on 2 GPUs (2 local nodes x 1 GPU)")
    args = p.parse_args(argv)

    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.training.model import flops_per_token

    res: dict[str, Any] = {"bench": "throughput", "machine": machine_info(), "gpus": args.gpus,
                           "peak_bf16_flops": PEAK_BF16_FLOPS, "runs": []}
    if args.only and Path(args.out).is_file():  # a partial re-run replaces only its own rows
        res["runs"] = json.loads(Path(args.out).read_text()).get("runs", [])
    res["matmul_tflops"] = matmul_tflops()
    log(f"bf16 matmul {res['matmul_tflops']:.0f} TFLOP/s")
    work = Path(tempfile.mkdtemp(prefix="kfp-nvrx-bench-"))
    data = {}
    wanted = [w for w in args.only.split(",") if w]
    for v in _variants({"125m": args.steps_125m, "1b": args.steps_1b}, args.interval, args.skip,
                       args.gpus):
        if wanted and not any(v["name"].startswith(w) for w in wanted):
            continue
        cfg = load_config(v["preset"])
        seq, bsz = cfg.data.seq_len, cfg.data.batch_size
        if seq not in data:
            data[seq] = make_dataset(work, seq)
        t0 = time.time()
        gpus = v.get("gpus", 1)
        training = Training(v["preset"], [f"data.path={data[seq]}", *v["set"]], nodes=gpus)
        run = run_trainer(v["mode"], training, work / "run", timeout=420)
        fpt = flops_per_token(cfg.model, seq)
        row = {**{k: v[k] for k in ("name", "preset", "mode", "kind")}, "gpus": gpus,
               "compile": v.get("compile"), "state": run["state"], "wall_s": time.time() - t0,
               "tokens_per_step": seq * bsz * gpus, "flops_per_token": fpt,
               **step_summary(run["events"], v["skip"], seq * bsz * gpus)}
        row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / gpus
        row["mfu"] = fpt * row["tokens_per_s_per_gpu"] / PEAK_BF16_FLOPS
        row["mfu_vs_matmul"] = fpt * row["tokens_per_s_per_gpu"] / (res["matmul_tflops"] * 1e12)
        row["checkpoints"] = [e for e in run["events"] if e["type"] == "checkpoint"]
        res["runs"] = [r for r in res["runs"] if r["name"] != row["name"]] + [row]
        log(f"{row['name']}: {row['state']} step {row['step_median_s']:.4f}s "
            f"{row['tokens_per_s']:,.0f} tok/s MFU {row['mfu']:.1%}")
        write_json(args.out, res)  # partial results survive a later crash or timeout
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
