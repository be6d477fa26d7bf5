"""KFP cron expressions (robfig/cron, seconds first), checked before anything is sent.

Parsing, ranges and "does it ever fire" are `croniter`_'s (``second_at_beginning=True``: KFP
puts seconds first). What stays here is where KFP's robfig/cron v3 dialect is narrower than
croniter's, plus our own policy:

- robfig knows no ``L``, ``W``, ``#``, ``R`` or ``H`` (croniter and Quartz do), refuses a range
  that runs backwards (croniter wraps ``5-1`` around) and a day-of-week above 6 (croniter reads 7
  as Sunday);
- a schedule that can never fire (``0 0 0 30 2 *``, 31 April) is refused: KFP would accept it and
  never start a run;
- a schedule may fire at most once a minute (:data:`MIN_INTERVAL_S`): the seconds field names one
  second and ``@every`` takes at least ``1m``. A training pipeline started every second piles up
  runs faster than any cluster finishes them.

.. _croniter: https://pypi.org/project/croniter/
"""

from __future__ import annotations

import datetime as dt
import re

from croniter import CroniterBadDateError, CroniterError, croniter

from kfp_nvrx.components.errors import UserError

#: Shortest interval between two firings of a schedule.
MIN_INTERVAL_S = 60
#: The Gregorian calendar repeats every 400 years: a schedule without a firing in that span has
#: none at all (searching it takes a few milliseconds).
_CALENDAR_CYCLE_YEARS = 400
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
#: Field name, lowest and highest value in robfig/cron (day-of-week 0-6: no 7 for Sunday).
_FIELDS = (("seconds", 0, 59), ("minutes", 0, 59), ("hours", 0, 23), ("day-of-month", 1, 31),
           ("month", 1, 12), ("day-of-week", 0, 6))
_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
_MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
_DAYS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")
_NAMES = re.compile("|".join(_MONTHS + _DAYS), re.IGNORECASE)
_GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")
_EXAMPLE = "e.g. '0 0 3 * * *' for 03:00:00 every day"


def _robfig_only(part: str, field: str, low: int, high: int) -> str | None:
    """What robfig/cron refuses in one field although croniter may accept it (None: nothing).

    Out-of-range values are worded here too, so the message names the field and its range.
    """
    names = _MONTHS if field == "month" else _DAYS
    # Names as numbers (JAN=1, SUN=0), so that DEC-JAN counts as the backwards range it is.
    bare = _NAMES.sub(lambda m: str(names.index(m[0].upper()) + (field == "month"))
                      if m[0].upper() in names else "x", part)
    if re.search(r"[LWRH#]", bare, re.IGNORECASE):
        return (f"{field} {part!r}: L, W, #, R and H are extensions (Quartz, Jenkins) that KFP "
                "does not support")
    for item, numbers in zip(part.split(","), bare.split(","), strict=True):
        first, sep, last = numbers.partition("/")[0].partition("-")
        for value in (first, last):
            if value.isdigit() and not low <= int(value) <= high:
                return f"{field} value {int(value)} is outside {low}-{high}"
        if sep and first.isdigit() and last.isdigit() and int(first) > int(last):
            return f"{field} range {item!r} runs backwards"
    return None


def _check_field(part: str, index: int) -> None:
    """Let croniter parse one field alone (the others ``*``) so its refusal names the field."""
    probe = ["0", "*", "*", "*", "*", "*"]
    probe[index] = part
    field, low, high = _FIELDS[index]
    problem = _robfig_only(part, field, low, high)
    if problem is None and not croniter.is_valid(" ".join(probe), second_at_beginning=True):
        problem = f"{field} {part!r} is not valid (numbers, names, '*', ',', '-' and '/' only; " \
                  "values within range)"
    if problem is not None:
        raise UserError("--cron", f"{problem}; {_EXAMPLE}")


def _fires(text: str) -> bool:
    """True when the 6-field expression ``text`` has a firing time within a calendar cycle."""
    try:
        croniter(text, dt.datetime.now(dt.timezone.utc), second_at_beginning=True,
                 max_years_between_matches=_CALENDAR_CYCLE_YEARS).get_next(float)
    except CroniterBadDateError:
        return False
    return True


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
        if text in _DESCRIPTORS:
            return text
        if len(parts) == 2 and parts[0] == "@every" and _GO_DURATION.match(parts[1]):
            seconds = _go_seconds(parts[1])
            if seconds < MIN_INTERVAL_S:
                raise UserError("--cron", f"{text!r} fires every {seconds:g}s; schedules may "
                                f"fire at most once a minute (e.g. '@every 6h')")
            return text
        raise UserError("--cron", f"unknown descriptor {text!r}; use one of "
                        f"{', '.join(_DESCRIPTORS)} or '@every 6h', or 6 fields, {_EXAMPLE}")
    if len(parts) != 6:
        hint = (" (that looks like 5-field Unix cron; KFP puts seconds first)"
                if len(parts) == 5 else "")
        raise UserError("--cron", f"expected 6 fields (seconds minutes hours day-of-month month "
                        f"day-of-week), got {len(parts)} in {text!r}{hint}; {_EXAMPLE}")
    for index, part in enumerate(parts):
        _check_field(part, index)
    if not parts[0].isdigit():
        raise UserError("--cron", f"seconds field {parts[0]!r} fires more than once a minute; "
                        f"give one second (e.g. 0): schedules may fire at most once a minute; "
                        f"{_EXAMPLE}")
    # robfig reads '*/1' and '?' in the day fields as '*' (day-of-month AND day-of-week), which
    # decides whether e.g. '0 0 0 30 2 */1' can fire; croniter would OR them.
    dom, dow = (("*" if p in ("*/1", "?", "?/1") else p) for p in (parts[3], parts[5]))
    try:
        fires = _fires(" ".join([*parts[:3], dom, parts[4], dow]))
    except CroniterError:  # every field parsed alone; together they still are not an expression
        raise UserError("--cron", f"{text!r} is not a cron expression; {_EXAMPLE}") from None
    if not fires:
        raise UserError("--cron", f"{text!r} never fires: no calendar date has day-of-month "
                        f"{parts[3]} in month {parts[4]}; {_EXAMPLE}")
    return text


def _go_seconds(duration: str) -> float:
    """A Go duration (``1h30m``, ``90s``, ``500ms``) in seconds."""
    return sum(float(num) * _GO_UNITS[unit]
               for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", duration))
