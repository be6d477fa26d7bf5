"""A TrainJob followed: what Kubeflow Trainer v2 writes on it, and which pods are its own.

The launcher's part that every job API shares (create or re-attach, follow to the end, stream the
pods, delete) is :mod:`..kube`; this is what is the TrainJob's own: the wait ends at ``Complete``
or ``Failed`` (or a JobSet the Trainer can never build, :meth:`FollowedTrainJob.blocked`); every
node pod's log is streamed, also pods that the Job controller recreates (new names, same
completion index) and pods of a whole-JobSet restart; a deletion goes in the background
(:attr:`FollowedTrainJob.propagation` says why) and waits for the pods to go.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client as k8s

from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
from kfp_nvrx.components.launch.kube import calls
from kfp_nvrx.components.launch.kube.calls import ClusterError
from kfp_nvrx.components.launch.kube.followed import (
    FollowedJob,
    JobPods,
    Outcome,
    Resource,
    condition,
    failure_reason,
    timestamp,
    true_conditions,
)
from kfp_nvrx.components.launch.trainjob import runtime as rt

RESOURCE = Resource(rt.GROUP, rt.API_VERSION.split("/")[1], "trainjobs", "TrainJob",
                    "Kubeflow Trainer v2")
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
FINAL = ("Complete", "Failed")
#: The Event reason of a TrainJob whose JobSet (or other objects) could not be applied.
CREATION_FAILED = "TrainJobResourcesCreationFailed"
#: What an Event message says when the refusal will not go away by retrying.
FINAL_REFUSALS = ("denied the request", "is invalid", "is forbidden")


def node_replica(pod: k8s.V1Pod) -> str:
    """``node-<index>``, ``node-<index>/a<n>`` in the n-th whole-JobSet restart."""
    labels = pod.metadata.labels or {}
    index = labels.get(COMPLETION_INDEX_LABEL)
    if index is None:
        return pod.metadata.name
    attempt = labels.get(RESTART_ATTEMPT_LABEL, "0")
    return f"{rt.REPLICATED_JOB}-{index}" + (f"/a{attempt}" if attempt not in ("", "0") else "")


def restart_attempt(pod: k8s.V1Pod) -> int | None:
    """The JobSet restart that made ``pod`` (its restart-attempt label; None without one)."""
    value = (pod.metadata.labels or {}).get(RESTART_ATTEMPT_LABEL, "")
    return int(value) if value.isdigit() else None


def job_pods(name: str) -> JobPods:
    """The node pods of TrainJob ``name``, by its JobSet's label; it ends when every one has."""
    return JobPods(job=name, selector=f"{JOBSET_NAME_LABEL}={name}", container=rt.CONTAINER_NAME,
                   replica=node_replica, first_success_ends_job=False,
                   restart_of=restart_attempt)


class FollowedTrainJob(FollowedJob):
    """One TrainJob: its conditions, its JobSet's jobs and the Trainer's Warning Events."""

    resource = RESOURCE
    crd = "Kubeflow Trainer v2 (trainer.kubeflow.org TrainJob CRD)"
    controller = ("the Kubeflow Trainer controller manager (and Kueue, for a TrainJob with "
                  "spec.managedBy)")
    #: Not Foreground: Trainer v2.3 reconciles a TrainJob that is being deleted and applies its
    #: JobSet again each time the garbage collector deleted it, so a foreground deletion (which
    #: waits for that JobSet) does not end (seen on the real controllers: over a minute and
    #: counting). In the background the TrainJob goes at once and the collector then deletes
    #: the JobSet, its Jobs, Pods and Service; :meth:`gone` waits for the pods.
    propagation = "Background"

    def __init__(self, client: Any, job: ResolvedJob, say: Callable[[str], None]) -> None:
        super().__init__(client, job, say)
        self._warned: set[str] = set()

    @property
    def pods(self) -> JobPods:
        """The job's node pods (:func:`job_pods`)."""
        return job_pods(self.name)

    def gone(self) -> bool:
        """The TrainJob is gone and so are its pods (the garbage collector's work)."""
        if self.get() is not None:
            return False
        pods = calls.call(f"listing the pods of {self.where}", self.host,
                          self.core.list_namespaced_pod, self.namespace,
                          label_selector=f"{JOBSET_NAME_LABEL}={self.name}")
        return not pods.items

    def state(self, job: dict[str, Any]) -> str:
        """The final condition, ``Running`` once a node's pods are ready, else the newest."""
        final = condition(job, FINAL)
        if final:
            return str(final["type"])
        jobs = (job.get("status") or {}).get("jobsStatus") or []
        # ``ready`` counts the Jobs whose pods are all ready; ``active`` counts pending pods too
        # (pods no node has taken yet), which is not running.
        if any((j.get("ready") or 0) > 0 for j in jobs):
            return "Running"
        conds = true_conditions(job)
        return str(conds[-1]["type"]) if conds else "Pending"

    def outcome(self, job: dict[str, Any]) -> Outcome | None:
        """``Complete`` (Succeeded) or ``Failed``, with the Trainer's reason."""
        final = condition(job, FINAL)
        if final is None:
            return None
        if final["type"] == "Complete":
            return Outcome("Succeeded", "", timestamp(final.get("lastTransitionTime")))
        return Outcome("Failed", failure_reason(final.get("reason"), final.get("message")),
                       timestamp(final.get("lastTransitionTime")))

    def has_status(self, job: dict[str, Any]) -> bool:
        """The Trainer has written a status."""
        return bool(job.get("status"))

    def suspended(self, job: dict[str, Any]) -> bool:
        """``spec.suspend`` (Kueue's hold)."""
        return bool((job.get("spec") or {}).get("suspend"))

    def blocked(self, job: dict[str, Any]) -> Outcome | None:
        """The Trainer could not build the job's JobSet and will not be able to.

        Trainer v2.3 reports a failed reconcile only as a Warning Event on the TrainJob
        (``TrainJobResourcesCreationFailed``), never as a condition: without this check a
        TrainJob whose runtime builds a JobSet that the JobSet webhook refuses would be followed
        as ``Pending`` until the deadline. A refusal by admission or validation is final for this
        TrainJob and runtime, unless it comes from a stale cache (:meth:`_stale_refusal`);
        anything else (a webhook not reachable yet, a conflict) is retried by the controller, so
        it is reported once and followed on.
        """
        if (job.get("status") or {}).get("jobsStatus"):
            return None  # the JobSet exists
        try:
            messages = self._creation_failures(str(job["metadata"].get("uid", "")))
        except ClusterError as err:
            self._warn(f"warning: {err}")
            return None
        final = [m for m in messages if any(r in m for r in FINAL_REFUSALS)
                 and not self._stale_refusal(m)]
        if final:
            ref = job["spec"].get("runtimeRef") or {}
            return Outcome("Failed", f"{CREATION_FAILED}: {final[-1][:600]} (the "
                           f"{ref.get('kind', 'runtime')} {ref.get('name', '')} builds an object "
                           "the cluster refuses: fix the runtime)", 0.0)
        for message in messages:
            self._warn(f"warning: {self.where}: {CREATION_FAILED}: {message[:300]}")
        return None

    def _stale_refusal(self, message: str) -> bool:
        """A webhook refused because its cache had not seen this TrainJob yet: not final.

        Kueue v0.17's JobSet webhook looks up the JobSet's owner TrainJob in its informer cache
        and refuses with ``TrainJob.trainer.kubeflow.org "<name>" not found`` when the Trainer
        created the JobSet first (seen on the test cluster under load). The TrainJob exists (it
        was just read), so the Trainer's next try, with backoff, is accepted.
        """
        return f'{RESOURCE.kind}.{rt.GROUP} "{self.name}" not found' in message

    def creation_warnings(self) -> list[str]:
        """Why the Job controller could not create node pods (quota, admission): FailedCreate."""
        job = f"{self.name}-{rt.REPLICATED_JOB}-0"
        return [f"{m} (FailedCreate on Job {self.namespace}/{job})" for m in
                calls.warning_events(self.core, self.namespace, self.host, "Job", job,
                                     "FailedCreate")]

    def _creation_failures(self, uid: str) -> list[str]:
        """The messages of the Trainer's ``TrainJobResourcesCreationFailed`` Events, one line each."""
        events = calls.call(f"reading the events of {self.where}", self.host,
                            self.core.list_namespaced_event, self.namespace,
                            field_selector=f"involvedObject.uid={uid},reason={CREATION_FAILED}")
        return [" ".join((e.message or "").split()) for e in events.items]

    def _warn(self, line: str) -> None:
        if line not in self._warned:
            self._warned.add(line)
            self.say(line)
