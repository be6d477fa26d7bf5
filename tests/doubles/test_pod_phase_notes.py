"""A Succeeded PyTorchJob prints no "pod Failed" lines (issue 30 item 8).

With an ``elasticPolicy`` the Training Operator marks a PyTorchJob Succeeded as soon as one worker
exits 0, and ``cleanPodPolicy: Running`` then stops the workers still running (their exit barrier,
their shutdown): they end 143, phase Failed, and the launcher said ``[worker-0] -- pod Failed``
right above ``PyTorchJob ...: Succeeded`` (seen on the real operator, tests/cluster e2e-pj). A
pod that ends non-zero once training completed is said to be stopped after it, not to fail;
a failure before that, and any failure of a TrainJob (its JobSet succeeds only when every pod
has), is still ``pod Failed``.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import replace

from kubernetes import client as k8s
from support.k8s_double import K8sDouble
from support.k8s_launch import SPEC, launch_on, playing

from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.kube.logs import PodLogFollower
from kfp_nvrx.components.launch.pytorchjob.follow import job_pods


def _pod(index: int, uid: str, phase: str, exit_code: int | None = None) -> k8s.V1Pod:
    terminated = None if exit_code is None else k8s.V1ContainerStateTerminated(
        exit_code=exit_code, finished_at=dt.datetime.now(dt.timezone.utc))
    status = k8s.V1ContainerStatus(
        name="pytorch", image="i", image_id="", ready=False, restart_count=0,
        state=k8s.V1ContainerState(terminated=terminated, running=None if terminated else
                                   k8s.V1ContainerStateRunning()))
    labels = {"training.kubeflow.org/replica-type": "worker",
              "training.kubeflow.org/replica-index": str(index)}
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=f"pj-worker-{index}", uid=uid, labels=labels),
                     status=k8s.V1PodStatus(phase=phase, container_statuses=[status]))


def _follower(**kw) -> tuple[PodLogFollower, list[str]]:
    """A PyTorchJob's pod follower (``kw``: other settings of its :class:`JobPods`)."""
    lines: list[str] = []
    f = PodLogFollower(None, "ns", replace(job_pods("pj"), **kw), emit=lines.append)
    f._stop.set()  # no log streams: _on_pod records the pod and says its notes
    return f, lines


def test_a_pod_stopped_after_another_succeeded_is_no_failure() -> None:
    f, lines = _follower()
    f._on_pod(_pod(0, "w0", "Running"))
    f._on_pod(_pod(1, "w1", "Running"))
    f._on_pod(_pod(1, "w1", "Succeeded", 0))  # the operator: job Succeeded; stops worker-0
    f._on_pod(_pod(0, "w0", "Failed", 143))
    assert "[worker-1] -- pod Succeeded" in lines
    assert "[worker-0] -- pod stopped after training completed (exit 143), not a failure" \
        in lines
    assert not any("pod Failed" in ln for ln in lines), lines


def test_a_failure_before_training_completed_is_said_as_one() -> None:
    f, lines = _follower()
    f._on_pod(_pod(0, "w0", "Running"))
    f._on_pod(_pod(1, "w1-a", "Running"))
    f._on_pod(_pod(1, "w1-a", "Failed", 137))  # killed mid-run: the operator recreates it
    f._on_pod(_pod(1, "w1-b", "Running"))
    f._on_pod(_pod(1, "w1-b", "Succeeded", 0))
    f._on_pod(_pod(0, "w0", "Succeeded", 0))
    assert lines.count("[worker-1] -- pod Failed") == 1
    assert "[worker-1] -- pod recreated by the operator (#2)" in lines


def test_a_trainjob_pod_failing_after_another_succeeded_is_a_failure() -> None:
    """A JobSet succeeds only when every pod has: a node failing then fails or restarts it."""
    f, lines = _follower(first_success_ends_job=False)
    f._on_pod(_pod(0, "n0", "Succeeded", 0))
    f._on_pod(_pod(1, "n1", "Failed", 1))
    assert "[worker-1] -- pod Failed" in lines


def test_a_listing_takes_the_pod_that_succeeded_first() -> None:
    """Re-attached after the end: the LIST shows both pods ended, in no order of time."""
    pods = [_pod(0, "w0", "Failed", 143), _pod(1, "w1", "Succeeded", 0)]

    class Core:
        def list_namespaced_pod(self, *_a, **kw):
            f._stop.set()  # one pass: the listing, then a watch that ends the loop
            if kw.get("watch"):
                raise OSError("no watch here")
            return k8s.V1PodList(items=pods, metadata=k8s.V1ListMeta(resource_version="7"))

    lines: list[str] = []
    f = PodLogFollower(Core(), "ns", job_pods("pj"), emit=lines.append)
    f._watch_loop()
    assert lines[:2] == ["[worker-1] -- pod Succeeded",
                     "[worker-0] -- pod stopped after training completed (exit 143), not a failure"]


def test_a_succeeded_pytorchjob_prints_no_pod_failed_line(double: K8sDouble) -> None:
    """Through the launcher and the API double: the operator's order of events on success."""
    spec = JobSpec(**SPEC)
    lines: list[str] = []

    def play(d: K8sDouble, name: str) -> None:
        d.set_condition(name, "Created")
        w0, w1 = d.add_pod(name, 0), d.add_pod(name, 1)
        d.start(w0)
        d.start(w1)
        d.set_condition(name, "Running")
        d.log(w0, "[trainer] step 6/6 loss 3.0", "[trainer] done: step 6/6")
        d.terminate(w1, 0)  # worker-1's agent finished first
        d.set_condition(name, "Succeeded")  # elasticPolicy: one worker succeeded
        d.terminate(w0, 143)  # cleanPodPolicy Running: worker-0 stopped in its exit barrier
        end = time.monotonic() + 30
        while not any("[worker-0] -- pod stopped" in ln for ln in lines):
            assert time.monotonic() < end, lines
            time.sleep(0.05)

    with playing(double, spec, play):
        result = launch_on(double, spec, log=lines.append, drain_s=30)
    assert result.state == "Succeeded", result.reason
    text = "\n".join(lines)
    assert "pod Failed" not in text, text
    assert "[worker-0] -- pod stopped after training completed (exit 143), not a failure" in text
