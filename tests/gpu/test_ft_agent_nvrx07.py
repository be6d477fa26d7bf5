"""The agent on the NVRx it was written for (0.7, the GPU machine's and the image's).

CPU machines install NVRx 0.4.1, where the agent replaces nothing (``tests/unit/test_ft_agent.py``).
Here both replacements must apply to the real modules, and a real in-job restart must go through
them: the restarted agent joins the round its failure opened without NVRx's "waiting for next
round" poll.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.local_runs import run_local, tiny_dataset

from kfp_nvrx.components.core import events as ev
from kfp_nvrx.components.core.events import read_events
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.training.ft_agent import patch_launcher

try:
    from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier as barrier
except ImportError:  # NVRx 0.4.1 (CPU machines)
    barrier = None

pytestmark = pytest.mark.skipif(barrier is None, reason="needs NVRx >= 0.7 (the GPU machine)")


def test_both_replacements_apply_to_the_real_nvrx() -> None:
    from nvidia_resiliency_ext.fault_tolerance import launcher

    assert patch_launcher(launcher, barrier) in (
        ["terminate_mp_processes", "_wait_for_rendezvous_open"],
        ["terminate_mp_processes"],  # the wait was wrapped by an earlier call in this process
    )
    assert hasattr(barrier._RendezvousBarrierState._wait_for_rendezvous_open, "__wrapped__")


def test_an_in_job_restart_skips_the_round_poll_and_starts_warm_on_cuda(tmp_path: Path) -> None:
    """Both halves of issue 37's faster in-job restart on the real NVRx and a GPU: the agent's
    replacements, and workers forked by its zygote (CUDA first touched in the fork)."""
    import torch

    lines: list[str] = []
    data = tiny_dataset(tmp_path / "data")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = JobSpec(nodes="1", run_dir=str(tmp_path / "run"), config="tiny", faults=["kill@6"],
                   overrides=[f"data.path={data}", "train.steps=12", "checkpoint.interval=4",
                              f"train.device={device}", "resilience.warm_start=true"])
    res = run_local(spec, log=lines.append, deadline_s=300)
    assert res.state == "Succeeded", (res.reason, res.last_log_lines)
    events = read_events(tmp_path / "run")
    assert len([e for e in events if isinstance(e, ev.Restart)]) == 1
    boots = [e.boot for e in events if isinstance(e, ev.Start)]
    assert len(boots) == 2 and all("handoff" in b and "imports" not in b for b in boots), boots
    text = "\n".join(lines)
    assert "without NVRx's fixed waits (terminate_mp_processes, _wait_for_rendezvous_open)" in text
    assert "Worker group FAILED" in text  # the restart went through ft_launcher
    assert "waiting for next round" not in text, text[-3000:]
