"""The parameters of a compiled pipeline: read its package, type ``--param name=value`` items.

Checked before anything is sent to a Kubeflow Pipelines API (:mod:`.client`) or run locally:
names against the compiled pipeline's inputs, values against their KFP types.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from kfp_nvrx.components.core.argtypes import parse_bool
from kfp_nvrx.components.core.bounded import PACKAGE_LIMIT, read_text
from kfp_nvrx.components.errors import UserError


def load_package(path: str | Path) -> dict[str, Any]:
    """Read a compiled pipeline YAML (the first document: the pipeline spec)."""
    text = read_text(path, "--package", PACKAGE_LIMIT, "compiled pipeline")
    try:
        docs = list(yaml.safe_load_all(text))
    except (yaml.YAMLError, RecursionError):  # RecursionError: nesting PyYAML cannot follow
        raise UserError("--package", f"{path} is not valid YAML") from None
    if not docs or not isinstance(docs[0], dict) or "root" not in docs[0]:
        raise UserError("--package", f"{path} is not a compiled KFP pipeline (no 'root')")
    return docs[0]


def pipeline_parameters(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Return the pipeline's input parameters: name -> ``{parameterType, defaultValue?, ...}``."""
    return dict(spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {}))


def _convert(name: str, raw: str, ptype: str) -> Any:
    """``raw`` as a value of the KFP parameter type ``ptype`` (STRING and unknown types: as is)."""
    convert = _CONVERTERS.get(ptype)
    return raw if convert is None else convert(f"--param {name}", raw)


def _as_int(field: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise UserError(field, f"expected an integer, got {raw!r}") from None


def _as_float(field: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise UserError(field, f"expected a number, got {raw!r}") from None


def _as_bool(field: str, raw: str) -> bool:
    value = parse_bool(raw.strip(), digits=True)
    if value is None:
        raise UserError(field, f"expected true or false, got {raw!r}")
    return value


def _as_list(field: str, raw: str) -> list[Any]:
    if not raw.strip().startswith("["):
        return [item.strip() for item in raw.split(",") if item.strip()]
    value = _json(field, raw)
    if not isinstance(value, list):
        raise UserError(field, f"expected a JSON list or comma-separated items, got {raw!r}")
    return value


def _as_struct(field: str, raw: str) -> dict[str, Any]:
    value = _json(field, raw)
    if not isinstance(value, dict):
        raise UserError(field, f"expected a JSON object, got {raw!r}")
    return value


#: KFP parameter type -> its converter from ``--param`` text (``field`` names it in errors).
_CONVERTERS: dict[str, Callable[[str, str], Any]] = {
    "NUMBER_INTEGER": _as_int, "NUMBER_DOUBLE": _as_float, "BOOLEAN": _as_bool,
    "LIST": _as_list, "STRUCT": _as_struct,
}


def _json(field: str, raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as err:
        raise UserError(field, f"is not valid JSON ({err.msg} at column {err.colno})") from None


def parse_params(items: list[str] | None, params: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Turn ``--param name=value`` strings into typed pipeline arguments.

    Args:
        items: The raw ``name=value`` strings; later ones win.
        params: :func:`pipeline_parameters` of the target pipeline.

    Returns:
        Name -> value converted to the parameter's type (lists accept JSON or ``a,b``).

    Raises:
        UserError: For malformed items, unknown names or values of the wrong type.

    """
    out: dict[str, Any] = {}
    for item in items or []:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UserError("--param", f"expected name=value, got {item!r}")
        if name not in params:
            raise UserError(f"--param {name}", "unknown parameter; known: "
                            f"{', '.join(sorted(params))}")
        out[name] = _convert(name, raw, params[name].get("parameterType", "STRING"))
    return out


# -- KFP API -----------------------------------------------------------------------------------
