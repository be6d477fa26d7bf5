"""The dispatcher's ``local`` backend end to end: a real tiny training run, same result object.

Also checks "one builder": the local agents run the same ft_launcher command line as the pods of
the PyTorchJob rendered from the same JobSpec (only the executable path and --local-addr differ).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.rendering import render_pytorchjob

from kfp_nvrx.components.core.launch_command import FT_LAUNCHER
from kfp_nvrx.components.launch.backends import check, launch
from kfp_nvrx.components.launch.jobspec.pod import POD_ENTRY
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.options import LocalOptions
from kfp_nvrx.components.launch.result import LaunchResult


@pytest.mark.slow
def test_local_backend_runs_a_tiny_job(tmp_path: Path) -> None:
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "prepare-data", "--source",
                    "sample:", "--out", str(data), "--quiet"], check=True, timeout=300)
    run_dir = tmp_path / "run"
    spec = JobSpec(config="tiny", nodes="1", name="local-e2e", run_dir=str(run_dir),
                   overrides=["train.steps=6", "checkpoint.interval=3", f"data.path={data}"])
    lines: list[str] = []
    opts = LocalOptions(deadline_s=300)
    result = launch(check(spec, opts), opts, log=lines.append)

    assert isinstance(result, LaunchResult)
    assert result.state == "Succeeded", (result.reason, result.last_log_lines)
    assert result.backend == "local" and result.name == "local-e2e"
    assert Path(result.run_dir) == run_dir and result.restarts == 0
    committed = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert committed[-1] == "step_00000006"
    assert any("step 6/6" in line for line in lines)

    # One builder: the pod command of the same spec (on a shared volume) is the local one.
    pod_spec = JobSpec(image="img:1", pvc="fsx", instance_type="cpu", nodes="1",
                       name="local-e2e", mount=str(tmp_path), run_dir=str(run_dir),
                       config="tiny", overrides=spec.overrides)
    pod_cmd = render_pytorchjob(pod_spec).to_dict()["spec"]["pytorchReplicaSpecs"]["Worker"]["template"][
        "spec"]["containers"][0]["command"]
    local_cmd = result.extra["command"]

    def strip(cmd: list[str]) -> list[str]:
        return [a for a in cmd[1:] if not a.startswith("--local-addr=")]

    # Pods run ft_launcher under the entrypoint that reports a SIGTERM stop as 143.
    assert pod_cmd[:3] == POD_ENTRY
    pod_cmd = pod_cmd[len(POD_ENTRY):]
    assert Path(local_cmd[0]).name == pod_cmd[0] == FT_LAUNCHER
    assert strip(local_cmd) == strip(pod_cmd)
