"""Kubernetes backend: create (or re-attach to) a PyTorchJob, follow it to the end, clean up.

Traps of the SDK this module avoids (field notes): ``wait_for_job_conditions`` gives up after
``wait_timeout=600`` s and the upstream KFP launcher sample counted Failed as done; here the wait is
bounded only by a real deadline and Failed fails the step with the operator's reason and the failing
replica's last log lines. ``get_job_logs(follow=True)`` misses late and restarted pods; see
:mod:`.logs`. A launcher that KFP restarts derives the same job name and follows the existing job
instead of creating a second one. SIGTERM/SIGINT (a terminated KFP run) deletes the job with
foreground propagation.
"""

from __future__ import annotations

import posixpath
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubeflow.training import TrainingClient, models
from kubeflow.training.constants import constants
from kubeflow.training.utils import utils as sdk_utils
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.train_fsdp.jobspec import naming
from kfp_nvrx.components.train_fsdp.jobspec.pytorchjob import RenderedJob, render
from kfp_nvrx.components.train_fsdp.jobspec.spec import DELETE_AFTER, JobSpec
from kfp_nvrx.components.train_fsdp.launcher.logs import PodLogFollower
from kfp_nvrx.components.train_fsdp.launcher.result import LaunchResult

PLURAL = constants.JOB_PARAMETERS[constants.PYTORCHJOB_KIND]["plural"]
#: Extra time past ``activeDeadlineSeconds`` before the launcher itself gives up, so the
#: operator's own deadline (with its reason) normally ends the job first.
DEADLINE_MARGIN_S = 600.0


class ClusterError(RuntimeError):
    """The cluster refused or could not answer (RBAC, missing CRD, API server down)."""


@dataclass
class K8sOptions:
    """How to follow a job.

    Attributes:
        namespace: Namespace of the job ('' = the client's default namespace).
        deadline_s: Seconds after the job's creation before the launcher gives up (None:
            ``activeDeadlineSeconds`` + :data:`DEADLINE_MARGIN_S`, or no limit).
        delete_after: ``always`` | ``on_success`` | ``never``: delete the job when it ends.
        poll_s: Seconds between job status reads.
        progress_s: Seconds between progress lines (0: on every change).
        tail_lines: Log lines of the failing replica kept in the result.
        watch_timeout_s: Length of one pod watch request.
        handle_signals: Install SIGTERM/SIGINT handlers (main thread only) that delete the job.
        drain_s: Seconds open log streams may run on after the end (last lines of the pods).

    """

    namespace: str = ""
    deadline_s: float | None = None
    delete_after: str = "on_success"
    poll_s: float = 5.0
    progress_s: float = 30.0
    tail_lines: int = 40
    watch_timeout_s: int = 30
    handle_signals: bool = True
    drain_s: float = 5.0


def _ts(value: Any) -> float:
    return value.timestamp() if value is not None else 0.0


def _api_error(action: str, err: Exception) -> ClusterError:
    exc = err.__cause__ if isinstance(err.__cause__, ApiException) else err
    if isinstance(exc, ApiException):
        hint = {401: "credentials were rejected", 403: "RBAC forbids it (see docs/eks.md)",
                404: "is the Training Operator (kubeflow.org/v1 PyTorchJob CRD) installed?"}
        return ClusterError(f"{action}: HTTP {exc.status} {exc.reason}. "
                            f"{hint.get(exc.status, '')} {str(exc.body or '')[:300]}".strip())
    return ClusterError(f"{action}: {' '.join(str(err).split()) or type(err).__name__}")


class _Job:
    """Thin wrapper of the SDK calls on one PyTorchJob."""

    def __init__(self, tc: TrainingClient, name: str, namespace: str) -> None:
        self.tc, self.name, self.namespace = tc, name, namespace

    def get(self) -> models.KubeflowOrgV1PyTorchJob | None:
        """Read the job (typed SDK model); None when it does not exist."""
        try:
            raw = self.tc.custom_api.get_namespaced_custom_object(
                constants.GROUP, constants.VERSION, self.namespace, PLURAL, self.name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise _api_error(f"reading PyTorchJob {self.namespace}/{self.name}", err) from None
        return self.tc.api_client.deserialize(sdk_utils.FakeResponse(raw),
                                              constants.PYTORCHJOB_MODEL)

    def create(self, job: models.KubeflowOrgV1PyTorchJob) -> bool:
        """Create the job; False when one with this name appeared meanwhile (HTTP 409)."""
        try:
            self.tc.create_job(job=job, namespace=self.namespace)
        except RuntimeError as err:
            if isinstance(err.__cause__, ApiException) and err.__cause__.status == 409:
                return False
            raise _api_error(f"creating PyTorchJob {self.namespace}/{self.name}", err) from None
        return True

    def delete(self) -> None:
        """Delete with foreground propagation (pods go before the job object)."""
        try:
            self.tc.delete_job(self.name, self.namespace,
                               delete_options=k8s.V1DeleteOptions(propagation_policy="Foreground"))
        except RuntimeError as err:
            if isinstance(err.__cause__, ApiException) and err.__cause__.status == 404:
                return
            raise _api_error(f"deleting PyTorchJob {self.namespace}/{self.name}", err) from None


def _final_condition(job: models.KubeflowOrgV1PyTorchJob) -> Any:
    for cond in (job.status and job.status.conditions) or []:
        if cond.type in ("Succeeded", "Failed") and cond.status == "True":
            return cond
    return None


def _latest_condition(job: models.KubeflowOrgV1PyTorchJob) -> str:
    conds = [c for c in (job.status and job.status.conditions) or [] if c.status == "True"]
    return conds[-1].type if conds else "Pending"


def _attach_or_create(jobs: _Job, rendered: RenderedJob, spec: JobSpec,
                      log: Callable[[str], None]) -> tuple[models.KubeflowOrgV1PyTorchJob, bool]:
    """Return (job, attached): the existing job of this run, or a newly created one."""
    for _ in range(3):
        existing = jobs.get()
        if existing is not None and existing.metadata.deletion_timestamp is not None:
            log(f"PyTorchJob {jobs.name} is being deleted; waiting for it to go")
            for _ in range(120):
                time.sleep(1.0)
                if jobs.get() is None:
                    break
            existing = jobs.get()
        if existing is not None:
            owner = (existing.metadata.annotations or {}).get(naming.RUN_ID_KEY, "")
            if spec.run_id and owner == spec.run_id:
                log(f"re-attaching to PyTorchJob {jobs.namespace}/{jobs.name} (run {owner})")
                return existing, True
            raise UserError("--name", f"PyTorchJob {jobs.namespace}/{jobs.name} already exists "
                            f"and belongs to run {owner or '(none)'!r}, not "
                            f"{spec.run_id or '(none)'!r}; delete it or choose another --name")
        if jobs.create(rendered.job):
            log(f"created PyTorchJob {jobs.namespace}/{jobs.name}: {rendered.max_nodes} x "
                f"{spec.instance_type} ({rendered.procs_per_node} procs each), run dir "
                f"{rendered.run_dir}")
            created = jobs.get()
            if created is not None:
                return created, False
    raise ClusterError(f"PyTorchJob {jobs.namespace}/{jobs.name} could not be created or read")


class StopSignals:
    """SIGTERM/SIGINT -> an Event, while inside the ``with`` block (main thread only)."""

    def __init__(self, enabled: bool) -> None:
        self.event = threading.Event()
        self.signum = 0
        self._enabled = enabled and threading.current_thread() is threading.main_thread()
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, _frame: Any) -> None:
        self.signum = signum
        self.event.set()

    def __enter__(self) -> StopSignals:
        if self._enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def launch_kubernetes(spec: JobSpec, opts: K8sOptions | None = None, *,
                      log: Callable[[str], None] = print,
                      client_configuration: k8s.Configuration | None = None,
                      training_client: TrainingClient | None = None) -> LaunchResult:
    """Run ``spec`` as a PyTorchJob and follow it to its end.

    Args:
        spec: The job. Rendered and validated before anything is sent to the cluster.
        opts: Namespace, deadline, delete_after, polling.
        log: Sink for log lines and progress (called from several threads, one line per call).
        client_configuration: Kubernetes client configuration (None: kubeconfig or in-cluster).
        training_client: A ready TrainingClient (overrides ``client_configuration``).

    Returns:
        The result: ``Succeeded``, ``Failed``, ``DeadlineExceeded`` or ``Cancelled``.

    Raises:
        UserError: Bad input or a name clash with another run's job (nothing is created).
        ClusterError: The cluster refused a call (RBAC, missing CRD, unreachable).

    """
    opts = opts or K8sOptions()
    if opts.delete_after not in DELETE_AFTER:
        raise UserError("--delete-after", f"must be one of {', '.join(DELETE_AFTER)}, "
                        f"got {opts.delete_after!r}")
    rendered = render(spec)
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            log(line)

    if training_client is None:
        kwargs: dict[str, Any] = {"client_configuration": client_configuration}
        if opts.namespace:
            kwargs["namespace"] = opts.namespace
        try:
            training_client = TrainingClient(**kwargs)
        except Exception as err:  # noqa: BLE001 - no kubeconfig / not in a cluster
            raise ClusterError(f"no Kubernetes credentials: {' '.join(str(err).split())}") from None
    namespace = opts.namespace or spec.namespace or training_client.namespace
    rendered.job.metadata.namespace = namespace
    jobs = _Job(training_client, rendered.name, namespace)
    with StopSignals(opts.handle_signals) as signals:
        job, attached = _attach_or_create(jobs, rendered, spec, say)
        follower = PodLogFollower(training_client.core_api, namespace, rendered.name, emit=say,
                                  watch_timeout_s=opts.watch_timeout_s)
        follower.start()
        try:
            result = _follow(jobs, job, rendered, opts, follower, signals, say)
        finally:
            follower.stop(drain_s=0.0 if signals.event.is_set() else opts.drain_s)
    fill_failure(result, follower, training_client.core_api, namespace, opts.tail_lines)
    result.pod_restarts = follower.pod_restarts()
    result.restarts = follower.progress.restarts
    result.extra.update(attached=attached, namespace=namespace, pvc=spec.pvc,
                        run_dir_uri=f"pvc://{spec.pvc}/"
                        f"{posixpath.relpath(rendered.run_dir, spec.mount)}",
                        progress=follower.progress.summary())
    if should_delete(result.state, opts.delete_after):
        jobs.delete()
        say(f"deleted PyTorchJob {namespace}/{rendered.name} (propagationPolicy=Foreground)")
    return result


def should_delete(state: str, delete_after: str) -> bool:
    """Apply ``delete_after``; a cancelled run always deletes (it must not leave GPUs busy)."""
    if state == "Cancelled":
        return True
    if delete_after == "never":
        return False
    # on_success also deletes a job the launcher stopped following at its deadline: nobody would
    # be watching it any more. A Failed job is kept for inspection (until its TTL).
    return delete_after == "always" or state in ("Succeeded", "DeadlineExceeded")


def _follow(jobs: _Job, job: models.KubeflowOrgV1PyTorchJob, rendered: RenderedJob,
            opts: K8sOptions, follower: PodLogFollower, signals: StopSignals,
            say: Callable[[str], None]) -> LaunchResult:
    """Poll the job until it ends, the deadline passes or a signal arrives."""
    created = _ts(job.metadata.creation_timestamp) or time.time()
    deadline_s = opts.deadline_s
    if deadline_s is None and rendered.job.spec.run_policy.active_deadline_seconds:
        deadline_s = rendered.job.spec.run_policy.active_deadline_seconds + DEADLINE_MARGIN_S
    result = LaunchResult(name=rendered.name, backend="kubernetes", state="Running",
                          run_dir=rendered.run_dir, started_at=created)
    last_state, last_progress, last_summary, errors = "", 0.0, "", 0
    while True:
        if signals.event.is_set():
            name = signal.Signals(signals.signum).name if signals.signum else "signal"
            say(f"{name} received: deleting PyTorchJob {jobs.namespace}/{jobs.name}")
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
            result.state, result.reason = "Failed", "the PyTorchJob was deleted by someone else"
            break
        job = current
        state = _latest_condition(job)
        if state != last_state:
            say(f"PyTorchJob {jobs.name}: {state}")
            last_state = state
            if state == "Running" and "time_to_running_s" not in result.extra:
                result.extra["time_to_running_s"] = round(time.time() - created, 1)
        final = _final_condition(job)
        if final is not None:
            result.state = final.type
            if final.type == "Failed":
                result.reason = f"{final.reason or 'Failed'}: {final.message or ''}".strip(": ")
            result.finished_at = _ts(job.status.completion_time) or _ts(
                final.last_transition_time) or time.time()
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


def fill_failure(result: LaunchResult, follower: PodLogFollower, core: k8s.CoreV1Api,
                  namespace: str, lines: int) -> None:
    """Name the failing replica and attach its last log lines to a non-success result."""
    if result.succeeded or result.state == "Cancelled":
        return
    pod = follower.failed_pod()
    if pod is None:
        return
    result.extra["failed_replica"] = pod.replica
    result.reason += f" ({pod.replica} exited with code {pod.exit_code}" + (
        f", {pod.exit_reason})" if pod.exit_reason else ")")
    tail = follower.tail(pod.name, lines)
    if not tail:
        try:
            text = core.read_namespaced_pod_log(pod.name, namespace, container=follower.container,
                                                tail_lines=lines)
            tail = [t for t in (text or "").splitlines() if t]
        except ApiException:
            tail = []
    result.last_log_lines = tail
