"""The right pod blamed (issue 30 item 4): the replica whose exit decided the failure, with its
own last lines.

On a PyTorchJob give-up, worker-1's ft_launcher exits 1 (it gave up: the job fails), while
worker-0, having lost its peer, exits 200 first and is recreated by the operator under the same
name. The report named worker-0 (the earliest non-zero exit) and showed the start-up lines of the
*recreated* worker-0.
"""

from __future__ import annotations

import datetime as dt

from kubernetes import client as k8s

from kfp_nvrx.components.launch.kube.job_run import fill_failure
from kfp_nvrx.components.launch.kube.logs import PodLogFollower
from kfp_nvrx.components.launch.pytorchjob.follow import job_pods
from kfp_nvrx.components.launch.result import LaunchResult


def _pod(index: int, uid: str, exit_code: int | None, finished: float) -> k8s.V1Pod:
    terminated = None if exit_code is None else k8s.V1ContainerStateTerminated(
        exit_code=exit_code, finished_at=dt.datetime.fromtimestamp(finished, dt.timezone.utc))
    status = k8s.V1ContainerStatus(
        name="pytorch", image="i", image_id="", ready=False, restart_count=0,
        state=k8s.V1ContainerState(terminated=terminated, running=None if terminated else
                                   k8s.V1ContainerStateRunning()))
    labels = {"training.kubeflow.org/replica-type": "worker",
              "training.kubeflow.org/replica-index": str(index)}
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=f"pj-worker-{index}", uid=uid, labels=labels),
                     status=k8s.V1PodStatus(phase="Failed" if terminated else "Running",
                                            container_statuses=[status]))


class _Follower(PodLogFollower):
    """The follower's bookkeeping without log streams (the lines are fed by the test)."""

    def __init__(self) -> None:
        super().__init__(None, "ns", job_pods("pj"), emit=lambda _line: None)
        self._stop.set()  # no stream threads: _on_pod records the pod and returns

    def lines(self, index: int, uid: str, *lines: str) -> None:
        state = self.pods[f"pj-worker-{index}"]
        for line in lines:
            self._line(state, uid, state.replica, line)


def test_the_pod_that_gave_up_is_blamed_with_its_own_lines() -> None:
    f = _Follower()
    f._on_pod(_pod(0, "w0-a", None, 0))
    f._on_pod(_pod(1, "w1-a", None, 0))
    f.lines(0, "w0-a", "[trainer] step 8/24", "RendezvousClosedError", "pod_entry: peer lost")
    f.lines(1, "w1-a", "[trainer] step 8/24", "injecting fault kill at step 8",
            "Some rank(s) exited with non-zero exit code")
    f._on_pod(_pod(0, "w0-a", 200, 100.0))  # worker-0 lost its peer first: 200
    f._on_pod(_pod(0, "w0-b", None, 0))  # ... and the operator recreated it
    f.lines(0, "w0-b", "[trainer] boot: imports 2.1s", "waiting for the rendezvous")
    f._on_pod(_pod(1, "w1-a", 1, 103.0))  # worker-1's ft_launcher gave up: the verdict
    result = LaunchResult(name="pj", backend="kubernetes", state="Failed",
                          run_dir="/fsx/runs/pj", reason="Failed: PyTorchJob pj is failed")
    fill_failure(result, f, 40)
    assert result.extra["failed_replica"] == "worker-1", result.reason
    assert "(worker-1 exited with code 1" in result.reason and "gave up" in result.reason
    assert result.last_log_lines[-1] == "Some rank(s) exited with non-zero exit code"
    assert not any("boot" in ln or "peer lost" in ln for ln in result.last_log_lines)


def test_among_restartable_exits_the_first_is_blamed_with_that_instances_lines() -> None:
    """No final exit (a JobSet out of restarts): the earliest, and the recreated pod's lines
    are not the failed one's."""
    f = _Follower()
    f._on_pod(_pod(0, "w0-a", None, 0))
    f.lines(0, "w0-a", "killed here")
    f._on_pod(_pod(0, "w0-a", 137, 50.0))
    f._on_pod(_pod(0, "w0-b", None, 0))
    f.lines(0, "w0-b", "the new pod's start")
    blamed = f.failed_pod()
    assert blamed is not None and (blamed.uid, blamed.exit_code) == ("w0-a", 137)
    assert f.last_lines(blamed, 10) == ["killed here"]
