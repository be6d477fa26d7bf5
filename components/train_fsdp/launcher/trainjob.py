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

import posixpath
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.train_fsdp.jobspec import naming
from kfp_nvrx.components.train_fsdp.jobspec import runtime as rt
from kfp_nvrx.components.train_fsdp.jobspec.spec import DELETE_AFTER, JobSpec
from kfp_nvrx.components.train_fsdp.jobspec.trainjob import RenderedTrainJob, render
from kfp_nvrx.components.train_fsdp.launcher.kubernetes import (
    DEADLINE_MARGIN_S,
    ClusterError,
    K8sOptions,
    StopSignals,
    fill_failure,
    should_delete,
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


def _error(action: str, err: ApiException) -> ClusterError:
    hint = {401: "credentials were rejected", 403: "RBAC forbids it (see docs/eks.md)",
            404: "is Kubeflow Trainer v2 (trainer.kubeflow.org TrainJob CRD) installed?"}
    return ClusterError(f"{action}: HTTP {err.status} {err.reason}. {hint.get(err.status, '')} "
                        f"{str(err.body or '')[:300]}".strip())


class _TrainJobs:
    """The CustomObjectsApi calls on one TrainJob."""

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
            raise _error(f"reading {self.where}", err) from None
        except Exception as err:  # noqa: BLE001 - connection reset and the like
            raise ClusterError(f"reading {self.where}: {' '.join(str(err).split())}") from None

    def create(self, body: dict[str, Any]) -> bool:
        try:
            self.api.create_namespaced_custom_object(rt.GROUP, VERSION, self.namespace, PLURAL,
                                                     body)
        except ApiException as err:
            if err.status == 409:
                return False
            raise _error(f"creating {self.where}", err) from None
        return True

    def delete(self) -> None:
        try:
            self.api.delete_namespaced_custom_object(
                rt.GROUP, VERSION, self.namespace, PLURAL, self.name,
                body=k8s.V1DeleteOptions(propagation_policy="Foreground"))
        except ApiException as err:
            if err.status != 404:
                raise _error(f"deleting {self.where}", err) from None


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


def _attach_or_create(jobs: _TrainJobs, rendered: RenderedTrainJob, spec: JobSpec,
                      say: Callable[[str], None]) -> tuple[dict[str, Any], bool]:
    for _ in range(3):
        existing = jobs.get()
        if existing is not None and existing["metadata"].get("deletionTimestamp"):
            say(f"{jobs.where} is being deleted; waiting for it to go")
            for _ in range(120):
                time.sleep(1.0)
                if jobs.get() is None:
                    break
            existing = jobs.get()
        if existing is not None:
            owner = (existing["metadata"].get("annotations") or {}).get(naming.RUN_ID_KEY, "")
            if spec.run_id and owner == spec.run_id:
                say(f"re-attaching to {jobs.where} (run {owner})")
                return existing, True
            raise UserError("--name", f"{jobs.where} already exists and belongs to run "
                            f"{owner or '(none)'!r}, not {spec.run_id or '(none)'!r}; delete it "
                            "or choose another --name")
        if jobs.create(rendered.job):
            say(f"created {jobs.where}: {rendered.nodes} x {spec.instance_type} "
                f"({rendered.procs_per_node} procs each), runtime "
                f"{rendered.job['spec']['runtimeRef']['kind']}/"
                f"{rendered.job['spec']['runtimeRef']['name']}, run dir {rendered.run_dir}")
            created = jobs.get()
            if created is not None:
                return created, False
    raise ClusterError(f"{jobs.where} could not be created or read")


def launch_trainjob(spec: JobSpec, opts: K8sOptions | None = None, *,
                    log: Callable[[str], None] = print,
                    client_configuration: k8s.Configuration | None = None,
                    api_client: k8s.ApiClient | None = None,
                    runtime: str = rt.RUNTIME_NAME,
                    runtime_kind: str = rt.RUNTIME_KIND) -> LaunchResult:
    """Run ``spec`` as a TrainJob and follow it to its end (see the module docstring).

    Returns:
        The result: ``Succeeded``, ``Failed``, ``DeadlineExceeded`` or ``Cancelled``.

    Raises:
        UserError: Bad input or a name clash with another run's TrainJob (nothing is created).
        ClusterError: The cluster refused a call (RBAC, missing CRD, unreachable).

    """
    opts = opts or K8sOptions()
    if opts.delete_after not in DELETE_AFTER:
        raise UserError("--delete-after", f"must be one of {', '.join(DELETE_AFTER)}, "
                        f"got {opts.delete_after!r}")
    rendered = render(spec, runtime, runtime_kind)
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            log(line)

    api = api_client or k8s.ApiClient(client_configuration)
    namespace = opts.namespace or spec.namespace or current_namespace()
    rendered.job["metadata"]["namespace"] = namespace
    jobs = _TrainJobs(k8s.CustomObjectsApi(api), rendered.name, namespace)
    core = k8s.CoreV1Api(api)
    with StopSignals(opts.handle_signals) as signals:
        job, attached = _attach_or_create(jobs, rendered, spec, say)
        follower = PodLogFollower(core, namespace, rendered.name, emit=say,
                                  container=rt.CONTAINER_NAME,
                                  watch_timeout_s=opts.watch_timeout_s,
                                  selector=f"{JOBSET_NAME_LABEL}={rendered.name}",
                                  replica_name=node_replica)
        follower.start()
        try:
            result = _follow(jobs, job, rendered, opts, follower, signals, say)
        finally:
            follower.stop(drain_s=0.0 if signals.event.is_set() else opts.drain_s)
    fill_failure(result, follower, core, namespace, opts.tail_lines)
    result.pod_restarts = follower.pod_restarts()
    result.restarts = follower.progress.restarts
    result.extra.update(attached=attached, namespace=namespace, pvc=spec.pvc, job_api="trainjob",
                        run_dir_uri=f"pvc://{spec.pvc}/"
                        f"{posixpath.relpath(rendered.run_dir, spec.mount)}",
                        progress=follower.progress.summary())
    if should_delete(result.state, opts.delete_after):
        jobs.delete()
        say(f"deleted {jobs.where} (propagationPolicy=Foreground)")
    return result


def _follow(jobs: _TrainJobs, job: dict[str, Any], rendered: RenderedTrainJob,
            opts: K8sOptions, follower: PodLogFollower, signals: StopSignals,
            say: Callable[[str], None]) -> LaunchResult:
    """Poll the TrainJob until it ends, the deadline passes or a signal arrives."""
    created = _ts(job["metadata"].get("creationTimestamp")) or time.time()
    deadline_s = opts.deadline_s
    active = rendered.job["spec"].get("activeDeadlineSeconds")
    if deadline_s is None and active:
        deadline_s = active + DEADLINE_MARGIN_S
    result = LaunchResult(name=rendered.name, backend="kubernetes", state="Running",
                          run_dir=rendered.run_dir, started_at=created)
    last_state, last_progress, last_summary, errors = "", 0.0, "", 0
    while True:
        if signals.event.is_set():
            name = signal.Signals(signals.signum).name if signals.signum else "signal"
            say(f"{name} received: deleting {jobs.where}")
            result.state, result.reason = "Cancelled", f"launcher received {name}"
            result.extra["signal"] = signals.signum
            break
        try:
            current = jobs.get()
            errors = 0
        except ClusterError as err:
            errors += 1
            if errors >= 10:
                raise
            say(f"warning: {err} (retrying)")
            current = job
        if current is None:
            result.state, result.reason = "Failed", "the TrainJob was deleted by someone else"
            break
        job = current
        state = _state(job)
        if state != last_state:
            say(f"TrainJob {jobs.name}: {state}")
            last_state = state
            if state == "Running" and "time_to_running_s" not in result.extra:
                result.extra["time_to_running_s"] = round(time.time() - created, 1)
        final = _condition(job, FINAL)
        if final is not None:
            result.state = "Succeeded" if final["type"] == "Complete" else "Failed"
            if result.state == "Failed":
                result.reason = f"{final.get('reason') or 'Failed'}: " \
                                f"{final.get('message') or ''}".strip(": ")
            result.finished_at = _ts(final.get("lastTransitionTime")) or time.time()
            break
        if deadline_s is not None and time.time() - created > deadline_s:
            result.state = "DeadlineExceeded"
            result.reason = f"launcher deadline of {deadline_s:g}s after job creation passed"
            break
        summary = follower.progress.summary()
        now = time.monotonic()
        moved = follower.progress.step or follower.progress.restarts
        if moved and summary != last_summary and now - last_progress >= opts.progress_s:
            say(f"progress: {summary}, pod restarts {follower.pod_restarts()}")
            last_summary, last_progress = summary, now
        signals.event.wait(opts.poll_s)
    result.finished_at = result.finished_at or time.time()
    return result
