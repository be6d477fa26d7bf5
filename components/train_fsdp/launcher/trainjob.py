"""Kubernetes backend for Kubeflow Trainer v2: create (or re-attach to) a TrainJob and follow it.

The counterpart of :mod:`.kubernetes` (PyTorchJob) with the same contract: the job name derives
from the KFP run and task, so a restarted launcher follows the TrainJob it created before; the wait
ends at ``Complete`` or ``Failed`` or at the real deadline (``activeDeadlineSeconds`` + a margin);
every node pod's log is streamed, also pods that the Job controller recreates (new names, same
completion index) and pods of a whole-JobSet restart; SIGTERM/SIGINT deletes the TrainJob with
foreground propagation. The objects are plain dicts validated against the vendored CRDs (the
``kubeflow`` SDK and ``kubeflow-trainer-api`` models are not installable here); the calls go
through the Kubernetes client's ``CustomObjectsApi``.

:func:`served_job_apis` answers ``--job-api auto``: it asks the API server's discovery endpoints
which of ``trainjobs.trainer.kubeflow.org`` and ``pytorchjobs.kubeflow.org`` it serves.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.train_fsdp.jobspec import naming
from kfp_nvrx.components.train_fsdp.jobspec import runtime as rt
from kfp_nvrx.components.train_fsdp.jobspec.spec import JobSpec
from kfp_nvrx.components.train_fsdp.jobspec.trainjob import render
from kfp_nvrx.components.train_fsdp.launcher.k8s_job import (
    ClusterError,
    JobRun,
    K8sOptions,
    Outcome,
    api_error,
    failure_reason,
)
from kfp_nvrx.components.train_fsdp.launcher.logs import PodLogFollower
from kfp_nvrx.components.train_fsdp.launcher.result import LaunchResult

VERSION = "v1alpha1"
PLURAL = "trainjobs"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
FINAL = ("Complete", "Failed")
JOB_APIS = ("pytorchjob", "trainjob")
SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
CRD = "Kubeflow Trainer v2 (trainer.kubeflow.org TrainJob CRD)"


def served_job_apis(api: k8s.ApiClient) -> set[str]:
    """Return which of ``pytorchjob`` / ``trainjob`` the cluster serves (API discovery)."""
    served = set()
    for group, version, plural, api_name in ((rt.GROUP, VERSION, PLURAL, "trainjob"),
                                             ("kubeflow.org", "v1", "pytorchjobs", "pytorchjob")):
        try:
            resp = api.call_api(f"/apis/{group}/{version}", "GET", response_type="object",
                                auth_settings=["BearerToken"], _return_http_data_only=True)
        except ApiException as err:
            if err.status == 404:
                continue
            raise ClusterError(f"asking the API server for {group}/{version}: HTTP "
                               f"{err.status} {err.reason}") from None
        except Exception as err:  # noqa: BLE001 - connection errors: one line
            raise ClusterError(f"asking the API server for {group}/{version}: "
                               f"{' '.join(str(err).split())}") from None
        if any(r.get("name") == plural for r in (resp or {}).get("resources", [])):
            served.add(api_name)
    return served


def resolve_job_api(job_api: str, api: k8s.ApiClient | None) -> str:
    """Return ``job_api``, or for ``auto`` the API the cluster serves (TrainJob when both)."""
    if job_api in JOB_APIS:
        return job_api
    if job_api != "auto":
        raise UserError("--job-api", f"must be pytorchjob, trainjob or auto, got {job_api!r}")
    served = served_job_apis(api) if api is not None else set()
    if "trainjob" in served:
        return "trainjob"
    if "pytorchjob" in served:
        return "pytorchjob"
    raise ClusterError("--job-api auto: the cluster serves neither trainjobs.trainer.kubeflow.org "
                       "(Kubeflow Trainer v2) nor pytorchjobs.kubeflow.org (Training Operator v1)")


def current_namespace() -> str:
    """The service account's namespace inside a pod, else ``default``."""
    try:
        with open(SA_NAMESPACE) as fh:
            return fh.read().strip() or "default"
    except OSError:
        return "default"


def _ts(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class _TrainJobs:
    """The CustomObjectsApi calls on one TrainJob and the readings of its dict (a :class:`JobAPI`)."""

    kind = "TrainJob"

    def __init__(self, api: k8s.CustomObjectsApi, name: str, namespace: str) -> None:
        self.api, self.name, self.namespace = api, name, namespace
        self.where = f"TrainJob {namespace}/{name}"

    def get(self) -> dict[str, Any] | None:
        try:
            return self.api.get_namespaced_custom_object(rt.GROUP, VERSION, self.namespace,
                                                         PLURAL, self.name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise api_error(f"reading {self.where}", err, CRD) from None
        except Exception as err:  # noqa: BLE001 - connection reset and the like
            raise ClusterError(f"reading {self.where}: {' '.join(str(err).split())}") from None

    def create(self, body: dict[str, Any]) -> bool:
        try:
            self.api.create_namespaced_custom_object(rt.GROUP, VERSION, self.namespace, PLURAL,
                                                     body)
        except ApiException as err:
            if err.status == 409:
                return False
            raise api_error(f"creating {self.where}", err, CRD) from None
        return True

    def delete(self) -> None:
        try:
            self.api.delete_namespaced_custom_object(
                rt.GROUP, VERSION, self.namespace, PLURAL, self.name,
                body=k8s.V1DeleteOptions(propagation_policy="Foreground"))
        except ApiException as err:
            if err.status != 404:
                raise api_error(f"deleting {self.where}", err, CRD) from None

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
    if any((j.get("active") or 0) > 0 for j in jobs):
        return "Running"
    conds = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") ==
             "True"]
    return conds[-1]["type"] if conds else "Pending"


def launch_trainjob(spec: JobSpec, opts: K8sOptions | None = None, *,
                    log: Callable[[str], None] = print,
                    client_configuration: k8s.Configuration | None = None,
                    api_client: k8s.ApiClient | None = None,
                    runtime: str = rt.RUNTIME_NAME,
                    runtime_kind: str = rt.RUNTIME_KIND) -> LaunchResult:
    """Run ``spec`` as a TrainJob and follow it to its end (see the module docstring).

    Args:
        spec: The job; rendered and checked against the vendored CRDs before any API call.
        opts: Namespace, deadline, delete_after, polling.
        log: Sink for log lines and progress (one line per call).
        client_configuration: Kubernetes client configuration (None: kubeconfig or in-cluster).
        api_client: A ready ApiClient (overrides ``client_configuration``).
        runtime: Name of the runtime the TrainJob's ``runtimeRef`` names.
        runtime_kind: ``TrainingRuntime`` (namespaced) or ``ClusterTrainingRuntime``.

    Returns:
        What :meth:`.k8s_job.JobRun.run` returns, with ``extra["job_api"] = "trainjob"``.

    Raises:
        UserError: Bad input or a name clash with another run's TrainJob (nothing is created).
        ClusterError: The cluster refused or could not answer a call.

    """
    run = JobRun(opts, log)
    rendered = render(spec, runtime, runtime_kind)
    api = api_client or k8s.ApiClient(client_configuration)
    namespace = run.opts.namespace or spec.namespace or current_namespace()
    rendered.job["metadata"]["namespace"] = namespace
    follower = PodLogFollower(k8s.CoreV1Api(api), namespace, rendered.name, emit=run.say,
                              container=rt.CONTAINER_NAME,
                              watch_timeout_s=run.opts.watch_timeout_s,
                              selector=f"{JOBSET_NAME_LABEL}={rendered.name}",
                              replica_name=node_replica)
    ref = rendered.job["spec"]["runtimeRef"]
    return run.run(_TrainJobs(k8s.CustomObjectsApi(api), rendered.name, namespace), rendered.job,
                   spec, follower, run_dir=rendered.run_dir,
                   describe=f"{rendered.nodes} x {spec.instance_type} "
                   f"({rendered.procs_per_node} procs each), runtime {ref['kind']}/{ref['name']}, "
                   f"run dir {rendered.run_dir}",
                   active_deadline_s=rendered.job["spec"].get("activeDeadlineSeconds"),
                   extra={"job_api": "trainjob"})
