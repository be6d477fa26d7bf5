"""A PyTorchJob followed: what the Training Operator writes on it, and which pods are its own.

The launcher's part that every job API shares (create or re-attach, follow to the end, stream the
pods, delete) is :mod:`..kube`; this is what is the PyTorchJob's own. Traps of the SDK avoided
(field notes): ``wait_for_job_conditions`` gives up after ``wait_timeout=600`` s and the upstream
KFP launcher sample counted Failed as done; here the wait is bounded only by a real deadline and
Failed fails the step with the operator's reason and the failing replica's last log lines.
``get_job_logs(follow=True)`` misses late and restarted pods; see :mod:`..kube.logs`.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client as k8s

from kfp_nvrx.components.launch.kube import calls
from kfp_nvrx.components.launch.kube.followed import (
    FollowedJob,
    JobPods,
    Outcome,
    Resource,
    failure_reason,
    timestamp,
    true_conditions,
)
from kfp_nvrx.components.launch.pytorchjob.render import CONTAINER_NAME

RESOURCE = Resource("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob", "Training Operator v1")
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"


def worker_replica(pod: k8s.V1Pod) -> str:
    """``worker-<index>`` from a PyTorchJob pod's labels (its name when it has none)."""
    labels = pod.metadata.labels or {}
    rtype, index = labels.get(REPLICA_TYPE_LABEL), labels.get(REPLICA_INDEX_LABEL)
    if rtype and index is not None:
        return f"{rtype.lower()}-{index}"
    return pod.metadata.name


def job_pods(name: str) -> JobPods:
    """The workers of PyTorchJob ``name``, by the operator's job-name label.

    One exiting 0 ends the job: the operator marks it Succeeded then.
    """
    return JobPods(job=name, selector=f"{JOB_NAME_LABEL}={name}", container=CONTAINER_NAME,
                   replica=worker_replica, first_success_ends_job=True)


class FollowedPyTorchJob(FollowedJob):
    """One PyTorchJob: the Training Operator's conditions are its state and its end."""

    resource = RESOURCE
    crd = "the Training Operator (kubeflow.org/v1 PyTorchJob CRD)"
    controller = "the Training Operator (kubectl -n kubeflow get deploy training-operator)"

    @property
    def pods(self) -> JobPods:
        """The job's workers (:func:`job_pods`)."""
        return job_pods(self.name)

    def state(self, job: dict[str, Any]) -> str:
        """The newest True condition (``Created``, ``Running``, ``Restarting`` ...)."""
        conds = true_conditions(job)
        return conds[-1]["type"] if conds else "Pending"

    def outcome(self, job: dict[str, Any]) -> Outcome | None:
        """``Succeeded`` or ``Failed`` with the operator's reason, once it wrote one."""
        for cond in true_conditions(job):
            if cond.get("type") in ("Succeeded", "Failed"):
                failed = cond["type"] == "Failed"
                reason = failure_reason(cond.get("reason"), cond.get("message")) if failed else ""
                finished = timestamp((job.get("status") or {}).get("completionTime"))
                return Outcome(cond["type"], reason,
                               finished or timestamp(cond.get("lastTransitionTime")))
        return None

    def has_status(self, job: dict[str, Any]) -> bool:
        """The operator has written conditions."""
        return bool((job.get("status") or {}).get("conditions"))

    def suspended(self, job: dict[str, Any]) -> bool:
        """``runPolicy.suspend`` (Kueue's hold)."""
        return bool(((job.get("spec") or {}).get("runPolicy") or {}).get("suspend"))

    def creation_warnings(self) -> list[str]:
        """Why the operator could not create pods (quota, admission): its FailedCreatePod."""
        return [f"{m} (FailedCreatePod on {self.where})" for m in calls.warning_events(
            self.core, self.namespace, self.host, self.kind, self.name, "FailedCreatePod")]
