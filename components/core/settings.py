"""How a config setting is declared and checked: its constraint, its type, its bounds in words.

:mod:`.config` declares every section's fields with :func:`setting` (or :func:`positive`,
:func:`non_negative`, :func:`one_of`, :func:`registered`); ``Section.__setattr__`` runs
:func:`coerce_setting` and :func:`check_setting` on every assignment, from YAML, ``--set`` or
Python alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import field
from typing import Any

from kfp_nvrx.components.core.config_text import AmbiguousNumber
from kfp_nvrx.components.errors import UserError

#: The largest value of an int field that declares no upper bound of its own: every count,
#: size and step of a run fits a signed 32-bit int (torch indices, the job spec, JSON readers).
MAX_INT = 2**31 - 1


def setting(default: Any, *, gt: float | None = None, ge: float | None = None,
            le: float | None = None, lt: float | None = None,
            choices: tuple[str, ...] = ()) -> Any:
    """A config field with its constraint, checked on every assignment (YAML, ``--set``, Python).

    The constraint is ``gt < value`` or ``ge <= value``, and ``value <= le`` or ``value < lt``,
    or one of ``choices``. Every float field must also be finite (no nan, no inf), and an int
    field without an upper bound is at most :data:`MAX_INT`.
    """
    return field(default=default, metadata={"gt": gt, "ge": ge, "le": le, "lt": lt,
                                            "choices": choices})


def positive(default: float) -> Any:
    """A field that must be > 0."""
    return setting(default, gt=0)


def non_negative(default: float) -> Any:
    """A field that must be >= 0."""
    return setting(default, ge=0)


def one_of(default: str, *choices: str) -> Any:
    """A field whose value is one of ``choices``."""
    return setting(default, choices=(default, *[c for c in choices if c != default]))


def registered(default: str, kinds: Callable[[], Iterable[str]]) -> Any:
    """A field whose value is one of a registry's keys, ``kinds()``, read when it is checked.

    A registry (e.g. the checkpoint stores of :mod:`.store_kinds`) may gain a key after this
    module is imported (:func:`~.store_kinds.register_store`), so the choices are not frozen here.
    """
    return field(default=default, metadata={"kinds": kinds})


def _choices(rule: Mapping[str, Any]) -> tuple[str, ...]:
    """The values ``rule`` allows when it is a choice (empty: not a choice)."""
    kinds = rule.get("kinds")
    return tuple(rule.get("choices") or ()) or (tuple(kinds()) if kinds is not None else ())


def bounds_text(rule: Mapping[str, Any]) -> str:
    """``rule``'s numeric bounds in words: ``> 0``, ``within [0, 1)``."""
    def num(x: float) -> str:
        return f"{x:g}" if isinstance(x, float) else str(x)

    lo = (f"[{num(rule['ge'])}" if rule.get("ge") is not None
          else f"({num(rule['gt'])}" if rule.get("gt") is not None else "")
    hi = (f"{num(rule['le'])}]" if rule.get("le") is not None
          else f"{num(rule['lt'])})" if rule.get("lt") is not None else "")
    if lo and hi:
        return f"within {lo}, {hi}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {lo[1:]}"
    return f"{'<=' if hi[-1] == ']' else '<'} {hi[:-1]}"


def check_setting(key: str, value: Any, rule: Mapping[str, Any]) -> None:
    """Raises UserError naming ``key`` when ``value`` breaks its field's constraint."""
    choices = _choices(rule)
    if choices and value not in choices:
        raise UserError(key, f"must be one of {', '.join(choices)}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(key, f"must be a finite number, got {value}")
    gt, ge, le, lt = (rule.get(k) for k in ("gt", "ge", "le", "lt"))
    if isinstance(value, int) and not isinstance(value, bool) and le is None and lt is None \
            and value > MAX_INT:
        raise UserError(key, f"must be <= {MAX_INT} (2^31 - 1), got {value}")
    if ((gt is not None and not value > gt) or (ge is not None and not value >= ge)
            or (le is not None and not value <= le) or (lt is not None and not value < lt)):
        raise UserError(key, f"must be {bounds_text(rule)}, got {value}")


def coerce_setting(key: str, value: Any, typ: Any, rule: Mapping[str, Any]) -> Any:
    """Checks ``value`` against the annotated type (ints may stand for floats, not bools)."""
    if isinstance(value, AmbiguousNumber):
        raise UserError(key, f"{str(value)!r} is a number YAML 1.1 and 1.2 read differently (a "
                        "leading 0 is octal in 1.1, decimal in 1.2) or no plain decimal (0x, 0o, "
                        "0b, _); write it in plain decimal, or quote it for a string")
    got = _coerce(key, value, typ, rule)
    if got is not _MISMATCH:
        return got
    name = getattr(typ, "__name__", str(typ))
    raise UserError(key, f"expected {name}, got {value!r} ({type(value).__name__})")


#: What :func:`_coerce` returns for a value that is no ``typ``.
_MISMATCH = object()


def _coerce(key: str, value: Any, typ: Any, rule: Mapping[str, Any]) -> Any:
    """``value`` as ``typ`` (bool, int, float or str), else :data:`_MISMATCH`."""
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)  # a plain int, not config_text.YamlInt
    elif typ is float:
        return _as_float(key, value)
    elif typ is str:
        return _as_str(value, rule)
    return _MISMATCH


def _as_float(key: str, value: Any) -> Any:
    """``value`` as a float (an int, float or numeric string), else :data:`_MISMATCH`."""
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:  # YAML 1.1 reads `1e-3` (no dot) as a string
            return float(value)
        except OverflowError:  # an int of hundreds of digits
            raise UserError(key, f"must be a finite number, got {value}") from None
        except ValueError:
            pass
    return _MISMATCH


def _as_str(value: Any, rule: Mapping[str, Any]) -> Any:
    """``value`` as a string (a YAML 1.1 ``off``/``on`` choice, a number's text), else _MISMATCH."""
    if isinstance(value, str):
        return str(value)
    choices = rule.get("choices") or ()
    word = {False: "off", True: "on"}.get(value) if isinstance(value, bool) else None
    if word is not None and word in choices:
        return word  # YAML 1.1 reads a bare `off` as false
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not choices:
        return getattr(value, "text", None) or str(value)  # YAML `name: 1.50` keeps "1.50"
    return _MISMATCH
