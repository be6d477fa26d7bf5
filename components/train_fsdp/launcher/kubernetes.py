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

from kfp_nvrx.components.train_fsdp.jobspec import naming
from kfp_nvrx.components.train_fsdp.jobspec.pytorchjob import render
from kfp_nvrx.components.train_fsdp.jobspec.spec import JobSpec
from kfp_nvrx.components.train_fsdp.launcher import k8s_job
from kfp_nvrx.components.train_fsdp.launcher.logs import PodLogFollower
from kfp_nvrx.components.train_fsdp.launcher.result import LaunchResult

PLURAL = constants.JOB_PARAMETERS[constants.PYTORCHJOB_KIND]["plural"]
CRD = "the Training Operator (kubeflow.org/v1 PyTorchJob CRD)"


def _ts(value: Any) -> float:
    return value.timestamp() if value is not None else 0.0


def _api_error(action: str, err: Exception) -> k8s_job.ClusterError:
    exc = err.__cause__ if isinstance(err.__cause__, ApiException) else err
    if isinstance(exc, ApiException):
        return k8s_job.api_error(action, exc, CRD)
    return k8s_job.ClusterError(f"{action}: {' '.join(str(err).split()) or type(err).__name__}")


class _Job:
    """The SDK calls on one PyTorchJob and the readings of its typed model (a :class:`JobAPI`)."""

    kind = "PyTorchJob"

    def __init__(self, tc: TrainingClient, name: str, namespace: str) -> None:
        self.tc, self.name, self.namespace = tc, name, namespace
        self.where = f"PyTorchJob {namespace}/{name}"

    def get(self) -> models.KubeflowOrgV1PyTorchJob | None:
        """Read the job (typed SDK model); None when it does not exist."""
        try:
            raw = self.tc.custom_api.get_namespaced_custom_object(
                constants.GROUP, constants.VERSION, self.namespace, PLURAL, self.name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise _api_error(f"reading {self.where}", err) from None
        return self.tc.api_client.deserialize(sdk_utils.FakeResponse(raw),
                                              constants.PYTORCHJOB_MODEL)

    def create(self, job: models.KubeflowOrgV1PyTorchJob) -> bool:
        """Create the job; False when one with this name appeared meanwhile (HTTP 409)."""
        try:
            self.tc.create_job(job=job, namespace=self.namespace)
        except RuntimeError as err:
            if isinstance(err.__cause__, ApiException) and err.__cause__.status == 409:
                return False
            raise _api_error(f"creating {self.where}", err) from None
        return True

    def delete(self) -> None:
        """Delete with foreground propagation (pods go before the job object)."""
        try:
            self.tc.delete_job(self.name, self.namespace,
                               delete_options=k8s.V1DeleteOptions(propagation_policy="Foreground"))
        except RuntimeError as err:
            if isinstance(err.__cause__, ApiException) and err.__cause__.status == 404:
                return
            raise _api_error(f"deleting {self.where}", err) from None

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


def launch_kubernetes(spec: JobSpec, opts: k8s_job.K8sOptions | None = None, *,
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
    run = k8s_job.JobRun(opts, log)
    rendered = render(spec)
    if training_client is None:
        kwargs: dict[str, Any] = {"client_configuration": client_configuration}
        if run.opts.namespace:
            kwargs["namespace"] = run.opts.namespace
        try:
            training_client = TrainingClient(**kwargs)
        except Exception as err:  # noqa: BLE001 - no kubeconfig / not in a cluster
            raise k8s_job.ClusterError(
                f"no Kubernetes credentials: {' '.join(str(err).split())}") from None
    namespace = run.opts.namespace or spec.namespace or training_client.namespace
    rendered.job.metadata.namespace = namespace
    follower = PodLogFollower(training_client.core_api, namespace, rendered.name, emit=run.say,
                              watch_timeout_s=run.opts.watch_timeout_s)
    return run.run(_Job(training_client, rendered.name, namespace), rendered.job, spec, follower,
                   run_dir=rendered.run_dir,
                   describe=f"{rendered.max_nodes} x {spec.instance_type} "
                   f"({rendered.procs_per_node} procs each), run dir {rendered.run_dir}",
                   active_deadline_s=rendered.job.spec.run_policy.active_deadline_seconds)
