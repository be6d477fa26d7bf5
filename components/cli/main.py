"""The ``kfp-nvrx`` command line.

Each subcommand lives in its own module under ``kfp_nvrx.components.cli.commands`` and exposes
``register(subparsers)``; the module is imported only when the CLI starts, and heavy imports stay
inside the command's handler so ``kfp-nvrx --help`` is fast and works without torch.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import math
import os
import signal
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import NoReturn

from kfp_nvrx.components.core.disk import disk_full, disk_full_line
from kfp_nvrx.components.core.fields import CLI
from kfp_nvrx.components.errors import UserError, redact
from kfp_nvrx.components.redaction import redacted_output
from kfp_nvrx.components.redaction import register as register_secrets

#: Set to show the traceback of an unexpected error (bug reports).
DEBUG_ENV = "KFP_NVRX_DEBUG"
#: OSErrors that come from what the user typed (a path), reported as bad input (exit 2).
_INPUT_ERRNOS = {errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES,
                 errno.EPERM, errno.EEXIST, errno.ELOOP, errno.EROFS, errno.ENOTEMPTY}

#: Subcommand modules, in the order ``--help`` lists them.
COMMAND_MODULES = (
    "kfp_nvrx.components.cli.commands.prepare_data",
    "kfp_nvrx.components.cli.commands.launch_local",
    "kfp_nvrx.components.cli.commands.render_job",
    "kfp_nvrx.components.cli.commands.launch",
    "kfp_nvrx.components.cli.commands.export",
    "kfp_nvrx.components.cli.commands.goodput",
    "kfp_nvrx.components.cli.commands.demo",
    "kfp_nvrx.components.cli.commands.drill",
    "kfp_nvrx.components.cli.commands.compile",
    "kfp_nvrx.components.cli.commands.run_local",
    "kfp_nvrx.components.cli.commands.submit",
    "kfp_nvrx.components.cli.commands.schedule",
)


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line (argparse's default prints usage first)."""

    def error(self, message: str) -> NoReturn:  # noqa: D401
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


def _secrets(args: argparse.Namespace) -> list[str]:
    """Every credential the command line points at, to cut out of whatever we print."""
    found = []
    token_file = getattr(args, "token_file", None)
    if token_file:
        from kfp_nvrx.components.core.bounded import TOKEN_LIMIT, read_bytes

        try:  # bounded, regular files only: the same reader the command itself uses
            text = read_bytes(token_file, "--token-file", TOKEN_LIMIT, "token file").decode(
                "utf-8", errors="replace")
            found += [line.strip() for line in text.splitlines() if line.strip()]
        except UserError:
            pass
    host = getattr(args, "host", None) or ""
    userinfo = host.partition("://")[2].partition("/")[0].rpartition("@")[0]
    if userinfo:
        found += [userinfo, *userinfo.split(":", 1)]
    return found


def _field_of(args: argparse.Namespace, path: str | None) -> str:
    """The flag whose value is (or holds) ``path``; else the path itself."""
    if path:
        target = os.path.abspath(str(path))
        for dest, value in vars(args).items():
            if isinstance(value, str) and value and dest not in ("command", "handler"):
                mine = os.path.abspath(value)
                if target == mine or target.startswith(mine.rstrip(os.sep) + os.sep):
                    return f"--{dest.replace('_', '-')}"
    return str(path or "input")


def _report(args: argparse.Namespace, err: BaseException) -> int:
    """One line on stderr for any error escaping a command; returns the exit code."""
    if isinstance(err, UserError):  # the libraries name the field; a CLI user typed the flag
        line, rc = CLI.reword(err).one_line(), UserError.exit_code
    elif disk_full(err):  # the run dir's marker, lock or a temp file on a full disk
        line, rc = disk_full_line(getattr(err, "filename", None) or "."), 1
    elif isinstance(err, OSError) and err.errno in _INPUT_ERRNOS:
        field = _field_of(args, err.filename)
        line = f"{field}: {err.strerror} ({err.filename})"
        rc = UserError.exit_code
    else:
        line = (f"unexpected {type(err).__name__}: {err} (set {DEBUG_ENV}=1 to see the "
                "traceback)")
        rc = 1
    line = redact(" ".join(line.split()), _secrets(args))
    sys.stderr.write(f"kfp-nvrx {args.command}: error: {line}\n")
    return rc


def _terminate(signum: int, _frame: object) -> None:
    """Unwind the command like Ctrl-C on SIGTERM/SIGHUP, so its cleanup runs before exit.

    Temporary folders are removed and child processes stopped by the ``finally`` blocks.
    """
    raise KeyboardInterrupt(signal.Signals(signum).name)


#: Every int flag is a signed 32-bit int: counts, seconds and ids that reach the job spec, the
#: Kubernetes API (int32 fields) or a loop (2**70 nodes once raised OverflowError, exit 1).
INT_FLAG_RANGE = (-(2**31), 2**31 - 1)


def _check_number_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses bad numbers in argparse's one line, for every command at once.

    An int flag outside :data:`INT_FLAG_RANGE`, or a float flag that is not finite (``nan``
    compares false with every bound a command checks, so it passed them all).
    """
    lo, hi = INT_FLAG_RANGE
    for dest, value in vars(args).items():
        flag = f"--{dest.replace('_', '-')}"
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and not lo <= v <= hi:
                parser.error(f"argument {flag}: {v} is out of range ({lo} to {hi})")
            if isinstance(v, float) and not math.isfinite(v):
                parser.error(f"argument {flag}: must be a finite number, got {v}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kfp-nvrx`` console script."""
    # torch imports pynvml on CPU-only machines and warns about it on every command.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while the commands load: a line, not a traceback
        sys.stderr.write("kfp-nvrx: interrupted (SIGINT)\n")
        return 128 + signal.SIGINT
    _check_number_flags(parser, args)
    register_secrets(*_secrets(args))
    with redacted_output():  # no credential reaches stdout/stderr, whoever prints it
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command: signals as Ctrl-C, any error as one line."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _terminate)
    try:
        rc = args.handler(args)
    except KeyboardInterrupt as err:
        name = str(err) or "SIGINT"
        sys.stderr.write(f"kfp-nvrx {args.command}: interrupted ({name})\n")
        return 128 + int(getattr(signal.Signals, name, signal.SIGINT))
    except Exception as err:  # noqa: BLE001 - never a traceback (DEBUG_ENV shows it)
        if os.environ.get(DEBUG_ENV) and not isinstance(err, UserError):
            raise
        return _report(args, err)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
