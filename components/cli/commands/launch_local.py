"""``kfp-nvrx launch-local``: train on N local ft_launcher "nodes" (the embedded default)."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from kfp_nvrx.components.core import argtypes
from kfp_nvrx.components.core.trainer_flags import RUN_DIR_FLAG, add_trainer_flags


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the subcommand."""
    p = sub.add_parser("launch-local", help="run the trainer under N local ft_launcher agents",
                       description="Starts N ft_launcher agents on localhost with the PET_* "
                       "environment a PyTorchJob or TrainJob pod gets, streams their output and waits.")
    p.add_argument("--nodes", default="1", help="N or MIN:MAX local nodes (default 1)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    add_trainer_flags(p, config="tiny", required=(RUN_DIR_FLAG,), run_dir_type=argtypes.path)
    p.add_argument("--deadline", type=argtypes.seconds, default=None,
                   help="wall-clock limit in seconds")
    p.add_argument("--verbose", action="store_true", help="stream every launcher log line")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from kfp_nvrx.components.launch.jobspec.resolve import LOCAL, resolve
    from kfp_nvrx.components.launch.jobspec.spec import JobSpec
    from kfp_nvrx.components.launch.local.run import LocalRun

    spec = JobSpec(nodes=args.nodes, nproc_per_node=args.nproc_per_node, run_dir=args.run_dir,
                   config=args.config, overrides=args.overrides, faults=args.faults)
    res = LocalRun(resolve(spec, LOCAL), deadline_s=args.deadline, verbose=args.verbose).run()
    g = res.summary
    assert g is not None  # a local run's events are always here
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
    else:
        print(f"{res.state}: {g.steps_final} steps in {res.duration_s:.1f}s, "
              f"goodput {res.goodput:.1%}, restarts {res.restarts_text()}, "
              f"recovery {res.recovery_s} s, final loss {g.final_loss}, run dir {res.run_dir}")
        for line in g.what_happened:
            print(f"  {line}")
    if not res.succeeded:
        sys.stderr.write(f"kfp-nvrx launch-local: {res.state}: {res.reason}\n")
        for line in res.last_log_lines:
            sys.stderr.write(f"  {line}\n")
        if res.state == "Cancelled":  # like `launch`: 130 on SIGINT, 143 on SIGTERM
            return 128 + int(res.extra.get("signal", signal.SIGTERM))
        return 1
    return 0
