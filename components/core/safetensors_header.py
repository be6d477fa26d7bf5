"""A ``model.safetensors`` checked by its header alone (torch-free, reads a few bytes).

The format: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (plus an optional ``__metadata__``), then
the tensor bytes, whose offsets count from the end of the header.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from kfp_nvrx.components.errors import UserError

#: What the safetensors library itself accepts as a header.
MAX_HEADER = 100_000_000


def weights_file(path: str | Path) -> Path:
    """``path`` itself, or the ``model.safetensors`` inside it when it is a directory (an export)."""
    file = Path(path)
    return file / "model.safetensors" if file.is_dir() else file


def read_header(field: str, path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from a safetensors file's header.

    Args:
        field: The setting that names the file (for the error).
        path: A ``.safetensors`` file or a directory holding ``model.safetensors``.

    Raises:
        UserError: Naming ``field`` when the file is missing, unreadable or not safetensors
            (a bad header, or tensors that reach past the end of the file).
    """
    file = weights_file(path)
    if not file.is_file():
        what = "has no model.safetensors" if Path(path).is_dir() else "does not exist"
        raise UserError(field, f"{str(path)!r} {what}; pass an export directory or a "
                        "model.safetensors file")
    try:
        with file.open("rb") as f:
            size = file.stat().st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= min(MAX_HEADER, size - 8):
                raise ValueError("no header")
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as err:
        raise UserError(field, f"cannot read {file}: {err.strerror or err}") from None
    except ValueError:  # struct, JSON and UTF-8 errors
        raise UserError(field, f"{file} is not a safetensors file (no valid header)") from None
    shapes: dict[str, tuple[int, ...]] = {}
    body = size - 8 - n
    if not isinstance(header, dict):
        raise UserError(field, f"{file} is not a safetensors file (header is not a mapping)")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            ok = isinstance(info["dtype"], str) and 0 <= begin <= end <= body
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise UserError(field, f"{file} is not a complete safetensors file (tensor {name!r} "
                            "has a bad entry or lies past the end of the file)")
        shapes[name] = shape
    return shapes
