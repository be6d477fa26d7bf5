"""Every list of fault kinds a user reads names all of them (one source: core.faults.KINDS)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kfp_nvrx.components.cli.main import main
from kfp_nvrx.components.core.faults import KINDS

ROOT = Path(__file__).resolve().parents[1]
#: Text that cannot import KINDS (KFP docstrings become the UI's parameter descriptions).
WRITTEN = ["components/train_fsdp/component.py", "pipelines/fsdp_train.py"]


@pytest.mark.parametrize("rel", WRITTEN)
def test_written_lists_name_every_kind(rel: str) -> None:
    text = " ".join((ROOT / rel).read_text().split())  # a list may wrap
    lists = re.findall(r"\(((?:KIND: )?kill, [^)]*)\)", text)
    assert lists, f"{rel} lists no fault kinds any more: drop it from WRITTEN"
    for found in lists:
        assert found.removeprefix("KIND: ").split(", ") == list(KINDS), (rel, found)


def test_the_help_of_launch_local_and_the_trainer_derive_them(capsys, monkeypatch) -> None:
    from kfp_nvrx.components.training.trainer.__main__ import parse_args

    monkeypatch.setenv("COLUMNS", "300")  # argparse wraps at a hyphen (kill-in-ckpt)

    for show in (lambda: main(["launch-local", "--help"]), lambda: parse_args(["--help"])):
        with pytest.raises(SystemExit):
            show()
        assert ", ".join(KINDS) in " ".join(capsys.readouterr().out.split())
