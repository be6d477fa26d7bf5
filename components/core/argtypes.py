"""argparse value types shared by the CLI and the trainer: refusals in argparse's one line.

``--deadline nan`` once meant "no deadline" (every comparison with nan is false) and
``--run-dir ''`` meant the working directory. Each flag of that kind declares one of these types,
so the refusal names the flag before anything runs. :func:`parse_bool` is the one reading of a
boolean written as text (``--set key=on``, a pipeline ``--param flag=true``). Imports no torch.
"""

from __future__ import annotations

import argparse
import math

#: The words read as a boolean, in any case.
BOOL_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


def seconds(text: str) -> float:
    """A finite number of seconds > 0 (``nan``, ``inf``, ``0`` and negatives refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0), got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def path(text: str) -> str:
    """A path the user names: not empty or blank (``''`` would silently mean ``.``), no NUL."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a path")
    if "\0" in text:
        raise argparse.ArgumentTypeError("holds a NUL character; give a path")
    return text


def parse_bool(text: str, digits: bool = False) -> bool | None:
    """``text`` as a boolean: one of :data:`BOOL_WORDS` in any case, or None when it is not.

    Args:
        text: The text as given (surrounding blanks are not removed here).
        digits: Read ``1`` and ``0`` too (KFP's own rendering of a boolean parameter); a trainer
            ``--set`` takes words only, so ``train.compile=1`` stays a mistake.
    """
    if digits and text in ("1", "0"):
        return text == "1"
    return BOOL_WORDS.get(text.lower())
