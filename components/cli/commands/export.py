"""``kfp-nvrx export``: a committed checkpoint -> model.safetensors + config.json + export.json."""

from __future__ import annotations

import argparse
import sys

from kfp_nvrx.components.core import argtypes

#: Library parameter names -> this command's flags (errors name the flag the user typed).
FLAGS = {"run_dir": "--run-dir", "out_dir": "--out", "step": "--step", "data": "--data",
         "eval_batches": "--eval-batches"}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``export`` subcommand."""
    p = subparsers.add_parser(
        "export",
        help="consolidate a committed checkpoint into model.safetensors",
        description="Export the newest committed (or the named) DCP checkpoint of a run as one "
        "model.safetensors with config.json and export.json, whatever world size wrote it, and "
        "measure the eval loss on the dataset's val split.",
    )
    p.add_argument("--run-dir", required=True, type=argtypes.path, help="training run directory")
    p.add_argument("--out", required=True, type=argtypes.path, help="export directory to create")
    p.add_argument("--step", type=int, default=None,
                   help="export this step (default: the newest committed checkpoint)")
    p.add_argument("--data", default=None,
                   help="dataset for the eval loss (default: data.path of the run's config)")
    p.add_argument("--eval-batches", type=int, default=8,
                   help="val batches for the eval loss; 0 skips it (default 8)")
    p.add_argument("--quiet", action="store_true", help="print only the summary line")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Export and print a one-line summary."""
    from kfp_nvrx.components.errors import Surface, UserError
    from kfp_nvrx.components.training.export.consolidate import export_checkpoint, summary

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"export: {msg}", file=sys.stderr, flush=True)

    try:
        info = export_checkpoint(args.run_dir, args.out, step=args.step, data=args.data,
                                 eval_batches=args.eval_batches, log=log)
    except UserError as err:
        raise Surface(FLAGS).reword(err) from None
    print(summary(info), flush=True)
    return 0
