"""The init_from preflight refuses exactly the files the safetensors library refuses (issue 30.14).

Files that passed the old header check (bad offsets, an unknown dtype, trailing bytes) crashed
every worker at its warm start, once per restart. Each hand-made file below is loaded by the real
library too: the preflight refuses it in one line naming the setting, and the library indeed
fails on it, so the preflight stays a faithful copy of the library's own checks.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kfp_nvrx.components.core.safetensors_header import read_header
from kfp_nvrx.components.errors import UserError

FIELD = "checkpoint.init_from"


def _file(path: Path, header: dict, body: int, pad: bytes = b"") -> Path:
    raw = json.dumps(header).encode() + pad
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(body))
    return path


def _t(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


BAD = {  # name -> (header, body bytes, words the line must hold)
    "unknown-dtype": ({"w": _t("F33", [4], 0, 16)}, 16, "dtype 'F33'"),
    "dtype-not-a-string": ({"w": _t(7, [4], 0, 16)}, 16, "dtype 7"),
    "size-not-shape": ({"w": _t("F32", [4], 0, 12)}, 12, "needs 16"),
    "gap-before-first": ({"w": _t("F32", [2], 8, 16)}, 16, "gap at byte 0"),
    "gap-between": ({"a": _t("F32", [2], 0, 8), "b": _t("F32", [2], 12, 20)}, 20, "gap at byte 8"),
    "overlap": ({"a": _t("F32", [2], 0, 8), "b": _t("F32", [2], 4, 12)}, 12, "overlaps"),
    "trailing-bytes": ({"w": _t("F32", [2], 0, 8)}, 12, "4 trailing bytes"),
    "cut-short": ({"w": _t("F32", [4], 0, 16)}, 8, "cut short"),
    "negative-offset": ({"w": _t("F32", [2], -8, 0)}, 8, "data_offsets"),
    "reversed-offsets": ({"w": _t("F32", [0], 8, 0)}, 8, "data_offsets"),
    "bool-shape": ({"w": _t("F32", [True], 0, 4)}, 4, "shape"),
    "float-shape": ({"w": _t("F32", [2.0], 0, 8)}, 8, "shape"),
    "entry-not-a-mapping": ({"w": [0, 8]}, 8, "not a mapping"),
    "metadata-not-strings": ({"__metadata__": {"format": 1}, "w": _t("F32", [1], 0, 4)}, 4,
                             "__metadata__"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_file_the_library_refuses_is_refused_in_one_line(tmp_path: Path, name: str) -> None:
    header, body, says = BAD[name]
    path = _file(tmp_path / f"{name}.safetensors", header, body)
    with pytest.raises(UserError) as err:
        read_header(FIELD, path)
    assert err.value.field == FIELD and says in err.value.message, err.value.message
    assert "\n" not in err.value.one_line()
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever the library raises
        load_file(path)


def test_files_the_library_loads_pass(tmp_path: Path) -> None:
    path = tmp_path / "real.safetensors"
    tensors = {"a": torch.zeros(3, 4), "b": torch.ones(5, dtype=torch.bfloat16),
               "empty": torch.zeros(0), "flag": torch.zeros(2, dtype=torch.bool)}
    save_file(tensors, path, metadata={"format": "pt"})
    assert read_header(FIELD, path) == {k: tuple(v.shape) for k, v in tensors.items()}
    # Hand-made: listed out of offset order, a padded header (the library pads to 8 bytes).
    made = _file(tmp_path / "made.safetensors",
                 {"b": _t("F16", [2], 8, 12), "a": _t("I64", [1], 0, 8)}, 12, pad=b"    ")
    assert read_header(FIELD, made) == {"a": (1,), "b": (2,)}
    assert set(load_file(made)) == {"a", "b"}


def test_a_fifo_or_device_is_refused_not_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.safetensors")  # nobody writes: a plain open would block
    for path, says in ((tmp_path / "pipe.safetensors", "FIFO"), ("/dev/zero", "character")):
        with pytest.raises(UserError) as err:
            read_header(FIELD, path)
        assert err.value.field == FIELD and says in err.value.message
