"""Config text: the YAML of ``--config`` files and the right-hand sides of ``--set``.

YAML 1.1 (what PyYAML speaks) reads ``1:30`` as the base-60 number 90, ``010`` as 8 and silently
keeps the last of two equal keys; a few hundred bytes of aliases expand to 10^9 values and deep
nesting exhausts the recursion. A config file is therefore read with a size cap and a loader that
speaks YAML 1.2 numbers (refusing the ones 1.1 reads differently), refuses nesting and alias
expansion past fixed limits and refuses a duplicate key, naming it. A ``--set`` value is not YAML
at all: it is read as the type its field declares, so ``data.path=/runs/a #1`` keeps its ``#``
and ``1:30`` stays a string (or is refused for a number field, naming the field).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kfp_nvrx.components.core.argtypes import parse_bool
from kfp_nvrx.components.core.bounded import CONFIG_LIMIT, MAX_DEPTH, read_text
from kfp_nvrx.components.errors import UserError

_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
#: Plain scalars that YAML 1.1 (PyYAML) and YAML 1.2 read as different numbers, or that are no
#: plain decimal number at all: ``010`` (octal 8 in 1.1, 10 in 1.2), ``0x1F``, ``0o17``, ``0b1``,
#: ``1_000``. They are refused for every field rather than guessed.
_AMBIGUOUS_TAG = "tag:kfp-nvrx,2026:ambiguous-number"
#: Expanded nodes a config may hold (aliases counted as often as they are used): a "billion
#: laughs" document expands to 10^9 from a few hundred bytes.
MAX_NODES = 100_000


class YamlInt(int):
    """An int read from YAML, with the text it was written as (for a string field)."""

    text: str


class YamlFloat(float):
    """A float read from YAML, with the text it was written as (for a string field)."""

    text: str


class AmbiguousNumber(str):
    """A plain scalar such as ``010`` or ``0x1F``: refused wherever it is used (see above)."""


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader speaking YAML 1.2 numbers: decimal ints, 1.2 floats, nothing else.

    No base-60 (``1:30`` stays the string ``'1:30'``); leading zeros, ``0x``/``0o``/``0b`` and
    ``_`` separators resolve to :class:`AmbiguousNumber`, which every field refuses.
    """


_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver(_INT_TAG, re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"),
                                    list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(_AMBIGUOUS_TAG, re.compile(
    r"^[-+]?(?:0[0-9]+|0[xXoObB][0-9a-fA-F_]*|[0-9][0-9_]*_[0-9_]*)$"), list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(_FLOAT_TAG, re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> YamlInt:
    try:  # an explicit `!!int 0x1F` reaches here too: decimal only, as for plain scalars
        value = YamlInt(int(node.value))
    except ValueError:
        raise yaml.constructor.ConstructorError(None, None, f"{node.value!r} is no decimal int",
                                                node.start_mark) from None
    value.text = node.value
    return value


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> YamlFloat:
    try:
        value = YamlFloat(yaml.SafeLoader.construct_yaml_float(loader, node))
    except ValueError:
        raise yaml.constructor.ConstructorError(None, None, f"{node.value!r} is no number",
                                                node.start_mark) from None
    value.text = node.value
    return value


_ConfigLoader.add_constructor(_INT_TAG, _construct_int)
_ConfigLoader.add_constructor(_FLOAT_TAG, _construct_float)
_ConfigLoader.add_constructor(_AMBIGUOUS_TAG, lambda _loader, node: AmbiguousNumber(node.value))


def _check_shape(text: str, field: str, where: str | Path) -> None:
    """Refuses nesting deeper than MAX_DEPTH before PyYAML's recursive composer sees it.

    PyYAML's parser is a state machine (no recursion), so its events can be counted safely.
    """
    depth = 0
    for event in yaml.parse(text, Loader=_ConfigLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark is not None else "?"
                raise UserError(field, f"{where} nests deeper than {MAX_DEPTH} levels (line "
                                f"{line}); a config is a mapping of sections")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _check_expansion(root: yaml.Node | None, field: str, where: str | Path) -> None:
    """Refuses a document whose aliases expand past MAX_NODES nodes, or refer to themselves.

    Each node is sized once (memoised), so a bomb is measured in linear time, not expanded.
    """
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise UserError(field, f"{where} holds an alias that refers to itself; a config "
                            "is a tree of plain values")
        active.add(key)
        if isinstance(node, yaml.MappingNode):
            n = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(size(v) for v in node.value)
        else:
            n = 1
        active.discard(key)
        sizes[key] = n = min(n, MAX_NODES + 1)
        return n

    if root is not None and size(root) > MAX_NODES:
        raise UserError(field, f"{where} expands to more than {MAX_NODES} values through YAML "
                        "aliases (&anchor/*alias); write the values out")


def _check_duplicates(node: yaml.Node | None, path: str, where: Path | str,
                      seen: set[int] | None = None) -> None:
    """Raises UserError naming the first key that a mapping under ``node`` holds twice."""
    seen = set() if seen is None else seen
    if node is None or id(node) in seen:  # a node shared through an alias is checked once
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else ""
            dotted = f"{path}.{key}" if path else key
            if key and key in lines:
                raise UserError(dotted, f"appears twice in {where} (lines {lines[key]} and "
                                f"{key_node.start_mark.line + 1}); YAML would silently keep the "
                                "last: keep one")
            lines[key] = key_node.start_mark.line + 1
            _check_duplicates(value_node, dotted, where, seen)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicates(item, path, where, seen)


def _plain(value: Any) -> Any:
    """``value`` with plain int/float/str in place of the loader's own types (for dumping)."""
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    for typ in (bool, int, float, str):
        if isinstance(value, typ):
            return typ(value)
    return value


def load_yaml(text: str, field: str, where: str | Path, *, typed: bool = False) -> Any:
    """YAML text -> value, the one way config text is read (``--config``, ``--affinity``).

    YAML 1.2 numbers (:class:`_ConfigLoader`), no nesting past MAX_DEPTH, no alias expansion past
    MAX_NODES, no key twice in one mapping. ``typed`` keeps :class:`YamlInt`, :class:`YamlFloat`
    and :class:`AmbiguousNumber` (the trainer config's fields check them); otherwise the value
    holds plain Python types only.

    Raises:
        UserError: Naming ``field`` (a duplicate key: naming the key) when the text is no such YAML.
    """
    try:
        _check_shape(text, field, where)
        loader = _ConfigLoader(text)
        try:
            node = loader.get_single_node()
            _check_expansion(node, field, where)
            _check_duplicates(node, "", where)
            value = None if node is None else loader.construct_document(node)
            return value if typed else _plain(value)
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise UserError(field, f"{where} is not valid YAML ({' '.join(str(err).split())[:300]})"
                        ) from None


def read_config_file(path: Path) -> Any:
    """The parsed YAML of a ``--config`` file (None when empty), read with a size cap.

    Raises:
        UserError: Naming ``config`` when the file is unreadable, too large, not UTF-8 text or
            not YAML (:func:`load_yaml`); naming the key when a mapping holds it twice.
    """
    text = read_text(path, "config", CONFIG_LIMIT, "config file")
    return load_yaml(text, "config", path, typed=True)


_INT = re.compile(r"[-+]?[0-9]+(?:_[0-9]+)*")


def parse_set_value(key: str, text: str, typ: Any) -> Any:
    """The value of ``--set key=text`` as the type ``typ`` that ``key`` declares.

    ``str`` takes the text verbatim (one pair of enclosing quotes removed, so ``''`` is empty);
    ``bool`` takes true/false/yes/no/on/off in any case; ``int`` takes decimal digits; ``float``
    takes what Python's ``float`` reads (the field's own check then refuses nan and inf).

    Raises:
        UserError: Naming ``key`` when the text is not a value of that type.
    """
    if typ is str:
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            return text[1:-1]
        return text
    if typ is bool and (flag := parse_bool(text)) is not None:
        return flag
    if typ is int and _INT.fullmatch(text):
        return int(text)
    if typ is float:
        try:
            return float(text)
        except ValueError:
            pass
    name = getattr(typ, "__name__", str(typ))
    hint = " (true or false)" if typ is bool else ""
    raise UserError(key, f"expected {name}{hint}, got {text!r}")
