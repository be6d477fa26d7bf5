"""Running the shipped trainer as a user would, and reading its ``events.jsonl`` back.

Two ways: ``direct`` (one ``python -m kfp_nvrx.components.training.trainer`` process with the
torchrun environment, no NVRx launcher) and ``ft`` (``launch-local``'s :func:`run_local`: one
``ft_launcher`` agent per local node, the same command line a PyTorchJob pod runs; ``nodes``
agents of one GPU each, ``CUDA_VISIBLE_DEVICES`` sliced per node as pods see theirs). A
multi-GPU run is always ``ft``. Launcher output lines are kept with the wall time they arrived,
so detection can be timed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import SAFE_ENV, log, median, single_process_env

TRAINER = "kfp_nvrx.components.training.trainer"


@dataclass(frozen=True)
class Training:
    """What a bench run trains: a preset with overrides and faults, on ``nodes`` one-GPU agents."""

    preset: str
    overrides: list[str]
    faults: list[str] = field(default_factory=list)
    nodes: int = 1


def run_trainer(mode: str, training: Training, run_dir: Path,
                timeout: float = 300) -> dict[str, Any]:
    """Runs one training job to the end; returns state, wall seconds, events and log lines."""
    from kfp_nvrx.components.core.events import read_events

    preset, overrides, nodes = training.preset, training.overrides, training.nodes
    shutil.rmtree(run_dir, ignore_errors=True)
    faults = list(training.faults)
    lines: list[tuple[float, str]] = []
    t0 = time.time()
    if mode == "direct" and nodes == 1:
        argv = [sys.executable, "-m", TRAINER, "--config", preset, "--run-dir", str(run_dir)]
        for o in overrides:
            argv += ["--set", o]
        for f in faults:
            argv += ["--fault", f]
        env = {**os.environ, **SAFE_ENV, **single_process_env(), "PYTHONUNBUFFERED": "1"}
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
            state = "Succeeded" if proc.returncode == 0 else f"Failed (exit {proc.returncode})"
            lines = [(time.time(), ln) for ln in (proc.stdout + proc.stderr).splitlines()]
        except subprocess.TimeoutExpired as err:
            state = "DeadlineExceeded"
            lines = [(time.time(), ln) for ln in str(err.stdout or "").splitlines()]
    else:
        from kfp_nvrx.components.launch.jobspec.resolve import LOCAL, resolve
        from kfp_nvrx.components.launch.jobspec.spec import JobSpec
        from kfp_nvrx.components.launch.local.run import LocalRun

        spec = JobSpec(run_dir=str(run_dir), config=preset, overrides=list(overrides),
                       faults=list(faults), env=dict(SAFE_ENV), nodes=str(nodes),
                       nproc_per_node=1)
        res = LocalRun(resolve(spec, LOCAL), deadline_s=timeout, verbose=True,
                       log=lambda ln: lines.append((time.time(), ln))).run()
        state = res.state if res.state == "Succeeded" else f"{res.state}: {res.reason}"
    wall = time.time() - t0
    if not state.startswith("Succeeded"):
        log(f"{mode} {preset} x{nodes} {faults}: {state}")
        for _, ln in lines[-15:]:
            log(f"   {ln}")
    # The benches read the events in their on-disk form (their reports quote its fields).
    events = [e.to_dict() for e in read_events(run_dir)]
    return {"state": state, "wall_s": wall, "events": events, "lines": lines}


def step_times(events: list[dict[str, Any]], skip: int) -> list[float]:
    """Durations of the steps after the first ``skip`` (warm-up, compile)."""
    steps = [e for e in events if e["type"] == "step"]
    return [e["end"] - e["start"] for e in steps[skip:]]


def step_summary(events: list[dict[str, Any]], skip: int, tokens_per_step: int) -> dict[str, Any]:
    """Median/mean step time and tokens/s over the steady-state steps (``tokens_per_step``: all
    ranks together)."""
    times = step_times(events, skip)
    med = median(times)
    steps = [e for e in events if e["type"] == "step"][skip:]
    span = steps[-1]["end"] - steps[0]["start"] if steps else 0.0
    return {"steps_timed": len(times), "step_median_s": med,
            "step_mean_s": sum(times) / len(times) if times else 0.0,
            "wall_per_step_s": span / len(steps) if steps else 0.0,
            "tokens_per_s": tokens_per_step / med if med else 0.0}
