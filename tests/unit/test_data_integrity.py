"""Dataset checksums are checked where it is cheap; a lying index is one line, not a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kfp_nvrx.components.data.prepare import prepare_dataset
from kfp_nvrx.components.data.shards import (
    SplitTokens,
    check_checksums,
    read_index,
    verify_checksums,
)
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.export.evaluate import check_dataset
from kfp_nvrx.components.training.trainer.bootstrap import validate_inputs
from kfp_nvrx.components.training.trainer.data import TokenDataset


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    prepare_dataset("sample:200", out, seq_len=64)
    return out


def _tamper(path: Path) -> None:
    """Flip one byte, keeping the size (what a size check cannot see)."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_prepare_data_rebuilds_a_tampered_dataset_instead_of_reusing_it(data: Path) -> None:
    assert prepare_dataset("sample:200", data, seq_len=64)["status"] == "skipped"
    _tamper(next(data.glob("train_*.bin")))
    assert verify_checksums(data)
    assert prepare_dataset("sample:200", data, seq_len=64)["status"] == "written"
    assert verify_checksums(data) == []


def test_launcher_refuses_a_tampered_training_split(data: Path) -> None:
    validate_inputs("tiny", [f"data.path={data}"], [], verify_data=True)
    _tamper(next(data.glob("train_*.bin")))
    with pytest.raises(UserError) as err:
        validate_inputs("tiny", [f"data.path={data}"], [], verify_data=True)
    assert err.value.field == "data.path" and "sha256" in err.value.message


def test_export_eval_refuses_a_tampered_val_split(data: Path) -> None:
    check_dataset(data, 256, 64)
    _tamper(next(data.glob("val_*.bin")))
    with pytest.raises(UserError) as err:
        check_dataset(data, 256, 64)
    assert err.value.field == "data"


def test_large_splits_are_not_read_in_full(data: Path) -> None:
    _tamper(next(data.glob("train_*.bin")))
    assert check_checksums(data, read_index(data), ["train"], "data.path", limit_bytes=10) is False


@pytest.mark.parametrize("change", [
    {"dtype": "float32"}, {"dtype": "bogus"}, {"dtype": "uint16"}, {"vocab_size": 70000},
    {"vocab_size": "many"}, {"splits": {"train": {"tokens": 5, "shards": [
        {"file": "../../etc/passwd", "tokens": 5, "sha256": "x"}]}}},
])
def test_a_lying_index_is_one_line_for_every_reader(change: dict, data: Path) -> None:
    index = json.loads((data / "index.json").read_text())
    (data / "index.json").write_text(json.dumps({**index, **change}))
    for read in (lambda: TokenDataset(str(data)), lambda: SplitTokens(data, "val"),
                 lambda: check_dataset(data, 70000, 64)):
        with pytest.raises(UserError) as err:
            read()
        assert "\n" not in err.value.one_line()


def test_binary_index_is_one_line(data: Path) -> None:
    (data / "index.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UserError):
        TokenDataset(str(data))
    assert os.path.exists(data / "index.json")
