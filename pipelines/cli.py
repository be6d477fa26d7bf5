"""The ``kfp-nvrx`` command line.

Each subcommand lives in its own module under ``kfp_nvrx.pipelines.commands`` and exposes
``register(subparsers)``; the module is imported only when the CLI starts, and heavy imports stay
inside the command's handler so ``kfp-nvrx --help`` is fast and works without torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Sequence

from kfp_nvrx.components.errors import UserError

#: Subcommand modules, in the order ``--help`` lists them.
COMMAND_MODULES = (
    "kfp_nvrx.pipelines.commands.prepare_data",
    "kfp_nvrx.pipelines.commands.launch_local",
    "kfp_nvrx.pipelines.commands.render_job",
    "kfp_nvrx.pipelines.commands.launch",
    "kfp_nvrx.pipelines.commands.export",
    "kfp_nvrx.pipelines.commands.goodput",
    "kfp_nvrx.pipelines.commands.demo",
    "kfp_nvrx.pipelines.commands.drill",
    "kfp_nvrx.pipelines.commands.compile",
    "kfp_nvrx.pipelines.commands.run_local",
    "kfp_nvrx.pipelines.commands.submit",
    "kfp_nvrx.pipelines.commands.schedule",
)


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line (argparse's default prints usage first)."""

    def error(self, message: str) -> None:  # noqa: D401
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    """Builds the top-level parser with every registered subcommand."""
    parser = _Parser(prog="kfp-nvrx", description=__doc__.splitlines()[0])
    from kfp_nvrx.components import __version__

    parser.add_argument("--version", action="version", version=f"kfp-nvrx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kfp-nvrx`` console script."""
    # torch imports pynvml on CPU-only machines and warns about it on every command.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    args = build_parser().parse_args(argv)
    try:
        rc = args.handler(args)
    except UserError as err:
        sys.stderr.write(f"kfp-nvrx {args.command}: error: {err.one_line()}\n")
        return UserError.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"kfp-nvrx {args.command}: interrupted\n")
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
