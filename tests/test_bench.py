"""The benchmark package on a CPU machine: projection maths, report from recorded JSON, CUDA check.

No timing is asserted anywhere: the benchmarks themselves only run on a GPU (``make bench``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.projection import best_interval, goodput, job_mtbf_s, young_daly
from bench.summary import build_report

RECORDED = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
ISSUE_KEYS = ("stall_over_d2h_floor", "torch_save_over_stall", "stager_over_stall",
              "dcp_async_over_stall", "overhead_pct", "recovery_inprocess_s", "recovery_injob_s",
              "ckpt_load_over_disk_read", "mfu_1b", "mfu_125m")


@pytest.mark.parametrize("delta", [0.3, 10.0, 60.0])
def test_numeric_optimum_matches_young_daly(delta):
    mtbf = job_mtbf_s(16, 30)
    tau, best = best_interval(delta, 20.0, mtbf)
    assert tau == pytest.approx(young_daly(delta, mtbf), rel=0.05)
    assert all(goodput(t, delta, 20.0, mtbf) <= best + 1e-12 for t in (tau / 3, tau * 3, 60, 3600))
    assert 0 < best < 1


def test_cheaper_checkpoints_keep_more_goodput():
    mtbf = job_mtbf_s(16, 30)
    assert best_interval(0.5, 20, mtbf)[1] > best_interval(20, 20, mtbf)[1]
    assert goodput(1800, 0.5, 20, mtbf) > goodput(1800, 0.5, 600, mtbf)


def test_report_from_recorded_json_has_every_issue_key(tmp_path):
    for f in RECORDED.glob("*.json"):
        if f.name != "summary.json":
            shutil.copy(f, tmp_path / f.name)
    if not (tmp_path / "ckpt_stall.json").exists():
        pytest.skip("no recorded benchmark JSON in docs/benchmarks")
    summary = build_report(tmp_path)
    for key in ISSUE_KEYS:
        assert isinstance(summary[key], float), key
    assert summary["machine"]["gpu"] and summary["machine"]["nvidia_resiliency_ext"]
    text = (tmp_path / "README.md").read_text()
    assert "| figure | measured | target | met |" in text
    assert json.loads((tmp_path / "summary.json").read_text())["mfu_1b"] == summary["mfu_1b"]


def test_bench_refuses_without_cuda_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: bench.run would start measuring")
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        "bench: needs a CUDA GPU (torch.cuda.is_available() is False)"
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
