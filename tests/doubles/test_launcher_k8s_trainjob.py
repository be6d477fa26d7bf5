"""The TrainJob (Kubeflow Trainer v2) launcher against the HTTP test double (tests/support/k8s_double.py).

Each test plays the Trainer/JobSet controllers and the kubelet in a thread: node pods named as the
Job controller names them, a pod the Job controller recreates under a new name, a whole-JobSet
restart, ``Complete``/``Failed`` conditions.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
from support import k8s_launch
from support.k8s_double import K8sDouble
from support.k8s_launch import SPEC, Script, launch_on, on_double, playing, trainer_started

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch import backends
from kfp_nvrx.components.launch.cluster_launch import pick
from kfp_nvrx.components.launch.jobspec.resolve import resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.kube.calls import ClusterError
from kfp_nvrx.components.launch.kube.cluster import api_client
from kfp_nvrx.components.launch.trainjob.render import render

TRAINJOBS = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs"


def _run(double: K8sDouble, spec: JobSpec, script: Script, **opts):
    lines: list[str] = []
    with playing(double, spec, script):
        result = launch_on(double, spec, "trainjob", log=lines.append, **opts)
    return result, lines


def _happy(d: K8sDouble, name: str, run_dir: Path | None = None) -> None:
    d.set_condition(name, "Created", reason="Created", message="TrainJob is created")
    n0 = d.add_node_pod(name, 0)
    d.start(n0)
    trainer_started(run_dir, 0)
    d.log(n0, "[trainer] start: world_size=2 incarnation=0.0", "[trainer] step 2/6 loss 5.0")
    time.sleep(0.3)
    n1 = d.add_node_pod(name, 1)
    d.start(n1)
    d.log(n1, "agent 1 up")
    d.terminate(n1, 137, "OOMKilled")  # podFailurePolicy Ignore: the Job controller replaces it
    n1b = d.add_node_pod(name, 1)
    d.start(n1b)
    d.log(n1b, "agent 1 back")
    trainer_started(run_dir, 1)  # ft_launcher restarted the workers: the trainer says so
    d.log(n0, "[trainer] start: world_size=2 incarnation=1.0", "[trainer] step 6/6 loss 3.0")
    time.sleep(0.3)
    d.terminate(n0, 0)
    d.terminate(n1b, 0)
    d.set_condition(name, "Complete", reason="JobSetCompleted", message="jobset completed")


def test_create_follow_every_node_pod_then_delete(double: K8sDouble, tmp_path: Path) -> None:
    # The shared volume is mounted here too (as in the KFP task): the run's events are readable.
    spec = JobSpec(**SPEC, mount=str(tmp_path))
    run_dir = Path(resolve(spec).run_dir)
    result, lines = _run(double, spec, functools.partial(_happy, run_dir=run_dir))
    assert result.state == "Succeeded" and result.extra["job_api"] == "trainjob"
    posts = double.calls("POST")
    assert len(posts) == 1 and posts[0]["path"] == TRAINJOBS
    expected = render(resolve(spec)).to_dict()
    expected["metadata"]["namespace"] = "default"
    assert posts[0]["body"] == expected
    text = "\n".join(lines)
    assert "[node-0] [trainer] step 2/6 loss 5.0" in text
    assert "[node-1] agent 1 up" in text
    assert "[node-1] agent 1 back" in text  # the replacement pod (new name) is streamed too
    assert result.restarts == 1
    # Background: Trainer v2.3 re-applies the JobSet of a TrainJob in foreground deletion.
    delete = k8s_launch.assert_deleted_foreground(double, "Background")
    assert delete["path"] == f"{TRAINJOBS}/{resolve(spec).name}"


def test_reattach_by_name_never_creates_a_second(double: K8sDouble) -> None:
    spec = JobSpec(**SPEC)
    name = resolve(spec).name
    double.put_job(render(resolve(spec)).to_dict())
    n0 = double.add_node_pod(name, 0)
    double.start(n0)
    double.log(n0, "[trainer] step 3/6 loss 4.2")
    result, lines = _run(double, spec, k8s_launch.finish_later(n0, "Complete", after_s=0.4),
                         delete_after="never")
    k8s_launch.assert_reattached(result, double)
    assert any("re-attaching to TrainJob default/" in ln for ln in lines)


def test_another_runs_trainjob_is_refused_untouched(double: K8sDouble) -> None:
    other = render(resolve(JobSpec(**{**SPEC, "run_id": "someone-else", "name": "clash"}))).to_dict()
    double.put_job(other)
    with pytest.raises(UserError) as err:
        launch_on(double, JobSpec(**{**SPEC, "name": "clash"}), "trainjob")
    assert err.value.field == "name" and "someone-else" in err.value.message
    k8s_launch.assert_untouched(double)


def test_failed_trainjob_reason_and_failing_node_tail(double: K8sDouble) -> None:
    def fail(d: K8sDouble, name: str) -> None:
        n0, n1 = d.add_node_pod(name, 0), d.add_node_pod(name, 1, attempt=2)
        d.start(n0)
        d.start(n1)
        d.log(n1, "ft_launcher: no attempts left", "RuntimeError: CUDA error: unspecified")
        time.sleep(0.3)
        d.terminate(n1, 1)
        d.set_condition(name, "Failed", reason="JobSetFailed",
                        message="jobset failed: failurePolicy maxRestarts 2 reached")

    result, _ = _run(double, JobSpec(**SPEC), fail)
    assert result.state == "Failed"
    assert result.reason.startswith("JobSetFailed: jobset failed: failurePolicy maxRestarts")
    assert "node-1/a2 exited with code 1" in result.reason
    assert result.last_log_lines[-1] == "RuntimeError: CUDA error: unspecified"
    assert not double.calls("DELETE")  # kept for inspection (on_success)


def test_deadline_is_active_deadline_plus_margin_or_given(double: K8sDouble) -> None:
    def run_forever(d: K8sDouble, name: str) -> None:
        d.start(d.add_node_pod(name, 0))

    result, _ = _run(double, JobSpec(**SPEC), run_forever, deadline_s=1.5)
    assert result.state == "DeadlineExceeded" and "1.5s" in result.reason
    assert len(double.calls("DELETE")) == 1


def test_sigterm_deletes_the_trainjob(double: K8sDouble) -> None:
    before = signal.getsignal(signal.SIGTERM)
    spec = JobSpec(**SPEC)

    def running_then_sigterm(d: K8sDouble, name: str) -> None:
        d.start(d.add_node_pod(name, 0))
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)

    result, _ = _run(double, spec, running_then_sigterm, handle_signals=True)
    assert result.state == "Cancelled" and result.extra["signal"] == signal.SIGTERM
    k8s_launch.assert_deleted_foreground(double, "Background")
    assert ("default", resolve(spec).name) not in double.jobs
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("served,expected", [({"pytorchjobs", "trainjobs"}, "trainjob"),
                                             ({"trainjobs"}, "trainjob"),
                                             ({"pytorchjobs"}, "pytorchjob")])
def test_auto_asks_the_cluster_and_prefers_trainjob(double: K8sDouble, served: set,
                                                    expected: str) -> None:
    double.served = served
    assert pick("auto", api_client(double.configuration())) == expected
    assert double.calls("GET", "/apis/trainer.kubeflow.org/v1alpha1")


def test_auto_with_neither_is_a_cluster_error(double: K8sDouble) -> None:
    double.served = set()
    with pytest.raises(ClusterError, match="neither trainjobs"):
        pick("auto", api_client(double.configuration()))


def test_dispatcher_auto_runs_a_trainjob(double: K8sDouble) -> None:
    spec = JobSpec(**SPEC)
    with playing(double, spec, _happy):
        result = launch_on(double, spec, "auto", log=lambda _: None, poll_s=0.05)
    assert result.succeeded
    assert [c["path"] for c in double.calls("POST")] == [TRAINJOBS]


def test_cluster_runtime_reference_reaches_the_api(double: K8sDouble) -> None:
    spec = JobSpec(**SPEC)
    lines: list[str] = []
    with playing(double, spec, _happy):
        opts = replace(on_double(double, "trainjob", poll_s=0.05), runtime="ft-shared",
                       runtime_kind="ClusterTrainingRuntime")
        result = backends.launch(resolve(spec), opts, log=lines.append)
    assert result.succeeded
    (post,) = double.calls("POST")
    assert post["body"]["spec"]["runtimeRef"] == {
        "name": "ft-shared", "kind": "ClusterTrainingRuntime", "apiGroup": "trainer.kubeflow.org"}
    assert any("runtime ClusterTrainingRuntime/ft-shared" in ln for ln in lines)


def test_auto_reports_input_bad_for_every_api_before_asking_the_cluster(
        double: K8sDouble) -> None:
    with pytest.raises(UserError) as err:
        launch_on(double, JobSpec(**{**SPEC, "instance_type": "p9.huge"}), "auto")
    assert err.value.field == "instance_type"
    assert double.requests == []  # not even API discovery


def test_auto_refuses_what_the_served_api_cannot_express(double: K8sDouble) -> None:
    double.served = {"trainjobs"}
    with pytest.raises(UserError) as err:
        launch_on(double, JobSpec(**{**SPEC, "nodes": "1:2"}), "auto")
    assert err.value.field == "nodes"
    assert double.calls("GET", "/apis/") and not double.calls("POST")


def test_bad_v2_input_sends_nothing(double: K8sDouble) -> None:
    with pytest.raises(UserError) as err:
        launch_on(double, JobSpec(**{**SPEC, "nodes": "2:4"}), "trainjob")
    assert err.value.field == "nodes"
    assert not double.calls("POST")
