"""A ``model.safetensors`` checked by its header alone (torch-free, reads a few bytes).

The format: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (plus an optional ``__metadata__`` of
strings), then the tensor bytes, whose offsets count from the end of the header.

The check is the one the safetensors library makes when a worker loads the file, so that a file
that passes here loads there: every dtype is one it knows; each tensor's bytes are exactly its
shape times its element size; the tensors, in offset order, tile the data from byte 0 with no
gap or overlap; and the last one ends where the file ends (no trailing bytes). A file that
failed any of these used to pass the preflight and crash every worker at its warm start, once
per restart.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, TypeGuard

from kfp_nvrx.components.core.bounded import open_regular
from kfp_nvrx.components.errors import UserError

#: What the safetensors library itself accepts as a header.
MAX_HEADER = 100_000_000
#: Bytes per element of each dtype safetensors reads into torch (safetensors.torch._TYPES).
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1,
               "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4,
               "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def weights_file(path: str | Path) -> Path:
    """``path`` itself, or the ``model.safetensors`` inside it when it is a directory (an export)."""
    file = Path(path)
    return file / "model.safetensors" if file.is_dir() else file


def _raw_header(field: str, path: str | Path) -> tuple[Path, dict[str, Any], int]:
    """(file, its decoded JSON header, bytes of tensor data after the header)."""
    file = weights_file(path)
    if not os.path.lexists(file):
        what = "has no model.safetensors" if Path(path).is_dir() else "does not exist"
        raise UserError(field, f"{str(path)!r} {what}; pass an export directory or a "
                        "model.safetensors file")
    fd = open_regular(file, field)  # a FIFO or device is refused, never read or waited on
    try:
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= min(MAX_HEADER, size - 8):
                raise ValueError("no header")
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as err:
        raise UserError(field, f"cannot read {file}: {err.strerror or err}") from None
    except (ValueError, RecursionError):  # struct, JSON and UTF-8 errors, absurd nesting
        raise UserError(field, f"{file} is not a safetensors file (no valid header)") from None
    if not isinstance(header, dict):
        raise UserError(field, f"{file} is not a safetensors file (header is not a mapping)")
    return file, header, size - 8 - n


def _sizes(value: Any) -> TypeGuard[list[int]]:
    """Whether ``value`` is a JSON list of whole numbers >= 0 (not booleans)."""
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)


def _entry(name: str, info: Any) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry.

    Raises:
        ValueError: What makes the entry one safetensors refuses.
    """
    if not isinstance(info, dict):
        raise ValueError("its entry is not a mapping")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"its dtype {dtype!r} is none safetensors reads "
                         f"({', '.join(DTYPE_BYTES)})")
    if not _sizes(shape):
        raise ValueError(f"its shape {shape!r} is not a list of sizes")
    if not _sizes(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise ValueError(f"its data_offsets {offsets!r} are not [begin, end]")
    need = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != need:
        raise ValueError(f"it spans {offsets[1] - offsets[0]} bytes where shape {shape} of "
                         f"{dtype} needs {need}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_layout(field: str, file: Path, spans: list[tuple[int, int, str]], body: int) -> None:
    """The tensors tile the data from byte 0 to the file's end, in offset order."""
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            how = "overlaps the tensor before it" if begin < pos else f"leaves a gap at byte {pos}"
            raise UserError(field, f"{file} is not a valid safetensors file (tensor {name!r} "
                            f"{how}); re-export it")
        pos = end
    if pos != body:
        how = (f"{body - pos} trailing bytes after its last tensor" if pos < body else
               f"tensors reach byte {pos} of {body} (the file is cut short)")
        raise UserError(field, f"{file} is not a valid safetensors file ({how}); re-export it "
                        "or copy it again")


#: The dtypes of floating-point tensors (weights): what a model's floating parameter can load.
FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ", "F16", "BF16",
                          "F32", "F64"})


def read_header(field: str, path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from a safetensors file's header (see :func:`read_entries`)."""
    return {name: shape for name, (_dtype, shape) in read_entries(field, path).items()}


def read_entries(field: str, path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's dtype and shape from a safetensors file's header, after the library's checks.

    Args:
        field: The setting that names the file (for the error).
        path: A ``.safetensors`` file or a directory holding ``model.safetensors``.

    Raises:
        UserError: Naming ``field`` when the file is missing, unreadable, not a regular file or
            not one the safetensors library would load (see the module docstring).
    """
    file, header, body = _raw_header(field, path)
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(
                    isinstance(v, str) for v in info.values()):
                raise UserError(field, f"{file} is not a valid safetensors file (__metadata__ "
                                "must map names to strings); re-export it")
            continue
        try:
            dtype, shape, begin, end = _entry(name, info)
        except ValueError as err:
            raise UserError(field, f"{file} is not a valid safetensors file (tensor {name!r}: "
                            f"{err}); re-export it") from None
        shapes[name] = (dtype, shape)
        spans.append((begin, end, name))
    _check_layout(field, file, spans, body)
    return shapes
