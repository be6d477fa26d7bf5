"""Issue 38 item 7: a used-up restart budget is blamed on the pod that said so, not its peer.

With ``max_restarts=1`` and two faults, rank 0 (worker-0) prints the job's verdict and stops its
agent; its pod exits only once the agent has stopped. Meanwhile worker-1 loses the gone
rendezvous store, fails with a c10d timeout first and ends the job: the launcher named worker-1
and showed the timeout. HTTP double of the API server (tests/support/k8s_double.py).
"""

from __future__ import annotations

import time

from support.k8s_double import K8sDouble
from support.k8s_launch import SPEC, launch_on, playing

from kfp_nvrx.components.core.exits import BUDGET_SPENT
from kfp_nvrx.components.launch.jobspec.spec import JobSpec

VERDICT = (f"{BUDGET_SPENT} (2 in-job restarts > resilience.max_restarts=1); gave up: set "
           "resilience.max_restarts higher to allow more")


def _budget_spent(d: K8sDouble, name: str, *, verdict_pod_exits: bool) -> None:
    w0, w1 = d.add_pod(name, 0), d.add_pod(name, 1)
    d.start(w0)
    d.start(w1)
    d.set_condition(name, "Running")
    d.log(w0, "[trainer] step 4/6 loss 5.0", VERDICT)
    time.sleep(0.5)
    d.log(w1, "torch.distributed.DistStoreError: wait timeout after 30000ms, keys: /c10d",
          "Some rank(s) exited with non-zero exit code")
    d.terminate(w1, 1, "Error")  # first out: the store it waited on is gone
    time.sleep(0.3)
    if verdict_pod_exits:
        d.terminate(w0, 1, "Error")
    d.set_condition(name, "Failed", "BackoffLimitExceeded", "worker-1 failed")


def test_the_pod_whose_trainer_gave_up_is_named_though_its_peer_failed_first(
        double: K8sDouble) -> None:
    spec = JobSpec(**SPEC)
    with playing(double, spec, lambda d, n: _budget_spent(d, n, verdict_pod_exits=True)):
        result = launch_on(double, spec, log=lambda _l: None)
    assert result.state == "Failed"
    assert result.extra["failed_replica"] == "worker-0", result.reason
    assert "worker-0 exited with code 1" in result.reason
    assert any(BUDGET_SPENT in line for line in result.last_log_lines)
    assert not any("DistStoreError" in line for line in result.last_log_lines)


def test_a_verdict_whose_pod_has_not_exited_yet_is_named_with_its_words(
        double: K8sDouble) -> None:
    spec = JobSpec(**SPEC)
    with playing(double, spec, lambda d, n: _budget_spent(d, n, verdict_pod_exits=False)):
        result = launch_on(double, spec, log=lambda _l: None)
    assert result.extra["failed_replica"] == "worker-0", result.reason
    assert "(worker-0: the job's in-job restarts are used up" in result.reason, result.reason


def test_a_pods_exit_has_the_job_read_soon_not_at_the_next_poll(double: K8sDouble) -> None:
    """Issue 38 item 7: after the verdict's pod exits the job fails within seconds; the launcher
    read it only at its next poll (5 s by default, 30 s here): it reads every second for a while
    after a pod's exit."""
    spec = JobSpec(**SPEC)
    failed_at: list[float] = []

    def script(d: K8sDouble, name: str) -> None:
        w0, w1 = d.add_pod(name, 0), d.add_pod(name, 1)
        d.start(w0)
        d.start(w1)
        d.set_condition(name, "Running")
        time.sleep(2.0)  # the launcher's first reads are done: it waits out its 30 s poll
        d.log(w0, VERDICT)
        d.terminate(w0, 1, "Error")
        time.sleep(1.5)  # the controllers' reactions
        d.set_condition(name, "Failed", "BackoffLimitExceeded", "worker-0 failed")
        failed_at.append(time.monotonic())

    with playing(double, spec, script):
        result = launch_on(double, spec, log=lambda _l: None, poll_s=30.0, progress_s=1e9)
    took = time.monotonic() - failed_at[0]
    assert result.state == "Failed" and result.extra["failed_replica"] == "worker-0"
    assert took < 5.0, took
