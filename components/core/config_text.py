"""Config text: the YAML of ``--config`` files and the right-hand sides of ``--set``.

YAML 1.1 (what PyYAML speaks) reads ``1:30`` as the base-60 number 90 and silently keeps the last
of two equal keys. A config file is therefore read with a loader that knows no base-60 numbers
and refuses a duplicate key, naming it. A ``--set`` value is not YAML at all: it is read as the
type its field declares, so ``data.path=/runs/a #1`` keeps its ``#`` and ``1:30`` stays a string
(or is refused for a number field, naming the field).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kfp_nvrx.components.errors import UserError

_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader without base-60 numbers (``1:30`` stays the string ``'1:30'``)."""


_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver(_INT_TAG, re.compile(
    r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(_FLOAT_TAG, re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _check_duplicates(node: yaml.Node | None, path: str, where: Path) -> None:
    """Raises UserError naming the first key that a mapping under ``node`` holds twice."""
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
            _check_duplicates(value_node, dotted, where)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicates(item, path, where)


def read_config_file(path: Path) -> Any:
    """The parsed YAML of a ``--config`` file (None when empty).

    Raises:
        UserError: Naming ``--config`` when the file is unreadable, not UTF-8 text or not YAML;
            naming the key when a mapping holds it twice.
    """
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise UserError("--config", f"cannot read {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise UserError("--config", f"{path} is not UTF-8 text (byte {err.start}); pass a YAML "
                        "file or a preset name") from None
    try:
        _check_duplicates(yaml.compose(text, Loader=_ConfigLoader), "", path)
        return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise UserError("--config", f"{path} is not valid YAML ({' '.join(str(err).split())})") \
            from None


_BOOLS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}
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
    if typ is bool and text.lower() in _BOOLS:
        return _BOOLS[text.lower()]
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
