"""Kubernetes backend for Kubeflow Trainer v2: create (or re-attach to) a TrainJob and follow it.

The counterpart of :mod:`.kubernetes` (PyTorchJob) with the same contract: the job name derives
from the KFP run and task, so a restarted launcher follows the TrainJob it created before; the wait
ends at ``Complete`` or ``Failed`` or at the real deadline (``activeDeadlineSeconds`` + a margin);
every node pod's log is streamed, also pods that the Job controller recreates (new names, same
completion index) and pods of a whole-JobSet restart; SIGTERM/SIGINT deletes the TrainJob with
background propagation (``_TrainJobs.propagation`` says why) and waits for its pods to go. The
objects are plain dicts validated against the vendored CRDs (the ``kubeflow`` SDK and
``kubeflow-trainer-api`` models are not installable here); the calls go through the Kubernetes
client's ``CustomObjectsApi``.

:mod:`.job_apis` answers ``--job-api auto`` (API discovery) before this module is called.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from kfp_nvrx.components.launch import k8s_api, k8s_http
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec import runtime as rt
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.jobspec.trainjob import RenderedTrainJob, render
from kfp_nvrx.components.launch.k8s_job import (
    ClusterError,
    JobRun,
    K8sOptions,
    Outcome,
    failure_reason,
    hints,
)
from kfp_nvrx.components.launch.kueue import KueueReads, with_default_queue
from kfp_nvrx.components.launch.logs import PodLogFollower
from kfp_nvrx.components.launch.result import LaunchResult

VERSION = "v1alpha1"
PLURAL = "trainjobs"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
FINAL = ("Complete", "Failed")
CRD = "Kubeflow Trainer v2 (trainer.kubeflow.org TrainJob CRD)"
#: The Event reason of a TrainJob whose JobSet (or other objects) could not be applied.
CREATION_FAILED = "TrainJobResourcesCreationFailed"
#: What an Event message says when the refusal will not go away by retrying.
FINAL_REFUSALS = ("denied the request", "is invalid", "is forbidden")


def _ts(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class _TrainJobs:
    """The CustomObjectsApi calls on one TrainJob and the readings of its dict (a :class:`JobAPI`)."""

    kind = "TrainJob"
    #: Not Foreground: Trainer v2.3 reconciles a TrainJob that is being deleted and applies its
    #: JobSet again each time the garbage collector deleted it, so a foreground deletion (which
    #: waits for that JobSet) does not end (seen on the real controllers: over a minute and
    #: counting). In the background the TrainJob goes at once and the collector then deletes
    #: the JobSet, its Jobs, Pods and Service; :meth:`gone` waits for the pods.
    propagation = "Background"
    controller = ("the Kubeflow Trainer controller manager (and Kueue, for a TrainJob with "
                  "spec.managedBy)")

    def __init__(self, api: k8s.ApiClient, name: str, namespace: str) -> None:
        self.api, self.core = k8s.CustomObjectsApi(api), k8s.CoreV1Api(api)
        self.name, self.namespace = name, namespace
        self.where = f"TrainJob {namespace}/{name}"
        self.host = k8s_api.host_of(api)
        self._warned: set[str] = set()
        self._hints = hints(CRD)
        self.say: Callable[[str], None] = print

    def _call(self, action: str, fn: Any, *args: Any, ok: tuple[int, ...] = (),
              **kwargs: Any) -> Any:
        return k8s_api.call(f"{action} {self.where}", self.host, fn, rt.GROUP, VERSION,
                            self.namespace, PLURAL, *args, ok=ok, hints=self._hints,
                            **kwargs)

    def get(self) -> dict[str, Any] | None:
        try:
            resp = self._call("reading", self.api.get_namespaced_custom_object, self.name,
                              ok=(404,))
        except ApiException:
            return None
        return k8s_api.expect_object(resp, f"reading {self.where}", self.host)

    def create(self, body: dict[str, Any]) -> bool:
        try:
            resp = self._call("creating", self.api.create_namespaced_custom_object, body,
                              ok=(409,))
        except ApiException:
            return False
        k8s_api.expect_object(resp, f"creating {self.where}", self.host)
        return True

    def delete(self) -> None:
        try:
            self._call("deleting", self.api.delete_namespaced_custom_object, self.name,
                       body=k8s.V1DeleteOptions(propagation_policy=self.propagation),
                       ok=(404,))
        except ApiException:
            return

    def gone(self) -> bool:
        """The TrainJob is gone and so are its pods (the garbage collector's work)."""
        if self.get() is not None:
            return False
        pods = k8s_api.call(f"listing the pods of {self.where}", self.host,
                            self.core.list_namespaced_pod, self.namespace,
                            label_selector=f"{JOBSET_NAME_LABEL}={self.name}")
        return not pods.items

    def created_at(self, job: dict[str, Any]) -> float:
        return _ts(job["metadata"].get("creationTimestamp"))

    def being_deleted(self, job: dict[str, Any]) -> bool:
        return bool(job["metadata"].get("deletionTimestamp"))

    def run_owner(self, job: dict[str, Any]) -> str:
        return (job["metadata"].get("annotations") or {}).get(naming.RUN_ID_KEY, "")

    def state(self, job: dict[str, Any]) -> str:
        return _state(job)

    def outcome(self, job: dict[str, Any]) -> Outcome | None:
        final = _condition(job, FINAL)
        if final is None:
            return None
        if final["type"] == "Complete":
            return Outcome("Succeeded", "", _ts(final.get("lastTransitionTime")))
        return Outcome("Failed", failure_reason(final.get("reason"), final.get("message")),
                       _ts(final.get("lastTransitionTime")))

    def has_status(self, job: dict[str, Any]) -> bool:
        return bool(job.get("status"))

    def suspended(self, job: dict[str, Any]) -> bool:
        return bool((job.get("spec") or {}).get("suspend"))

    def uid(self, job: dict[str, Any]) -> str:
        return str(job["metadata"].get("uid") or "")

    def blocked(self, job: dict[str, Any]) -> Outcome | None:
        """The Trainer could not build the job's JobSet and will not be able to.

        Trainer v2.3 reports a failed reconcile only as a Warning Event on the TrainJob
        (``TrainJobResourcesCreationFailed``), never as a condition: without this check a
        TrainJob whose runtime builds a JobSet that the JobSet webhook refuses would be followed
        as ``Pending`` until the deadline. A refusal by admission or validation is final for this
        TrainJob and runtime; anything else (a webhook not reachable yet, a conflict) is retried
        by the controller, so it is reported once and followed on.
        """
        if (job.get("status") or {}).get("jobsStatus"):
            return None  # the JobSet exists
        uid = job["metadata"].get("uid", "")
        try:
            events = k8s_api.call(
                f"reading the events of {self.where}", self.host,
                self.core.list_namespaced_event, self.namespace,
                field_selector=f"involvedObject.uid={uid},reason={CREATION_FAILED}")
        except ClusterError as err:
            self._warn(f"warning: {err}")
            return None
        messages = [" ".join((e.message or "").split()) for e in events.items]
        final = [m for m in messages if any(r in m for r in FINAL_REFUSALS)]
        if final:
            ref = job["spec"].get("runtimeRef") or {}
            return Outcome("Failed", f"{CREATION_FAILED}: {final[-1][:600]} (the "
                           f"{ref.get('kind', 'runtime')} {ref.get('name', '')} builds an object "
                           "the cluster refuses: fix the runtime)", 0.0)
        for message in messages:
            self._warn(f"warning: {self.where}: {CREATION_FAILED}: {message[:300]}")
        return None

    def creation_warnings(self) -> list[str]:
        """Why the Job controller could not create node pods (quota, admission): FailedCreate."""
        job = f"{self.name}-{rt.REPLICATED_JOB}-0"
        return [f"{m} (FailedCreate on Job {self.namespace}/{job})" for m in
                k8s_api.warning_events(self.core, self.namespace, self.host, "Job", job,
                                       "FailedCreate")]

    def _warn(self, line: str) -> None:
        if line not in self._warned:
            self._warned.add(line)
            self.say(line)


def node_replica(pod: k8s.V1Pod) -> str:
    """``node-<index>``, ``node-<index>/a<n>`` in the n-th whole-JobSet restart."""
    labels = pod.metadata.labels or {}
    index = labels.get(COMPLETION_INDEX_LABEL)
    if index is None:
        return pod.metadata.name
    attempt = labels.get(RESTART_ATTEMPT_LABEL, "0")
    return f"{rt.REPLICATED_JOB}-{index}" + (f"/a{attempt}" if attempt not in ("", "0") else "")


def _condition(job: dict[str, Any], types: tuple[str, ...]) -> dict[str, Any] | None:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in types and cond.get("status") == "True":
            return cond
    return None


def _state(job: dict[str, Any]) -> str:
    final = _condition(job, FINAL)
    if final:
        return final["type"]
    jobs = (job.get("status") or {}).get("jobsStatus") or []
    # ``ready`` counts the Jobs whose pods are all ready; ``active`` counts pending pods too
    # (pods no node has taken yet), which is not running.
    if any((j.get("ready") or 0) > 0 for j in jobs):
        return "Running"
    conds = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") ==
             "True"]
    return conds[-1]["type"] if conds else "Pending"


def launch_trainjob(spec: RenderedTrainJob | ResolvedJob | JobSpec, opts: K8sOptions | None = None, *,
                    log: Callable[[str], None] = print,
                    client_configuration: k8s.Configuration | None = None,
                    api_client: k8s.ApiClient | None = None,
                    runtime: str = rt.RUNTIME_NAME,
                    runtime_kind: str = rt.RUNTIME_KIND) -> LaunchResult:
    """Run ``spec`` as a TrainJob and follow it to its end (see the module docstring).

    Args:
        spec: The job as rendered, or one to render (a JobSpec is resolved first): rendered
            and checked against the vendored CRDs before any API call.
        opts: Namespace, deadline, delete_after, polling.
        log: Sink for log lines and progress (one line per call).
        client_configuration: Kubernetes client configuration (None: kubeconfig or in-cluster).
        api_client: A ready ApiClient (overrides ``client_configuration``).
        runtime: Name of the runtime the TrainJob's ``runtimeRef`` names (when it renders).
        runtime_kind: ``TrainingRuntime`` (namespaced) or ``ClusterTrainingRuntime``.

    Returns:
        What :meth:`.k8s_job.JobRun.run` returns, with ``extra["job_api"] = "trainjob"``.

    Raises:
        UserError: Bad input or a name clash with another run's TrainJob (nothing is created).
        ClusterError: The cluster refused or could not answer a call.

    """
    run = JobRun(opts, log)
    rendered = (spec if isinstance(spec, RenderedTrainJob)
                else render(spec, runtime, runtime_kind))
    job = rendered.resolved
    api = k8s_http.bound(api_client or k8s.ApiClient(client_configuration))
    k8s_api.configure(api.configuration)
    namespace = run.opts.namespace or job.namespace or k8s_api.current_namespace()
    if (queued := with_default_queue(api, namespace, job, run.say)) is not None:
        ref = rendered.job["spec"]["runtimeRef"]
        rendered, job = render(queued, ref["name"], ref["kind"]), queued
    rendered.job["metadata"]["namespace"] = namespace
    follower = PodLogFollower(k8s.CoreV1Api(api), namespace, job.name, emit=run.say,
                              container=rt.CONTAINER_NAME,
                              watch_timeout_s=run.opts.watch_timeout_s,
                              selector=f"{JOBSET_NAME_LABEL}={job.name}",
                              replica_name=node_replica, first_success_ends_job=False)
    ref = rendered.job["spec"]["runtimeRef"]
    jobs = _TrainJobs(api, job.name, namespace)
    jobs.say = run.say
    queue = None if job.queue is None else KueueReads(api, namespace, job.queue, run.say)
    return run.run(jobs, rendered.job, job, follower, queue=queue,
                   describe=f"{job.max_nodes} x {job.profile.name} "
                   f"({job.procs_per_node} procs each), runtime {ref['kind']}/{ref['name']}, "
                   f"run dir {job.run_dir}",
                   active_deadline_s=job.pod.active_deadline_s,
                   extra={"job_api": "trainjob"})
