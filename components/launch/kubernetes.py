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

from collections.abc import Callable
from typing import Any

from kubeflow.training import TrainingClient, models
from kubeflow.training.constants import constants
from kubeflow.training.utils import utils as sdk_utils
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from kfp_nvrx.components.launch import k8s_api, k8s_http, k8s_job
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec.pytorchjob import RenderedJob, render
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.k8s_config import check_kubeconfig
from kfp_nvrx.components.launch.kueue import KueueReads, with_default_queue
from kfp_nvrx.components.launch.logs import PodLogFollower
from kfp_nvrx.components.launch.result import LaunchResult

PLURAL = constants.JOB_PARAMETERS[constants.PYTORCHJOB_KIND]["plural"]
CRD = "the Training Operator (kubeflow.org/v1 PyTorchJob CRD)"


def _ts(value: Any) -> float:
    return value.timestamp() if value is not None else 0.0


class _Job:
    """The API calls on one PyTorchJob and the readings of its typed model (a :class:`JobAPI`).

    The calls go to ``CustomObjectsApi`` directly, not through ``TrainingClient.create_job`` /
    ``delete_job``: those wrap every failure in a ``RuntimeError`` whose text drops the reason
    (connection refused, an HTML login page), and :mod:`.k8s_api` needs the original.
    """

    kind = "PyTorchJob"
    propagation = "Foreground"
    controller = "the Training Operator (kubectl -n kubeflow get deploy training-operator)"

    def __init__(self, tc: TrainingClient, name: str, namespace: str) -> None:
        self.tc, self.name, self.namespace = tc, name, namespace
        self.where = f"PyTorchJob {namespace}/{name}"
        # tc.api_client is the SDK's own (a default localhost one, used for its models only).
        self.host = k8s_api.host_of(tc.custom_api.api_client)
        self._hints = k8s_job.hints(CRD)

    def _call(self, action: str, fn: Any, *args: Any, ok: tuple[int, ...] = (),
              **kwargs: Any) -> Any:
        return k8s_api.call(f"{action} {self.where}", self.host, fn, constants.GROUP,
                            constants.VERSION, self.namespace, PLURAL, *args, ok=ok,
                            hints=self._hints, **kwargs)

    def get(self) -> models.KubeflowOrgV1PyTorchJob | None:
        """Read the job (typed SDK model); None when it does not exist."""
        try:
            raw = self._call("reading", self.tc.custom_api.get_namespaced_custom_object,
                             self.name, ok=(404,))
        except ApiException:
            return None
        raw = k8s_api.expect_object(raw, f"reading {self.where}", self.host)
        return self.tc.api_client.deserialize(sdk_utils.FakeResponse(raw),
                                              constants.PYTORCHJOB_MODEL)

    def create(self, job: models.KubeflowOrgV1PyTorchJob) -> bool:
        """Create the job; False when one with this name appeared meanwhile (HTTP 409)."""
        try:
            resp = self._call("creating", self.tc.custom_api.create_namespaced_custom_object,
                              job, ok=(409,))
        except ApiException:
            return False
        k8s_api.expect_object(resp, f"creating {self.where}", self.host)
        return True

    def delete(self) -> None:
        """Delete with foreground propagation (pods go before the job object)."""
        try:
            self._call("deleting", self.tc.custom_api.delete_namespaced_custom_object,
                       self.name,
                       body=k8s.V1DeleteOptions(propagation_policy=self.propagation), ok=(404,))
        except ApiException:
            return

    def gone(self) -> bool:
        """Foreground: the job object goes last, after its pods."""
        return self.get() is None

    def created_at(self, job: models.KubeflowOrgV1PyTorchJob) -> float:
        return _ts(job.metadata.creation_timestamp)

    def being_deleted(self, job: models.KubeflowOrgV1PyTorchJob) -> bool:
        return job.metadata.deletion_timestamp is not None

    def run_owner(self, job: models.KubeflowOrgV1PyTorchJob) -> str:
        return (job.metadata.annotations or {}).get(naming.RUN_ID_KEY, "")

    def state(self, job: models.KubeflowOrgV1PyTorchJob) -> str:
        conds = [c for c in (job.status and job.status.conditions) or [] if c.status == "True"]
        return conds[-1].type if conds else "Pending"

    def outcome(self, job: models.KubeflowOrgV1PyTorchJob) -> k8s_job.Outcome | None:
        for cond in (job.status and job.status.conditions) or []:
            if cond.type in ("Succeeded", "Failed") and cond.status == "True":
                failed = cond.type == "Failed"
                reason = k8s_job.failure_reason(cond.reason, cond.message) if failed else ""
                return k8s_job.Outcome(cond.type, reason, _ts(job.status.completion_time)
                                       or _ts(cond.last_transition_time))
        return None

    def creation_warnings(self) -> list[str]:
        """Why the operator could not create pods (quota, admission): its FailedCreatePod."""
        return [f"{m} (FailedCreatePod on {self.where})" for m in k8s_api.warning_events(
            self.tc.core_api, self.namespace, self.host, self.kind, self.name,
            "FailedCreatePod")]

    def has_status(self, job: models.KubeflowOrgV1PyTorchJob) -> bool:
        return bool(job.status and job.status.conditions)

    def suspended(self, job: models.KubeflowOrgV1PyTorchJob) -> bool:
        return bool(job.spec and job.spec.run_policy and job.spec.run_policy.suspend)

    def uid(self, job: models.KubeflowOrgV1PyTorchJob) -> str:
        return job.metadata.uid or ""

    def blocked(self, job: models.KubeflowOrgV1PyTorchJob) -> k8s_job.Outcome | None:
        """Never: the Training Operator reports its failures as job conditions."""
        return None


def bound_training_client(tc: TrainingClient) -> TrainingClient:
    """Bounds every call ``tc`` makes (:mod:`.k8s_http`: time, size, no redirects, signals)."""
    for api in (tc.custom_api, tc.core_api):
        k8s_http.bound(api.api_client)
    return tc


def training_client_for(client_configuration: k8s.Configuration | None,
                        namespace: str) -> TrainingClient:
    """A TrainingClient for ``namespace`` whose every call is bounded.

    Raises:
        ClusterError: No credentials could be loaded (one line).
    """
    if client_configuration is None:  # the SDK loads the kubeconfig itself: checked first
        check_kubeconfig(None)
    try:
        tc = TrainingClient(client_configuration=client_configuration, namespace=namespace)
    except Exception as err:  # noqa: BLE001 - no kubeconfig / not in a cluster
        raise k8s_job.ClusterError(
            f"no Kubernetes credentials: {' '.join(str(err).split())}") from None
    return bound_training_client(tc)


def launch_kubernetes(spec: RenderedJob | ResolvedJob | JobSpec, opts: k8s_job.K8sOptions | None = None, *,
                      log: Callable[[str], None] = print,
                      client_configuration: k8s.Configuration | None = None,
                      training_client: TrainingClient | None = None) -> LaunchResult:
    """Run ``spec`` as a PyTorchJob and follow it to its end.

    Args:
        spec: The job as rendered, or one to render (a JobSpec is resolved first): rendered
            and validated before anything is sent to the cluster.
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
    run = k8s_job.JobRun(opts, log)
    rendered = spec if isinstance(spec, RenderedJob) else render(spec)
    job = rendered.resolved
    k8s_api.configure(client_configuration)
    if training_client is None:
        # The SDK's own default is the service account's namespace or "default"; a user
        # outside a pod means the kubeconfig context's namespace, as kubectl does.
        training_client = training_client_for(client_configuration, run.opts.namespace
                                              or job.namespace or k8s_api.current_namespace())
    bound_training_client(training_client)
    namespace = run.opts.namespace or job.namespace or training_client.namespace
    queued = with_default_queue(training_client.custom_api.api_client, namespace, job, run.say)
    if queued is not None:
        rendered, job = render(queued), queued
    rendered.job.metadata.namespace = namespace
    follower = PodLogFollower(training_client.core_api, namespace, job.name, emit=run.say,
                              watch_timeout_s=run.opts.watch_timeout_s)
    queue = None if job.queue is None else KueueReads(
        training_client.custom_api.api_client, namespace, job.queue, run.say)
    return run.run(_Job(training_client, job.name, namespace), rendered.job, job, follower,
                   queue=queue,
                   describe=f"{job.max_nodes} x {job.profile.name} "
                   f"({job.procs_per_node} procs each), run dir {job.run_dir}",
                   active_deadline_s=job.pod.active_deadline_s)
