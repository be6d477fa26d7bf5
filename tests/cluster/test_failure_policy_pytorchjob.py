"""Every PyTorchJob row of the failure-handling table (docs/eks.md) on the real Training Operator.

``restartPolicy: ExitCode``: 1..127 fails the job, >= 128 recreates the pod. Jobs and their shell
stand-ins for ft_launcher: :mod:`cluster.policy_jobs`. The pod stopped or lost is worker-0, the
rendezvous host; worker-1 then exits as ft_launcher does when it loses that host, and its
entrypoint makes that 200 at once (the PyTorchJob renders ``KFP_NVRX_PEER_LOST_WAIT_S=0``): the
operator recreates both, and the job succeeds only once both pods ran a second attempt.
"""

from __future__ import annotations

import uuid

import pytest
from harness.kutil import wait_for
from harness.policy_jobs import (
    FT_POD,
    KUBEFLOW,
    ONCE,
    PYTORCHJOB_LABEL,
    WAIT_S,
    create_pytorchjob,
    custom,
    delete,
    get,
    holding,
    lost_node,
    pod_runs,
    pytorchjob_end,
    running_pods,
    stop,
)

pytestmark = [pytest.mark.timeout(600)]


def _name(what: str) -> str:
    return f"pol-pj{what}-{uuid.uuid4().hex[:4]}"


@pytest.mark.parametrize("body,want", [("exit 1", "Failed"), ("exit 93", "Failed"),
                                       (ONCE + "kill -9 $$$$", "Succeeded")])
def test_pytorchjob_exit_code_policy(kube, body, want):
    """ExitCode: 1..127 fails the job; a signal (137) recreates the pod, which then succeeds."""
    name = _name("")
    create_pytorchjob(kube, name, body)
    assert pytorchjob_end(kube, name)[0] == want
    delete(kube, KUBEFLOW, "pytorchjobs", name)


@pytest.mark.parametrize("how", ["evict", "delete"])
def test_pytorchjob_stopped_rendezvous_host_recreates_both(kube, how):
    """worker-0 stopped: 143 (not ft_launcher's 1 on SIGTERM); worker-1 loses its rendezvous
    host: 200 (not ft_launcher's 1). Both are recreated and the job succeeds."""
    name = _name(how)
    create_pytorchjob(kube, name, FT_POD)
    pods = running_pods(kube, f"{PYTORCHJOB_LABEL}={name}")
    holding(kube, name)
    stop(kube, pods[0], how)  # worker-0
    assert pytorchjob_end(kube, name)[0] == "Succeeded"
    assert pod_runs(kube, f"{name}-worker-") == {f"{name}-worker-0": 2, f"{name}-worker-1": 2}
    delete(kube, KUBEFLOW, "pytorchjobs", name)


def test_pytorchjob_lost_node_recreates_its_pod(kube):
    """worker-0's machine is lost and its Node deleted: PodGC fails the pod (no exit code: the
    operator retries it), worker-1 loses its rendezvous host (200); both run again."""
    name = _name("node")
    create_pytorchjob(kube, name, FT_POD)
    pods = running_pods(kube, f"{PYTORCHJOB_LABEL}={name}")
    holding(kube, name)
    with lost_node(kube, pods[0]):
        assert pytorchjob_end(kube, name)[0] == "Succeeded"
    assert pod_runs(kube, f"{name}-worker-") == {f"{name}-worker-0": 2, f"{name}-worker-1": 2}
    delete(kube, KUBEFLOW, "pytorchjobs", name)


def test_pytorchjob_recreations_are_bounded_by_the_deadline_only(kube):
    """Every attempt is killed (137): the operator recreates the pods past ``backoffLimit`` (it
    counts container restarts, which ExitCode pods never have); ``activeDeadlineSeconds`` ends
    the job."""
    name = _name("always")
    create_pytorchjob(kube, name, "kill -9 $$$$", backoff_limit=1, active_deadline_s=None)
    worker1 = f"{name}-worker-1"
    runs = wait_for(f"{worker1} recreated past backoffLimit 1",
                    lambda: pod_runs(kube, worker1).get(worker1, 0) >= 3, WAIT_S)
    assert runs
    status = get(kube, KUBEFLOW, "pytorchjobs", name).get("status") or {}
    assert not [c for c in status.get("conditions", []) if c["type"] == "Failed"
                and c["status"] == "True"], status
    custom(kube).patch_namespaced_custom_object(*KUBEFLOW, kube.namespace, "pytorchjobs", name,
                                                {"spec": {"runPolicy": {
                                                    "activeDeadlineSeconds": 1}}})
    outcome, cond = pytorchjob_end(kube, name)
    assert outcome == "Failed" and "deadline" in cond["message"], cond
    delete(kube, KUBEFLOW, "pytorchjobs", name)
