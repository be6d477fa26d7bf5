"""KFP cron expressions (robfig/cron, seconds first), checked before anything is sent.

A schedule may fire at most once a minute (:data:`MIN_INTERVAL_S`): the seconds field names one
second and ``@every`` takes at least ``1m``. A training pipeline started every second piles up
runs faster than any cluster finishes them.
"""

from __future__ import annotations

import re

from kfp_nvrx.components.errors import UserError

#: Shortest interval between two firings of a schedule.
MIN_INTERVAL_S = 60
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

_CRON_FIELDS = (  # name, low, high, names
    ("seconds", 0, 59, None),
    ("minutes", 0, 59, None),
    ("hours", 0, 23, None),
    ("day-of-month", 1, 31, None),
    ("month", 1, 12, ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT",
                      "NOV", "DEC")),
    ("day-of-week", 0, 6, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")),
)
_CRON_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight",
                     "@hourly")
_GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")
_CRON_EXAMPLE = "e.g. '0 0 3 * * *' for 03:00:00 every day"


def _cron_value(text: str, low: int, names: tuple[str, ...] | None, field: str) -> int:
    if names and text.upper() in names:
        return names.index(text.upper()) + (low if field == "month" else 0)
    if not text.isdigit():
        raise ValueError(f"{field} value {text!r} is not a number")
    return int(text)


def _check_cron_field(text: str, field: str, low: int, high: int,
                      names: tuple[str, ...] | None) -> None:
    for part in text.split(","):
        base, _, step = part.partition("/")
        if step and (not step.isdigit() or int(step) < 1):
            raise ValueError(f"{field} step {step!r} must be a whole number >= 1")
        if base in ("*", "?"):
            if base == "?" and field not in ("day-of-month", "day-of-week"):
                raise ValueError(f"'?' is allowed only in day-of-month and day-of-week, "
                                 f"not in {field}")
            continue
        first, _, last = base.partition("-")
        lo = _cron_value(first, low, names, field)
        hi = _cron_value(last, low, names, field) if last else lo
        for v in (lo, hi):
            if not low <= v <= high:
                raise ValueError(f"{field} value {v} is outside {low}-{high}")
        if lo > hi:
            raise ValueError(f"{field} range {base!r} runs backwards")


def validate_cron(expr: str) -> str:
    """Check a KFP cron expression: 6 fields, seconds first (robfig/cron syntax).

    Also accepts the descriptors ``@daily`` etc. and ``@every <duration>``.

    Args:
        expr: The expression as typed.

    Returns:
        The expression with surrounding/duplicate whitespace removed.

    Raises:
        UserError: Naming ``--cron``, what is wrong and an example.

    """
    parts = (expr or "").split()
    text = " ".join(parts)
    if text.startswith("@"):
        if text in _CRON_DESCRIPTORS:
            return text
        if len(parts) == 2 and parts[0] == "@every" and _GO_DURATION.match(parts[1]):
            seconds = _go_seconds(parts[1])
            if seconds < MIN_INTERVAL_S:
                raise UserError("--cron", f"{text!r} fires every {seconds:g}s; schedules may "
                                f"fire at most once a minute (e.g. '@every 6h')")
            return text
        raise UserError("--cron", f"unknown descriptor {text!r}; use one of "
                        f"{', '.join(_CRON_DESCRIPTORS)} or '@every 6h', or 6 fields, "
                        f"{_CRON_EXAMPLE}")
    if len(parts) != 6:
        hint = (" (that looks like 5-field Unix cron; KFP puts seconds first)"
                if len(parts) == 5 else "")
        raise UserError("--cron", f"expected 6 fields (seconds minutes hours day-of-month month "
                        f"day-of-week), got {len(parts)} in {text!r}{hint}; {_CRON_EXAMPLE}")
    for part, (field, low, high, names) in zip(parts, _CRON_FIELDS, strict=True):
        bare = part.upper()
        for name in names or ():
            bare = bare.replace(name, "")
        if re.search(r"[LW#]", bare):
            raise UserError("--cron", f"{field} {part!r}: L, W and # are Quartz extensions that "
                            f"KFP does not support; {_CRON_EXAMPLE}")
        try:
            _check_cron_field(part, field, low, high, names)
        except ValueError as err:
            raise UserError("--cron", f"{err} in {text!r}; {_CRON_EXAMPLE}") from None
    if not parts[0].isdigit():
        raise UserError("--cron", f"seconds field {parts[0]!r} fires more than once a minute; "
                        f"give one second (e.g. 0): schedules may fire at most once a minute; "
                        f"{_CRON_EXAMPLE}")
    return text


def _go_seconds(duration: str) -> float:
    """A Go duration (``1h30m``, ``90s``, ``500ms``) in seconds."""
    return sum(float(num) * _GO_UNITS[unit]
               for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", duration))


