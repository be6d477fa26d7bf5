"""Shared helpers of the end-to-end tests that train the tiny preset through launch-local.

Real ft_launcher agents, gloo, 2 local nodes x 1 process by default: the runs the resume, the
one-fault-one-restart and the stop-save tests compare bitwise with a fault-free reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kfp_nvrx.components.core.rundir import committed_steps, step_dir
from kfp_nvrx.components.launch.jobspec.resolve import LOCAL, resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.local.run import LocalRun
from kfp_nvrx.components.launch.result import LaunchResult
from kfp_nvrx.components.training.export.consolidate import load_model_state


def run_local(spec: JobSpec, **kwargs: Any) -> LaunchResult:
    """``spec`` resolved for the local backend and run (``kwargs``: :class:`LocalRun`'s)."""
    return LocalRun(resolve(spec, LOCAL), **kwargs).run()


def tiny_dataset(root: Path) -> str:
    """A small token dataset of the sample corpus (no downloads), 64-token sequences."""
    from kfp_nvrx.components.data.prepare import prepare_dataset

    out = root / "sample"
    prepare_dataset("sample:400", out, seq_len=64)
    return str(out)


def train(run_dir: Path, dataset: str, overrides: Sequence[str], *, faults: Sequence[str] = (),
          nodes: str = "2", deadline_s: float = 480):
    """One launch-local run of the tiny preset on ``dataset``, which must end Succeeded."""
    spec = JobSpec(nodes=nodes, run_dir=str(run_dir), config="tiny", faults=list(faults),
                   overrides=[f"data.path={dataset}", *overrides])
    res = run_local(spec, log=lambda _line: None, deadline_s=deadline_s)
    assert res.state == "Succeeded", (res.reason, res.last_log_lines)
    return res


def final_weights(run_dir: Path, steps: int) -> dict[str, torch.Tensor]:
    """The model weights of the run's final checkpoint (which must be step ``steps``)."""
    root = run_dir / "checkpoints"
    assert committed_steps(root)[0] == steps
    return load_model_state(step_dir(root, steps))


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Both hold the same tensors, bit for bit."""
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"
