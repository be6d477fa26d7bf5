"""The Kubernetes launcher against the HTTP test double of the API server (tests/support/k8s_double.py).

No cluster runs here; the double serves the real wire format of the endpoints the launcher calls,
and each test plays the operator/kubelet in a thread (pods appearing late, restarts, failures).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import pytest
from support.k8s_double import K8sDouble
from support.k8s_launch import (
    SPEC,
    Script,
    assert_deleted_foreground,
    assert_reattached,
    assert_untouched,
    finish_later,
    launch_on,
    on_double,
    playing,
    trainer_started,
)

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch import backends
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec.resolve import resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.kube.calls import ClusterError
from kfp_nvrx.components.launch.options import options
from kfp_nvrx.components.launch.pytorchjob.render import render


def _run(double: K8sDouble, spec: JobSpec, script: Script, **opts):
    lines: list[str] = []
    with playing(double, spec, script):
        result = launch_on(double, spec, log=lines.append, **opts)
    return result, lines


def _happy(d: K8sDouble, name: str, run_dir: Path | None = None) -> None:
    d.set_condition(name, "Created")
    w0 = d.add_pod(name, 0)
    d.start(w0)
    d.set_condition(name, "Running")
    trainer_started(run_dir, 0)
    d.log(w0, "[trainer] start: world_size=2 incarnation=0.0", "[trainer] step 2/6 loss 5.0")
    time.sleep(0.4)
    w1 = d.add_pod(name, 1)  # starts late
    d.start(w1)
    d.log(w1, "agent 1 up")
    d.terminate(w1, 137, "OOMKilled")
    d.restart(w1)  # kubelet restart: logged again under worker-1/r1
    d.log(w1, "agent 1 back")
    trainer_started(run_dir, 1)  # ft_launcher restarted the workers: the trainer says so
    d.log(w0, "[trainer] start: world_size=2 incarnation=1.0", "[trainer] step 6/6 loss 3.0")
    time.sleep(0.4)
    d.terminate(w0, 0)
    d.terminate(w1, 0)
    d.set_condition(name, "Succeeded")


def test_create_follow_late_and_restarted_pods_then_delete(double: K8sDouble,
                                                           tmp_path: Path) -> None:
    # The shared volume is mounted here too (as in the KFP task): the run's events are readable.
    spec = JobSpec(**SPEC, mount=str(tmp_path))
    run_dir = Path(resolve(spec).run_dir)
    result, lines = _run(double, spec, functools.partial(_happy, run_dir=run_dir))
    assert result.state == "Succeeded" and result.backend == "kubernetes"
    posts = double.calls("POST")
    assert len(posts) == 1
    expected = render(resolve(spec)).to_dict()
    expected["metadata"]["namespace"] = "default"
    assert posts[0]["body"] == expected
    text = "\n".join(lines)
    assert "[worker-0] [trainer] step 2/6 loss 5.0" in text
    assert "[worker-1] agent 1 up" in text  # a pod that started after the launcher
    assert "[worker-1/r1] agent 1 back" in text  # the restarted container, re-streamed
    assert "progress: step 6/6 (100%), restarts 1" in text
    assert result.restarts == 1 and result.pod_restarts == 1
    assert result.extra["attached"] is False
    assert result.extra["run_dir_uri"] == f"pvc://fsx/runs/{resolve(spec).name}"
    assert_deleted_foreground(double)
    # follow never used a fixed SDK wait: the watch and log endpoints were used
    assert double.calls("GET", "/log") and any(
        r["query"].get("watch") for r in double.calls("GET", "/pods"))


def test_reattach_to_this_runs_job_never_creates_a_second(double: K8sDouble) -> None:
    spec = JobSpec(**SPEC)
    manifest = render(resolve(spec)).to_dict()
    double.put_job(manifest)
    name = resolve(spec).name
    w0 = double.add_pod(name, 0)
    double.start(w0)
    double.set_condition(name, "Running")
    double.log(w0, "[trainer] step 3/6 loss 4.2")
    result, lines = _run(double, spec, finish_later(w0, "Succeeded", after_s=0.5),
                         delete_after="never")
    assert_reattached(result, double)
    assert any("re-attaching" in ln for ln in lines)
    assert "[worker-0] [trainer] step 3/6 loss 4.2" in lines


def test_same_name_from_another_run_is_refused_untouched(double: K8sDouble) -> None:
    other = render(resolve(JobSpec(**SPEC))).to_dict()
    other["metadata"]["annotations"][naming.RUN_ID_KEY] = "someone-else"
    double.put_job(other)
    with pytest.raises(UserError) as err:
        launch_on(double, JobSpec(**SPEC), log=lambda _: None)
    assert err.value.field == "name" and "someone-else" in err.value.message
    assert_untouched(double)


def _fail(d: K8sDouble, name: str) -> None:
    w0, w1 = d.add_pod(name, 0), d.add_pod(name, 1)
    d.start(w0)
    d.start(w1)
    d.set_condition(name, "Running")
    d.log(w0, "[trainer] step 1/6 loss 5.0")
    d.log(w1, "Traceback (most recent call last):", "RuntimeError: CUDA error: an illegal "
          "memory access was encountered")
    time.sleep(0.3)
    d.terminate(w1, 1)
    d.set_condition(name, "Failed", reason="PyTorchJobFailed",
                    message=f"PyTorchJob {name} is failed because 1 Worker replica(s) failed.")


@pytest.mark.parametrize("delete_after,deleted", [("on_success", False), ("always", True),
                                                  ("never", False)])
def test_failed_job_fails_with_reason_and_replica_tail(double: K8sDouble, delete_after: str,
                                                       deleted: bool) -> None:
    result, _ = _run(double, JobSpec(**SPEC), _fail, delete_after=delete_after)
    assert result.state == "Failed" and not result.succeeded
    assert result.reason.startswith("PyTorchJobFailed: PyTorchJob")
    assert "worker-1 exited with code 1" in result.reason
    assert result.extra["failed_replica"] == "worker-1"
    assert result.last_log_lines[-1].startswith("RuntimeError: CUDA error")
    assert bool(double.calls("DELETE")) is deleted


def test_deadline_stops_following_and_deletes(double: K8sDouble) -> None:
    def run_forever(d: K8sDouble, name: str) -> None:
        d.start(d.add_pod(name, 0))
        d.set_condition(name, "Running")

    t0 = time.monotonic()
    result, _ = _run(double, JobSpec(**SPEC), run_forever, deadline_s=1.5)
    assert result.state == "DeadlineExceeded" and "1.5s" in result.reason
    assert time.monotonic() - t0 >= 0.5  # creationTimestamp has 1 s resolution
    assert_deleted_foreground(double)


def test_sigterm_deletes_the_job_foreground_and_restores_handlers(double: K8sDouble) -> None:
    before = signal.getsignal(signal.SIGTERM)
    spec = JobSpec(**SPEC)

    def running_then_sigterm(d: K8sDouble, name: str) -> None:
        w0 = d.add_pod(name, 0)
        d.start(w0)
        d.set_condition(name, "Running")
        d.log(w0, "[trainer] step 1/6 loss 5.0")
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)  # KFP terminating the run

    result, _ = _run(double, spec, running_then_sigterm, handle_signals=True)
    assert result.state == "Cancelled" and result.extra["signal"] == signal.SIGTERM
    assert_deleted_foreground(double)
    assert (("default", resolve(spec).name)) not in double.jobs
    assert signal.getsignal(signal.SIGTERM) is before


def test_pending_reason_and_recreated_pod_are_shown(double: K8sDouble) -> None:
    def script(d: K8sDouble, name: str) -> None:
        w0 = d.add_pod(name, 0)
        d.unschedulable(w0, "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
        time.sleep(0.3)
        d.start(w0)
        d.set_condition(name, "Running")
        d.log(w0, "first pod")
        time.sleep(0.3)
        d.terminate(w0, 143)
        d.recreate(w0)  # the operator replaces a pod killed by a signal (ExitCode policy)
        time.sleep(0.2)
        d.start(w0)
        d.log(w0, "second pod")
        time.sleep(0.3)
        d.terminate(w0, 0)
        d.set_condition(name, "Succeeded")

    result, lines = _run(double, JobSpec(**SPEC), script)
    text = "\n".join(lines)
    assert "not scheduled: Unschedulable: 0/3 nodes are available" in text
    assert "[worker-0] first pod" in text and "[worker-0/p1] second pod" in text
    assert "pod recreated by the operator" in text
    assert result.succeeded and result.pod_restarts == 1


def test_bad_input_sends_nothing(double: K8sDouble) -> None:
    with pytest.raises(UserError) as err:
        launch_on(double, JobSpec(**{**SPEC, "nodes": "3:1"}))
    assert err.value.field == "nodes"
    with pytest.raises(UserError) as err:
        launch_on(double, JobSpec(**SPEC), delete_after="sometimes")
    assert err.value.field == "delete_after"
    assert double.requests == []


def test_forbidden_create_is_a_cluster_error(double: K8sDouble) -> None:
    double.fail_next["POST"] = (403, "Forbidden")
    with pytest.raises(ClusterError, match="HTTP 403.*RBAC"):
        launch_on(double, JobSpec(**SPEC), log=lambda _: None)
    assert not double.jobs


def test_dispatcher_kubernetes_and_unknown_backend(double: K8sDouble) -> None:
    spec = JobSpec(**SPEC)
    with playing(double, spec, _happy):
        result = backends.launch(resolve(spec), on_double(double, poll_s=0.05),
                                 log=lambda _: None)
    assert result.succeeded and result.backend == "kubernetes"
    with pytest.raises(UserError) as err:
        options("slurm")
    assert err.value.field == "backend"
