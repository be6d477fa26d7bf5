"""Every row of the failure-handling table (docs/eks.md) on the real controllers (issue 21.4).

The jobs are ours (rendered by ``render-job``, the shipped ``kfp-nvrx-ft`` runtime, the
PyTorchJob's ``restartPolicy: ExitCode``, the pods' ``pod_entry`` entrypoint) with ft_launcher
replaced by a shell line that ends the way ft_launcher or the infrastructure would: its exit
codes (1 gave up, 93 no progress), a SIGKILL (137), an eviction or deletion while it exits 1 on
the SIGTERM, a lost node. What the Job controller, JobSet, the Trainer and the Training Operator
then do is real. A marker file per pod hostname on the shared volume lets the second attempt
succeed, so "restarted" and "failed" are told apart by the outcome, not by timing.
"""

from __future__ import annotations

import uuid

import pytest

from cluster.kutil import wait_for
from kfp_nvrx.components.launch.jobspec import pytorchjob, trainjob
from kfp_nvrx.components.launch.jobspec.pod import POD_ENTRY
from kfp_nvrx.components.launch.jobspec.spec import JobSpec

pytestmark = [pytest.mark.timeout(600)]

WAIT_S = 240.0
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"


def _spec(name: str) -> JobSpec:
    return JobSpec(image="kfp-nvrx-trainer:test", pvc="kfp-nvrx-shared", instance_type="cpu",
                   nodes="2", name=name, config="tiny", overrides=["data.path=/fsx/data"])


def _script(body: str, name: str) -> list[str]:
    # Behind the pods' real entrypoint, in place of ft_launcher. One marker per pod hostname
    # (stable when a pod is recreated: <job>-worker-1, <trainjob>-node-0-1); `$$` is a literal
    # `$` after the kubelet's expansion.
    return [*POD_ENTRY, "/bin/sh", "-c", f"d=/fsx/policy/{name}; mkdir -p $d; "
            f"m=$d/$$(hostname); {body}"]


#: First attempt: run until stopped, exiting 1 on SIGTERM as ft_launcher does (the entrypoint
#: makes that 143); a second attempt succeeds and lets the first attempt's survivors finish too.
#: The marker is written once the trap is set: a pod is stopped only after its marker exists
#: (:func:`_first_attempts_running`), never while the agent is still starting it.
FT_ON_SIGTERM = ("[ -e $m ] && { touch $m.done; exit 0; }; trap 'exit 1' TERM; touch $m; "
                 "while ! ls $d/*.done >/dev/null 2>&1; do sleep 0.2; done")


def _stop(kube, pod, how: str) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube.client())
    if how == "evict":
        core.create_namespaced_pod_eviction(pod.metadata.name, kube.namespace, client.V1Eviction(
            metadata=client.V1ObjectMeta(name=pod.metadata.name, namespace=kube.namespace)))
    else:
        core.delete_namespaced_pod(pod.metadata.name, kube.namespace)


ONCE = "[ -e $m ] && exit 0; touch $m; "


def _wait(what, check, timeout_s=WAIT_S):
    return wait_for(what, check, timeout_s)


def _custom(kube):
    from kubernetes import client

    return client.CustomObjectsApi(kube.client())


def _trainjob(kube, name: str, body: str) -> None:
    job = trainjob.render(_spec(name)).to_dict()
    job["spec"]["trainer"]["command"] = _script(body, name)
    job["spec"]["trainer"].pop("args", None)
    _custom(kube).create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1",
                                                  kube.namespace, "trainjobs", job)


def _trainjob_end(kube, name: str) -> tuple[str, dict, int]:
    """Wait for Complete/Failed; return it, the JobSet's status and its restarts."""
    api = _custom(kube)

    def done():
        tj = api.get_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1",
                                              kube.namespace, "trainjobs", name)
        conds = {c["type"]: c for c in (tj.get("status") or {}).get("conditions", [])
                 if c["status"] == "True"}
        return next((t for t in ("Complete", "Failed") if t in conds), None)
    outcome = _wait(f"TrainJob {name} finished", done)
    js = api.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", kube.namespace,
                                          "jobsets", name)
    return outcome, js["status"], js["status"].get("restarts", 0)


def _job_reasons(kube, name: str) -> set[str]:
    from kubernetes import client

    jobs = client.BatchV1Api(kube.client()).list_namespaced_job(
        kube.namespace, label_selector=f"{JOBSET_LABEL}={name}").items
    return {c.reason for j in jobs for c in (j.status.conditions or []) if c.type == "Failed"}


def _delete(kube, plural: str, group: str, version: str, name: str) -> None:
    _custom(kube).delete_namespaced_custom_object(group, version, kube.namespace, plural, name,
                                                  propagation_policy="Foreground")


@pytest.mark.parametrize("code", [1, 93])
def test_ft_launcher_verdict_fails_the_trainjob_at_once(kube, code):
    """Gave up (1) / no progress (93): FailJob -> FailJobSet, no JobSet restart."""
    name = f"pol-exit{code}-{uuid.uuid4().hex[:4]}"
    _trainjob(kube, name, f"exit {code}")
    outcome, status, restarts = _trainjob_end(kube, name)
    assert (outcome, restarts) == ("Failed", 0), status
    assert "PodFailurePolicy" in _job_reasons(kube, name)
    _delete(kube, "trainjobs", "trainer.kubeflow.org", "v1alpha1", name)


def test_killed_pod_recreates_the_jobset(kube):
    """137 on the first attempt: BackoffLimitExceeded -> RestartJobSet; the second completes."""
    name = f"pol-kill-{uuid.uuid4().hex[:4]}"
    _trainjob(kube, name, ONCE + "kill -9 $$$$")
    outcome, status, restarts = _trainjob_end(kube, name)
    assert (outcome, restarts) == ("Complete", 1), status
    _delete(kube, "trainjobs", "trainer.kubeflow.org", "v1alpha1", name)


def test_restarts_stop_at_max_restarts(kube):
    from kfp_nvrx.components.launch.jobspec.runtime import MAX_RESTARTS

    name = f"pol-always-{uuid.uuid4().hex[:4]}"
    _trainjob(kube, name, "kill -9 $$$$")
    outcome, status, restarts = _trainjob_end(kube, name)
    assert (outcome, restarts) == ("Failed", MAX_RESTARTS), status
    _delete(kube, "trainjobs", "trainer.kubeflow.org", "v1alpha1", name)


def _running_pods(kube, selector: str, n: int):
    from kubernetes import client

    core = client.CoreV1Api(kube.client())

    def check():
        pods = [p for p in core.list_namespaced_pod(kube.namespace,
                                                    label_selector=selector).items
                if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
        return sorted(pods, key=lambda p: p.metadata.name) if len(pods) >= n else None
    return _wait(f"{n} running pods of {selector}", check)


def _first_attempts_running(kube, name: str, n: int) -> None:
    """Wait until ``n`` pods of job ``name`` run FT_ON_SIGTERM's loop (their markers exist).

    A pod is ``Running`` as soon as its container starts, before the entrypoint and the shell
    run. Stopped before it wrote its marker, a pod's replacement would take itself for a first
    attempt and wait for a ``.done`` that no pod writes (a PyTorchJob's surviving worker waits
    too): the job would never end.
    """
    folder = kube.root / "volumes" / kube.namespace / "kfp-nvrx-shared" / "policy" / name
    _wait(f"{n} first attempts of {name} in their loop", lambda: len(
        [p for p in folder.glob("*") if p.suffix != ".done"]) >= n or None)


@pytest.mark.parametrize("how", ["evict", "delete"])
def test_stopped_pod_restarts_the_jobset(kube, how):
    """An evicted (DisruptionTarget) or deleted pod whose ft_launcher exits 1 on SIGTERM, as
    NVRx's does, restarts the JobSet instead of failing it: the entrypoint reports 143."""
    name = f"pol-{how}-{uuid.uuid4().hex[:4]}"
    _trainjob(kube, name, FT_ON_SIGTERM)
    pods = _running_pods(kube, f"{JOBSET_LABEL}={name}", 2)
    _first_attempts_running(kube, name, 2)
    _stop(kube, pods[0], how)
    outcome, status, restarts = _trainjob_end(kube, name)
    assert (outcome, restarts) == ("Complete", 1), status
    _delete(kube, "trainjobs", "trainer.kubeflow.org", "v1alpha1", name)


def test_lost_node_restarts_the_jobset(kube):
    """The node stops heartbeating and its processes die; the Node is deleted (what the cloud
    node controller does for a terminated instance); PodGC fails its pods with DisruptionTarget;
    the JobSet restarts on the nodes left."""
    from kubernetes import client

    name = f"pol-node-{uuid.uuid4().hex[:4]}"
    _trainjob(kube, name, ONCE + "while true; do sleep 0.2; done")
    pod = _running_pods(kube, f"{JOBSET_LABEL}={name}", 2)[1]
    node = pod.spec.node_name
    control = kube.root / "agent" / "control" / node
    core = client.CoreV1Api(kube.client())
    try:
        control.write_text("lost")
        _wait(f"node {node} lost", lambda: (kube.root / "agent" / "control" /
                                            f"{node}.lost").is_file(), 60)
        core.delete_node(node)
        outcome, status, restarts = _trainjob_end(kube, name)
        assert (outcome, restarts) == ("Complete", 1), status
    finally:
        control.unlink(missing_ok=True)  # the agent registers the node again
        _wait(f"node {node} back", lambda: any(
            n.metadata.name == node and {c.type: c.status for c in n.status.conditions}.get(
                "Ready") == "True" for n in core.list_node().items), 60)
    _delete(kube, "trainjobs", "trainer.kubeflow.org", "v1alpha1", name)


def _pytorchjob(kube, name: str, body: str) -> None:
    job = pytorchjob.render(_spec(name)).to_dict()
    for rs in job["spec"]["pytorchReplicaSpecs"].values():
        rs["template"]["spec"]["containers"][0]["command"] = _script(body, name)
        rs["template"]["spec"]["containers"][0].pop("args", None)
    _custom(kube).create_namespaced_custom_object("kubeflow.org", "v1", kube.namespace,
                                                  "pytorchjobs", job)


def _pytorchjob_end(kube, name: str) -> str:
    def done():
        job = _custom(kube).get_namespaced_custom_object("kubeflow.org", "v1", kube.namespace,
                                                         "pytorchjobs", name)
        conds = {c["type"] for c in (job.get("status") or {}).get("conditions", [])
                 if c["status"] == "True"}
        return next((t for t in ("Succeeded", "Failed") if t in conds), None)
    return _wait(f"PyTorchJob {name} finished", done)


@pytest.mark.parametrize("body,want", [("exit 1", "Failed"), ("exit 93", "Failed"),
                                       (ONCE + "kill -9 $$$$", "Succeeded")])
def test_pytorchjob_exit_code_policy(kube, body, want):
    """ExitCode: 1..127 fails the job; a signal (137) recreates the pod, which then succeeds."""
    name = f"pol-pj-{uuid.uuid4().hex[:4]}"
    _pytorchjob(kube, name, body)
    assert _pytorchjob_end(kube, name) == want
    _delete(kube, "pytorchjobs", "kubeflow.org", "v1", name)


@pytest.mark.parametrize("how", ["evict", "delete"])
def test_pytorchjob_stopped_worker_is_recreated(kube, how):
    """ExitCode sees 143 (a signal), not ft_launcher's 1: the operator recreates the pod."""
    name = f"pol-pj{how}-{uuid.uuid4().hex[:4]}"
    _pytorchjob(kube, name, FT_ON_SIGTERM)
    pods = _running_pods(kube, f"training.kubeflow.org/job-name={name}", 2)
    _first_attempts_running(kube, name, 2)
    _stop(kube, pods[1], how)  # worker-1: worker-0 hosts the rendezvous
    assert _pytorchjob_end(kube, name) == "Succeeded"
    _delete(kube, "pytorchjobs", "kubeflow.org", "v1", name)
