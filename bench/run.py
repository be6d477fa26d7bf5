"""``make bench``: every benchmark as a subprocess, then the report in ``docs/benchmarks/``.

``python -m bench.run [--out docs/benchmarks] [--only ckpt_stall,throughput,recovery,recovery_sweep]
[--quick]``

Needs a CUDA GPU. With 2 or more visible GPUs it also runs the 2-GPU figures: throughput on 1
and 2 GPUs in one run (``throughput.json``) and the recovery scenarios on 2 GPUs
(``recovery_2gpu.json``). ``recovery_sweep`` samples fault steps over long runs at 1b and 125m
(``recovery_sweep_1b.json``, ``recovery_sweep_125m.json``). ``--gpus 1`` keeps to one GPU.
``--quick`` uses the ``125m`` preset and fewer steps (a smoke run of the benchmarks themselves,
not figures to publish).
``--report-only`` rebuilds the markdown, plots and summary from the JSON files already in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import SAFE_ENV, log

BENCHES = ("ckpt_stall", "throughput", "recovery", "recovery_sweep")


def jobs(only: list[str], quick: bool, gpus: int) -> list[tuple[str, str, list[str]]]:
    """``(module, output JSON name, arguments)`` of each benchmark process to run, in order."""
    out = []
    for name in only:
        if name == "recovery_sweep":  # each preset its own report
            presets = ["125m"] if quick else ["1b", "125m"]
            out += [(name, f"recovery_sweep_{p}", ["--preset", p, *_args(name, quick)])
                    for p in presets]
            continue
        extra = ["--gpus", "2"] if name == "throughput" and gpus >= 2 else []
        out.append((name, name, [*_args(name, quick), *extra]))
        if name == "recovery":  # 125m above, 1b beside it (13 GB of state: a p5 GPU's share)
            out.append((name, "recovery_1b", ["--preset", "1b"]))
        if name == "recovery" and gpus >= 2:
            out.append((name, "recovery_2gpu", [*_args(name, quick), "--gpus", "2"]))
    return out


def _args(name: str, quick: bool) -> list[str]:
    if name == "ckpt_stall":
        return ["--config", "125m" if quick else "1b"]
    if name == "throughput":
        return ["--steps-125m", "20", "--steps-1b", "16", "--skip", "5"] if quick else []
    if name == "recovery":
        return ["--preset", "125m"]
    if name == "recovery_sweep":
        return ["--per-kind", "1"] if quick else []
    return []


def main(argv: list[str] | None = None) -> int:
    """Runs the selected benchmarks, then writes the report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/benchmarks")
    p.add_argument("--only", default=",".join(BENCHES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark process")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs to use (default: 2 when 2+ are visible, else 1)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if not args.report_only:
        import torch

        if not torch.cuda.is_available():
            sys.stderr.write("bench: needs a CUDA GPU (torch.cuda.is_available() is False)\n")
            return 2
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1"}
        only = [n for n in args.only.split(",") if n]
        for name in only:
            if name not in BENCHES:
                sys.stderr.write(f"bench: unknown benchmark {name!r}; known: {', '.join(BENCHES)}\n")
                return 2
        gpus = args.gpus or min(2, torch.cuda.device_count())
        for name, out_name, extra in jobs(only, args.quick, gpus):
            t0 = time.time()
            cmd = [sys.executable, "-m", f"bench.{name}", "--out", str(out / f"{out_name}.json"),
                   *extra]
            try:
                rc = subprocess.run(cmd, env=env, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            log(f"{out_name}: exit {rc} after {time.time() - t0:.0f}s")
    from bench.summary import build_report

    build_report(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
