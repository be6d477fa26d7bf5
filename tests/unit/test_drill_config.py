"""``kfp-nvrx drill --config``: the drill's job on a preset of the user's choice.

The bitwise resume of every fault kind is judged on a real model size on CUDA (``--config 125m``);
on the CPU only ``tiny`` runs. The drill places its faults against step-numbered snapshots, so its
overrides must win over a preset's time-based schedule (125m and 1b snapshot every 10 s).
"""

from __future__ import annotations

import pytest

from kfp_nvrx.components.cli.main import main
from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.drills.runner import run_drill
from kfp_nvrx.components.drills.scenarios import (
    BASE_OVERRIDES,
    CONFIGS,
    INTERVAL,
    Placement,
    check_config,
)
from kfp_nvrx.components.errors import UserError


@pytest.mark.parametrize("config", CONFIGS)
def test_every_drill_preset_snapshots_by_the_drills_steps(config: str) -> None:
    cfg = load_config(config, list(BASE_OVERRIDES))
    assert cfg.checkpoint.interval == INTERVAL
    assert cfg.checkpoint.interval_s == 0  # 125m's and 1b's 10 s would place snapshots by time


def test_a_larger_preset_is_refused_on_the_cpu_before_anything_is_made(tmp_path, capsys) -> None:
    out = tmp_path / "drill"
    assert main(["drill", "--config", "125m", "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--config" in err and "--device cuda" in err
    assert not out.exists()


def test_an_unknown_preset_names_the_ones_the_drill_runs(tmp_path, capsys) -> None:
    assert main(["drill", "--config", "8b", "--device", "cpu", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--config" in err and all(c in err for c in CONFIGS)


def test_the_library_refuses_as_the_cli_does(tmp_path) -> None:
    with pytest.raises(UserError, match="CUDA only"):
        run_drill(tmp_path / "d", names=["kill-rank"], config="1b")
    assert not (tmp_path / "d").exists()
    check_config("125m", Placement("cuda", 1))  # what a GPU host runs
