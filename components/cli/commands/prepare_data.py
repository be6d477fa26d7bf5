"""``kfp-nvrx prepare-data``: tokenize text into train/val token shards."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``prepare-data`` subcommand."""
    p = subparsers.add_parser(
        "prepare-data",
        help="tokenize .txt/.jsonl text into train/val token shards",
        description="Tokenize a file, glob or directory of .txt / .jsonl / .json (JSON lines) into "
        "train/val token shards plus index.json. Reuses the directory when its fingerprint "
        "matches. --source sample: uses the bundled sample corpus (no input needed).",
    )
    p.add_argument("--source", required=True,
                   help="file, glob or directory of .txt/.jsonl/.json; or 'sample:' / 'sample:N'")
    p.add_argument("--out", required=True, help="dataset directory to create")
    p.add_argument("--tokenizer", default="byte", help="'byte' (default) or a tokenizer.json path")
    p.add_argument("--eos-token", default=None,
                   help="end-of-document token of a tokenizer.json (default: a known one)")
    p.add_argument("--seq-len", type=int, default=64,
                   help="sequence length the data is for (default 64)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="share of documents held out for validation (default 0.05)")
    p.add_argument("--text-field", default="text",
                   help="JSON field holding the text (default text)")
    p.add_argument("--seed", type=int, default=0, help="chooses the val documents (default 0)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out when it holds another prepare-data dataset (a folder "
                   "holding anything else is never replaced)")
    p.add_argument("--quiet", action="store_true", help="print only the summary line")
    p.set_defaults(handler=run)


#: Library parameter names -> this command's flags: its errors name the flag the user typed (a Surface).
FLAGS = {"source": "--source", "out_dir": "--out", "tokenizer": "--tokenizer",
         "eos_token": "--eos-token", "seq_len": "--seq-len", "val_fraction": "--val-fraction",
         "text_field": "--text-field", "seed": "--seed", "overwrite": "--overwrite"}


def run(args: argparse.Namespace) -> int:
    """Prepare the dataset and print a one-line summary."""
    from kfp_nvrx.components.data.prepare import Recipe, prepare_dataset, summary
    from kfp_nvrx.components.errors import Surface, UserError

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"prepare-data: {msg}", file=sys.stderr, flush=True)

    try:
        recipe = Recipe(tokenizer=args.tokenizer, eos_token=args.eos_token,
                        text_field=args.text_field, val_fraction=args.val_fraction, seed=args.seed)
        result = prepare_dataset(args.source, args.out, recipe, seq_len=args.seq_len,
                                 overwrite=args.overwrite, log=log)
    except UserError as err:
        raise Surface(FLAGS, assign="{name} {value}").reword(err) from None
    print(summary(result), flush=True)
    return 0
