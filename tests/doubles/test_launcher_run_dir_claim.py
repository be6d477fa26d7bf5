"""Issue 38 item 5, the launcher's part: a run dir another job writes is refused before anything
is created; a claim whose job is gone or ended is taken at once (HTTP double of the API server;
the real control plane: tests/cluster/test_run_dir_claim.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.k8s_double import K8sDouble
from support.k8s_launch import SPEC, launch_on, playing

from kfp_nvrx.components.core.ownership import claim_run_dir
from kfp_nvrx.components.core.run_claim import CLAIM_FILE, Claim, _write, read_claim
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.resolve import resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.pytorchjob.render import render

OTHER = "k8s:default/other-job"


def _other() -> Claim:
    """Another job's claim, renewed now (a module-level one goes stale before its test runs)."""
    return Claim(holder=OTHER, what="job default/other-job", pod="other-job-worker-0")


def _resumed(tmp_path: Path) -> tuple[JobSpec, Path]:
    """A job whose run dir (on the volume mounted here too) is a run dir of ours already."""
    spec = JobSpec(**SPEC, mount=str(tmp_path))
    run_dir = Path(resolve(spec).run_dir)
    claim_run_dir(run_dir)
    return spec, run_dir


def _other_job(double: K8sDouble, condition: str = "") -> None:
    body = render(resolve(JobSpec(**{**SPEC, "run_id": "run-other"}, name="other-job"))).to_dict()
    double.put_job(body)
    if condition:
        double.set_condition("other-job", condition)


def _succeed(d: K8sDouble, name: str) -> None:
    d.set_condition(name, "Running")
    time.sleep(0.2)
    d.set_condition(name, "Succeeded")


def test_a_run_dir_another_live_job_writes_is_refused_before_anything_is_created(
        double: K8sDouble, tmp_path: Path) -> None:
    spec, run_dir = _resumed(tmp_path)
    _other_job(double, "Running")
    _write(run_dir, _other())
    with pytest.raises(UserError) as err:
        launch_on(double, spec, log=lambda _l: None)
    assert err.value.field == "run_dir"
    assert "in use by job default/other-job (pod other-job-worker-0" in err.value.message
    assert double.calls("POST") == []
    assert read_claim(run_dir).holder == OTHER  # untouched


@pytest.mark.parametrize("other", ["gone", "Succeeded", "Failed"])
def test_a_fresh_claim_of_a_job_that_is_gone_or_ended_is_taken_at_once(
        double: K8sDouble, tmp_path: Path, other: str) -> None:
    spec, run_dir = _resumed(tmp_path)
    if other != "gone":
        _other_job(double, other)
    _write(run_dir, _other())
    lines: list[str] = []
    name = resolve(spec).name
    with playing(double, spec, _succeed):
        result = launch_on(double, spec, log=lines.append)
    assert result.state == "Succeeded", lines
    assert any(f"claimed {run_dir} for default/{name}" in line for line in lines), lines
    assert not (run_dir / CLAIM_FILE).exists()  # released when the job ended


def test_the_launcher_holds_the_claim_while_the_job_runs(double: K8sDouble,
                                                        tmp_path: Path) -> None:
    spec, run_dir = _resumed(tmp_path)
    name = resolve(spec).name
    seen: list[dict] = []

    def look(d: K8sDouble, job: str) -> None:
        seen.append(json.loads((run_dir / CLAIM_FILE).read_text()))
        _succeed(d, job)

    with playing(double, spec, look):
        assert launch_on(double, spec, log=lambda _l: None).state == "Succeeded"
    assert seen and seen[0]["holder"] == f"k8s:default/{name}"
