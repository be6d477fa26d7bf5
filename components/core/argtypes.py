"""argparse value types shared by the CLI and the trainer: refusals in argparse's one line.

``--deadline nan`` once meant "no deadline" (every comparison with nan is false) and
``--run-dir ''`` meant the working directory. Each flag of that kind declares one of these types,
so the refusal names the flag before anything runs. Imports no torch.
"""

from __future__ import annotations

import argparse
import math


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
