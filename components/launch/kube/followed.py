"""One job the launcher follows on a cluster: the calls on its object, and the readings of it.

Every job API's object is a custom resource read and written through ``CustomObjectsApi`` as a
plain dict, so the calls (get, create, delete) and the readings every job object shares (creation
time, deletion, owning run, uid) live here once, in :class:`FollowedJob`. A job API's
``follow.py`` subclasses it with what its controller writes (state, final condition, suspension,
the events that say why no pod was made) and which pods are the job's (:class:`JobPods`).

The calls do not go through an SDK's ``create_job`` / ``delete_job``: those wrap every failure in
an exception whose text drops the reason (connection refused, an HTML login page), and
:mod:`.calls` needs the original.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, NamedTuple

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
from kfp_nvrx.components.launch.kube import calls


@dataclass(frozen=True)
class Resource:
    """A job API's custom resource.

    Attributes:
        group, version, plural, kind: As the API server serves it.
        served_by: Who installs it, in words ("Kubeflow Trainer v2").
    """

    group: str
    version: str
    plural: str
    kind: str
    served_by: str

    @property
    def api_version(self) -> str:
        """``<group>/<version>``."""
        return f"{self.group}/{self.version}"


class Outcome(NamedTuple):
    """A job's final condition: ``Succeeded``/``Failed``, the reason, when (0.0: unknown)."""

    state: str
    reason: str
    finished_at: float


@dataclass(frozen=True)
class JobPods:
    """Which pods are one job's, and how their log lines are named.

    Attributes:
        job: The job's name.
        selector: Label selector of the job's pods.
        container: The trainer container to follow.
        replica: Names a pod's replica for the line prefix (``worker-1``, ``node-1``).
        first_success_ends_job: One pod exiting 0 ends the job (a PyTorchJob with an
            ``elasticPolicy``: the operator marks it Succeeded, and ``cleanPodPolicy: Running``
            stops the pods still running). A pod that then ends non-zero is no failure, and is
            not said to be one. Not a TrainJob's: its JobSet succeeds when every pod has.
        restart_of: The job-wide restart a pod was made by (a JobSet's restart attempt: each
            recreates every pod of the job, one restart however many replicas; the count is
            the job's own, on its pods); None where the job API keeps no such count.
    """

    job: str
    selector: str
    container: str
    replica: Callable[[k8s.V1Pod], str]
    first_success_ends_job: bool
    restart_of: Callable[[k8s.V1Pod], int | None] = lambda _pod: None


def failure_reason(reason: str | None, message: str | None) -> str:
    """``<reason>: <message>`` of a Failed condition, without empty parts."""
    return f"{reason or 'Failed'}: {message or ''}".strip(": ")


def timestamp(text: str | None) -> float:
    """Unix time of an API timestamp (``2026-01-02T03:04:05Z``); 0.0 when there is none."""
    if not text:
        return 0.0
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def condition(job: dict[str, Any], types: tuple[str, ...]) -> dict[str, Any] | None:
    """The first True condition of one of ``types`` in the job's status (None: none)."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in types and cond.get("status") == "True":
            return cond
    return None


def true_conditions(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's True conditions, oldest first."""
    return [c for c in (job.get("status") or {}).get("conditions") or []
            if c.get("status") == "True"]


class FollowedJob:
    """The API calls on one named job object and the readings of it (the shared part).

    Args:
        client: A bounded ``ApiClient`` (:class:`.cluster.Cluster`).
        job: The resolved job, in its namespace.
        say: Sink for the lines a reading says once (a controller's warning).
    """

    #: The job API's custom resource.
    resource: ClassVar[Resource]
    #: What to name when a call answers 404 ("Is <crd> installed?").
    crd: ClassVar[str]
    #: Who should have set the job's status ("the Training Operator ...").
    controller: ClassVar[str]
    #: The deletion's ``propagationPolicy``.
    propagation: ClassVar[str] = "Foreground"

    def __init__(self, client: Any, job: ResolvedJob, say: Callable[[str], None]) -> None:
        self.custom, self.core = k8s.CustomObjectsApi(client), k8s.CoreV1Api(client)
        self.job, self.say = job, say
        self.kind, self.name, self.namespace = self.resource.kind, job.name, job.namespace
        self.where = f"{self.kind} {self.namespace}/{self.name}"
        self.host = calls.host_of(client)
        self._hints = calls.hints(self.crd)

    # -- the calls ------------------------------------------------------------------------------

    def _call(self, action: str, fn: Any, *args: Any, ok: tuple[int, ...] = (),
              **kwargs: Any) -> Any:
        res = self.resource
        return calls.call(f"{action} {self.where}", self.host, fn, res.group, res.version,
                          self.namespace, res.plural, *args, ok=ok, hints=self._hints, **kwargs)

    def get(self) -> dict[str, Any] | None:
        """Read the job; None when it does not exist. Raises :class:`.calls.ClusterError`."""
        try:
            resp = self._call("reading", self.custom.get_namespaced_custom_object, self.name,
                              ok=(404,))
        except ApiException:
            return None
        return calls.expect_object(resp, f"reading {self.where}", self.host)

    def create(self, body: dict[str, Any]) -> bool:
        """Create the job; False when one with this name appeared meanwhile (HTTP 409)."""
        try:
            resp = self._call("creating", self.custom.create_namespaced_custom_object, body,
                              ok=(409,))
        except ApiException:
            return False
        calls.expect_object(resp, f"creating {self.where}", self.host)
        return True

    def delete(self) -> None:
        """Delete the job and, through the garbage collector, what its controller made."""
        try:
            self._call("deleting", self.custom.delete_namespaced_custom_object, self.name,
                       body=k8s.V1DeleteOptions(propagation_policy=self.propagation), ok=(404,))
        except ApiException:
            return

    def gone(self) -> bool:
        """True once the job is gone (foreground: the job object goes last, after its pods)."""
        return self.get() is None

    # -- readings every job object shares -------------------------------------------------------

    def created_at(self, job: dict[str, Any]) -> float:
        """Unix time of the job's creation (0.0: unknown)."""
        return timestamp(job["metadata"].get("creationTimestamp"))

    def being_deleted(self, job: dict[str, Any]) -> bool:
        """True when the job has a deletion timestamp."""
        return bool(job["metadata"].get("deletionTimestamp"))

    def run_owner(self, job: dict[str, Any]) -> str:
        """The KFP run id the job was created for ('' when none)."""
        return (job["metadata"].get("annotations") or {}).get(naming.RUN_ID_KEY, "")

    def uid(self, job: dict[str, Any]) -> str:
        """The job's uid (its Kueue Workload carries it as a label)."""
        return str(job["metadata"].get("uid") or "")

    def blocked(self, job: dict[str, Any]) -> Outcome | None:
        """A failure the controller only reports in Events (the job never gets a condition)."""
        return None

    # -- what each job API's controller writes --------------------------------------------------

    @property
    def pods(self) -> JobPods:
        """Which pods are the job's."""
        raise NotImplementedError

    def state(self, job: dict[str, Any]) -> str:
        """The state to report while following (``Pending``, ``Running``, ...)."""
        raise NotImplementedError

    def outcome(self, job: dict[str, Any]) -> Outcome | None:
        """The final condition, None while the job runs."""
        raise NotImplementedError

    def has_status(self, job: dict[str, Any]) -> bool:
        """Whether a controller has written the job's status."""
        raise NotImplementedError

    def suspended(self, job: dict[str, Any]) -> bool:
        """Whether the job's spec suspends it (Kueue holds a job it has not admitted so)."""
        raise NotImplementedError

    def creation_warnings(self) -> list[str]:
        """Why the job's pods could not be created (quota, admission), from Warning Events."""
        raise NotImplementedError
