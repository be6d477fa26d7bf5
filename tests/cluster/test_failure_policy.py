"""Every TrainJob row of the failure-handling table (docs/eks.md) on the real controllers (21.4).

Jobs and their shell stand-ins for ft_launcher: :mod:`cluster.policy_jobs`. A pod stopped, killed
or lost is node 0's, the one that hosts the rendezvous store, and the other pod reacts as
ft_launcher does when that host vanishes (exit 1 with NVRx's "Agent run ended with exception"):
the entrypoint must not let that 1 read as a verdict. The PyTorchJob rows:
``test_failure_policy_pytorchjob.py``.
"""

from __future__ import annotations

import uuid

import pytest
from harness.kutil import wait_for, wait_runtime_seen
from harness.policy_jobs import (
    FT_POD,
    GAVE_UP,
    HOLD,
    JOBSET,
    JOBSET_LABEL,
    ONCE,
    SURVIVE,
    TRAINER,
    WAIT_S,
    conditions,
    core,
    create_trainjob,
    custom,
    delete,
    get,
    holding,
    job_reasons,
    lost_node,
    per_node,
    running_pods,
    stop,
    trainjob_end,
)

pytestmark = [pytest.mark.timeout(600)]


def _name(what: str) -> str:
    return f"pol-{what}-{uuid.uuid4().hex[:4]}"


def _done(kube, name: str) -> None:
    delete(kube, TRAINER, "trainjobs", name)


@pytest.mark.parametrize("code", [1, 93])
def test_ft_launcher_verdict_fails_the_trainjob_at_once(kube, code):
    """Node 1 gives up (1, NVRx's line) / sees no progress (93); node 0 loses it as a peer and
    exits 1 "Agent run ended with exception" (its entrypoint waits): FailJob -> FailJobSet."""
    name = _name(f"exit{code}")
    verdict = (f"echo \"{GAVE_UP}\" >&2; " if code == 1 else "") + f"exit {code}"
    give_up = HOLD + ("until [ $$(ls $d/*.lock | wc -l) -ge 2 ]; do sleep 0.2; done; " + verdict)
    create_trainjob(kube, name, per_node(HOLD + SURVIVE, give_up))
    outcome, status, restarts = trainjob_end(kube, name)
    assert (outcome, restarts) == ("Failed", 0), status
    assert "PodFailurePolicy" in job_reasons(kube, name)
    assert conditions(status)["Failed"]["reason"] == "FailJobSetFailurePolicyAction", status
    _done(kube, name)


def test_killed_pod_recreates_the_jobset(kube):
    """137 on the first attempt: BackoffLimitExceeded -> RestartJobSet; the second completes."""
    name = _name("kill")
    create_trainjob(kube, name, ONCE + "kill -9 $$$$")
    outcome, status, restarts = trainjob_end(kube, name)
    assert (outcome, restarts) == ("Complete", 1), status
    assert conditions(status).get("Completed"), status
    _done(kube, name)


def test_restarts_stop_at_max_restarts(kube):
    from kfp_nvrx.components.launch.trainjob.runtime import MAX_RESTARTS

    name = _name("always")
    create_trainjob(kube, name, "kill -9 $$$$")
    outcome, status, restarts = trainjob_end(kube, name)
    assert (outcome, restarts) == ("Failed", MAX_RESTARTS), status
    assert conditions(status)["Failed"]["reason"] == "ReachedMaxRestarts", status
    _done(kube, name)


@pytest.mark.parametrize("how", ["evict", "delete"])
def test_stopped_rendezvous_host_restarts_the_jobset(kube, how):
    """Node 0 evicted (DisruptionTarget) or deleted: its ft_launcher exits 1 on SIGTERM (143 by
    the entrypoint); node 1 loses its rendezvous host and exits 1 too, which its entrypoint
    holds back: the JobSet restarts (rule ``infrastructure``) instead of failing."""
    name = _name(how)
    create_trainjob(kube, name, FT_POD)
    pods = running_pods(kube, f"{JOBSET_LABEL}={name}")
    holding(kube, name)
    stop(kube, pods[0], how)
    outcome, status, restarts = trainjob_end(kube, name)
    assert (outcome, restarts) == ("Complete", 1), status
    _done(kube, name)


def test_lost_rendezvous_host_node_restarts_the_jobset(kube):
    """Node 0's machine is lost (its processes die, the Node is deleted): PodGC fails its pod
    with DisruptionTarget, node 1 loses its rendezvous host; the JobSet restarts on the nodes
    left and both pods run again."""
    name = _name("node")
    create_trainjob(kube, name, FT_POD)
    pods = running_pods(kube, f"{JOBSET_LABEL}={name}")
    holding(kube, name)
    with lost_node(kube, pods[0]):
        outcome, status, restarts = trainjob_end(kube, name)
    assert (outcome, restarts) == ("Complete", 1), status
    _done(kube, name)


def test_trainjob_deadline_fails_it_and_stops_its_pods(kube):
    """``--active-deadline``: the Trainer fails the TrainJob (DeadlineExceeded) and deletes its
    JobSet; no JobSet rule is involved."""
    name = _name("deadline")
    create_trainjob(kube, name, "while :; do sleep 0.2; done", active_deadline_s=15)

    def failed():
        return conditions(get(kube, TRAINER, "trainjobs", name)).get("Failed")
    cond = wait_for(f"TrainJob {name} failed", failed, WAIT_S)
    assert cond["reason"] == "DeadlineExceeded", cond
    wait_for(f"JobSet {name} deleted", lambda: _gone(kube, name), WAIT_S)
    wait_for(f"pods of {name} gone", lambda: not core(kube).list_namespaced_pod(
        kube.namespace, label_selector=f"{JOBSET_LABEL}={name}").items, WAIT_S)
    _done(kube, name)


def _gone(kube, name: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        get(kube, JOBSET, "jobsets", name)
    except ApiException as e:
        return e.status == 404
    return False


def test_any_other_job_failure_fails_the_jobset(kube):
    """A ``node`` Job that fails for a reason neither rule names (here its own
    ``activeDeadlineSeconds``, set on a copy of the runtime): rule ``anything_else``,
    FailJobSet, no restart."""
    from kfp_nvrx.components.launch.trainjob.runtime import build_runtime

    name = _name("other")
    runtime = build_runtime(f"{name}-rt", namespace=kube.namespace)
    runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "activeDeadlineSeconds"] = 5
    custom(kube).create_namespaced_custom_object(*TRAINER, kube.namespace, "trainingruntimes",
                                                 runtime)
    wait_runtime_seen(kube.dynamic(), runtime, kube.namespace)
    try:
        create_trainjob(kube, name, "while :; do sleep 0.2; done", runtime=f"{name}-rt")
        outcome, status, restarts = trainjob_end(kube, name)
        assert (outcome, restarts) == ("Failed", 0), status
        assert job_reasons(kube, name) == {"DeadlineExceeded"}
        assert conditions(status)["Failed"]["reason"] == "FailJobSetFailurePolicyAction", status
        _done(kube, name)
    finally:
        custom(kube).delete_namespaced_custom_object(*TRAINER, kube.namespace,
                                                     "trainingruntimes", f"{name}-rt")
