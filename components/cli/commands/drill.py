"""``kfp-nvrx drill``: run the local backend through a matrix of faults and report each outcome."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the subcommand."""
    p = sub.add_parser(
        "drill", help="fault drills on the local backend: survived? steps lost? bitwise equal?",
        description="Runs a fault-free reference and then each fault scenario (kill a rank, lose "
        "a node, hang, raise in-process, kill during a checkpoint write, corrupt/truncated "
        "checkpoint, disk full, two quick faults, launcher SIGTERM, more faults than "
        "max_restarts) on a tiny job (--config) with 2 local nodes; prints one row per scenario and writes "
        "drill.json and drill.md. Exit code 0 when every scenario met its expectation.")
    p.add_argument("--quick", action="store_true",
                   help="only the CI subset (corrupt-newest, launcher-sigterm, max-restarts)")
    p.add_argument("--scenario", action="append", default=None, metavar="NAME",
                   help="run only this scenario (repeatable)")
    p.add_argument("--out", default="runs/drill",
                   help="output directory: data, runs, logs, drill.json, drill.md "
                   "(default runs/drill)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the ranks run: cuda = one GPU per local node over NCCL with "
                   "deterministic steps; auto = cuda when this host shows a GPU (default)")
    p.add_argument("--gpus", type=int, default=None, choices=(1, 2),
                   help="GPUs (ranks) on CUDA (default: 2 when the host has 2 or more, else 1)")
    p.add_argument("--config", default="tiny", metavar="PRESET",
                   help="the job's preset: tiny (default), or 125m / 1b on CUDA, where the "
                   "bitwise resume of every fault is checked on a real model size")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.set_defaults(handler=_run)


#: The drill library's fields -> this command's flags (its errors name the flag the user typed).
FLAGS = {"scenario": "--scenario", "out": "--out", "config": "--config", "device": "--device"}


def _run(args: argparse.Namespace) -> int:
    from kfp_nvrx.components.errors import Surface, UserError

    try:
        return _drill(args)
    except UserError as err:
        raise Surface(FLAGS, assign="{name} {value}").reword(err) from None


def _drill(args: argparse.Namespace) -> int:
    from kfp_nvrx.components.drills.scenarios import SCENARIOS, select

    if args.list:
        for sc in SCENARIOS:
            print(f"{sc.name:<18} {'[quick] ' if sc.quick else ''}{sc.what} -> {sc.expect}")
        return 0
    select(args.scenario, args.quick)  # a typo fails before anything starts
    from kfp_nvrx.components.drills.scenarios import Placement, check_config
    from kfp_nvrx.components.errors import UserError
    from kfp_nvrx.components.launch.local.gpus import uses_cuda, visible_gpus

    gpus = visible_gpus()
    if not uses_cuda(args.device, gpus):
        place = Placement()
    elif not gpus:
        raise UserError("--device", "is cuda but this host shows no NVIDIA GPU; use --device cpu")
    else:
        world = args.gpus or min(2, len(gpus))
        if world > len(gpus):
            raise UserError("--gpus", f"asks for {world} GPUs, this host has {len(gpus)}")
        place = Placement("cuda", world)
    check_config(args.config, place)  # as select() above: before torch is imported (run_drill)
    from kfp_nvrx.components.drills.results import JSON_FILE, MD_FILE, table
    from kfp_nvrx.components.drills.runner import DrillError, run_drill

    try:
        rows, _meta = run_drill(args.out, quick=args.quick, names=args.scenario,
                                log=lambda m: print(m, flush=True), place=place,
                                config=args.config)
    except DrillError as err:
        sys.stderr.write(f"kfp-nvrx drill: {err}\n")
        return 1
    print()
    print(table(rows))
    print(f"\nwritten: {args.out}/{JSON_FILE}, {args.out}/{MD_FILE}")
    failed = [r.scenario for r in rows if r.passed is False]
    if failed:
        sys.stderr.write(f"kfp-nvrx drill: {len(failed)} scenario(s) failed: {', '.join(failed)}\n")
        return 1
    return 0
