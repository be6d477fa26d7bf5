"""The Kueue objects a queued job depends on, read the way the launcher reads everything else.

Before a queued job is created, its LocalQueue and its WorkloadPriorityClass must exist: Kueue
keeps a job whose LocalQueue is missing suspended for good (its Workload says "LocalQueue ...
doesn't exist"), and one whose WorkloadPriorityClass is missing gets no Workload at all, without a
word on the job (Kueue v0.17 logs it only). Both are bad input: one line naming the field, exit 2,
nothing created. While the job is followed, its Workload (``kueue.x-k8s.io/job-uid=<job uid>``)
says why it waits (the ``QuotaReserved`` condition), where it was admitted (``status.admission``)
and why it was evicted (the ``Evicted`` condition: ``Preempted``, ...).

Every call is bounded (:mod:`.calls`); a read the launcher's RBAC forbids is said once and the
job is followed without it (``images/deploy`` grants the reads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.queue import DEFAULT_QUEUE, GROUP, VERSION, Queue
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
from kfp_nvrx.components.launch.kube import calls

JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
#: A job has one Workload; a few more are tolerated (one being replaced), never a whole list.
MAX_WORKLOADS = 5
CRD = "Kueue (kueue.x-k8s.io CRDs)"


@dataclass(frozen=True)
class Reading:
    """What a job's Workload says now.

    Attributes:
        exists: Kueue has made the Workload.
        admitted: Its ``Admitted`` condition is True.
        cluster_queue: Where it is admitted ('' while not).
        waiting: Why it waits (the ``QuotaReserved=False`` message; '' when it does not).
        evicted: ``<reason>: <message>`` of a True ``Evicted`` condition ('' when none).
        admitted_at: Server time of the ``Admitted`` condition's last change (0.0: unknown).
        evicted_at: Server time of the ``Evicted`` condition's last change (0.0: unknown).
    """

    exists: bool = False
    admitted: bool = False
    cluster_queue: str = ""
    waiting: str = ""
    evicted: str = ""
    admitted_at: float = 0.0
    evicted_at: float = 0.0


def _ts(text: str | None) -> float:
    from datetime import datetime

    if not text:
        return 0.0
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _one_line(text: object, limit: int = 300) -> str:
    return " ".join(str(text or "").split())[:limit]


def read_workload(workload: dict[str, Any] | None) -> Reading:
    """The :class:`Reading` of one Workload object (None: not made yet)."""
    if workload is None:
        return Reading()
    status = workload.get("status") or {}
    conds = {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, dict)}

    def true(kind: str) -> dict[str, Any] | None:
        cond = conds.get(kind)
        return cond if cond is not None and cond.get("status") == "True" else None

    admitted, evicted = true("Admitted"), true("Evicted")
    reserved = conds.get("QuotaReserved") or {}
    waiting = _one_line(reserved.get("message")) if reserved.get("status") == "False" else ""
    return Reading(
        exists=True, admitted=admitted is not None,
        cluster_queue=str((status.get("admission") or {}).get("clusterQueue") or ""),
        waiting=waiting,
        evicted=(f"{evicted.get('reason') or 'Evicted'}: {_one_line(evicted.get('message'))}"
                 if evicted else ""),
        admitted_at=_ts((conds.get("Admitted") or {}).get("lastTransitionTime")),
        evicted_at=_ts((conds.get("Evicted") or {}).get("lastTransitionTime")))


def default_queue(api: k8s.ApiClient, namespace: str) -> Queue | None:
    """Kueue's default LocalQueue of ``namespace``, where it queues every job that names none.

    A probe: None also when it cannot tell (no Kueue, RBAC, an API server that does not answer);
    the launcher's next call reports a server that fails.

    Returns:
        ``Queue("default")`` when the namespace has it, else None.
    """
    custom = k8s.CustomObjectsApi(api)
    try:
        resp = calls.call(f"reading LocalQueue {namespace}/{DEFAULT_QUEUE}", calls.host_of(api),
                            custom.get_namespaced_custom_object, GROUP, VERSION, namespace,
                            "localqueues", DEFAULT_QUEUE, ok=(403, 404))
    except (ApiException, calls.ClusterError):
        return None
    return Queue(DEFAULT_QUEUE) if isinstance(resp, dict) else None


def with_default_queue(api: k8s.ApiClient, job: ResolvedJob,
                       say: Callable[[str], None]) -> ResolvedJob | None:
    """``job`` in its namespace's default LocalQueue, if it needs one; else None.

    It needs one when it names no queue and the namespace has Kueue's default: Kueue labels such
    a job itself when it is created. Rendered as queued from the start, a TrainJob carries no
    grace period Kueue would drop (:mod:`..trainjob.render`), and the launcher follows it as
    queued.
    """
    if job.queue is not None or (queue := default_queue(api, job.namespace)) is None:
        return None
    say(f"namespace {job.namespace} has Kueue's default LocalQueue {queue.name!r}: the job waits "
        "in it for quota (name another with --queue-name)")
    return job.in_queue(queue)


class KueueReads:
    """The reads of one queued job's Kueue objects.

    Args:
        api: A bounded ApiClient (:func:`.calls.api_client`).
        namespace: The job's namespace (its LocalQueue's too).
        queue: The job's queue settings.
        say: Sink for the lines said once (a read RBAC forbids).
    """

    def __init__(self, api: k8s.ApiClient, namespace: str, queue: Queue,
                 say: Callable[[str], None] = print) -> None:
        self.custom = k8s.CustomObjectsApi(api)
        self.host = calls.host_of(api)
        self.namespace, self.queue, self.say = namespace, queue, say
        #: The ClusterQueue the LocalQueue points at ('' until read).
        self.cluster_queue = ""
        self._hints = calls.hints(CRD)
        self._forbidden: set[str] = set()

    @property
    def where(self) -> str:
        """``LocalQueue q (ClusterQueue cq)``, as far as known."""
        cq = f" (ClusterQueue {self.cluster_queue})" if self.cluster_queue else ""
        return f"LocalQueue {self.queue.name}{cq}"

    def _get(self, action: str, fn: Any, *args: Any) -> dict[str, Any] | None:
        """One read; None on a 404 (the caller tells a missing object from a missing Kueue)."""
        try:
            resp = calls.call(action, self.host, fn, GROUP, VERSION, *args, ok=(404,),
                                hints=self._hints)
        except ApiException as err:
            if "could not find the requested resource" in calls.body_text(err.body):
                raise UserError("queue_name", f"{self.queue.name!r}: the cluster serves no Kueue "
                                "(kueue.x-k8s.io/v1beta2 is not installed); leave the queue "
                                "empty or install Kueue") from None
            return None
        return calls.expect_object(resp, action, self.host)

    def _allowed(self, action: str, fn: Any, *args: Any) -> tuple[bool, dict[str, Any] | None]:
        """(read, object): ``read`` is False when RBAC forbids it (said once)."""
        try:
            return True, self._get(action, fn, *args)
        except calls.ClusterError as err:
            if "HTTP 403" not in str(err) or "admission webhook" in str(err):
                raise
            if action not in self._forbidden:
                self._forbidden.add(action)
                self.say(f"warning: {err} (followed without it)")
            return False, None

    def check(self) -> None:
        """Before the job is created: its LocalQueue and WorkloadPriorityClass exist.

        Raises:
            UserError: Either is missing (or the cluster has no Kueue), naming the field.
            ClusterError: The API server refused or could not answer.
        """
        q = self.queue
        read, lq = self._allowed(f"reading LocalQueue {self.namespace}/{q.name}",
                                 self.custom.get_namespaced_custom_object, self.namespace,
                                 "localqueues", q.name)
        if read and lq is None:
            raise UserError("queue_name", f"there is no LocalQueue {q.name!r} in namespace "
                            f"{self.namespace} (kubectl get localqueues -n {self.namespace}); "
                            "Kueue would keep the job waiting for good")
        self.cluster_queue = str(((lq or {}).get("spec") or {}).get("clusterQueue") or "")
        if q.priority_class:
            read, wpc = self._allowed(f"reading WorkloadPriorityClass {q.priority_class}",
                                      self.custom.get_cluster_custom_object,
                                      "workloadpriorityclasses", q.priority_class)
            if read and wpc is None:
                raise UserError("priority_class", f"there is no WorkloadPriorityClass "
                                f"{q.priority_class!r} (kubectl get workloadpriorityclasses); "
                                "Kueue would never queue the job")

    def workload(self, job_uid: str) -> Reading | None:
        """The job's Workload now.

        Returns:
            Its reading (without ``exists`` while Kueue has not made it), or None when it could
            not be read (said once per distinct error).
        """
        if not job_uid:
            return Reading()
        try:
            listed = calls.call(
                f"reading the Workload of {self.namespace}/{job_uid}", self.host,
                self.custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace,
                "workloads", label_selector=f"{JOB_UID_LABEL}={job_uid}", limit=MAX_WORKLOADS,
                hints=self._hints)
        except calls.ClusterError as err:
            forbidden = "HTTP 403" in str(err)
            line = f"warning: {err} ({'followed without it' if forbidden else 'retrying'})"
            if line not in self._forbidden:
                self._forbidden.add(line)
                self.say(line)
            return None
        items = [w for w in (listed or {}).get("items") or [] if isinstance(w, dict)]
        items.sort(key=lambda w: (w.get("metadata") or {}).get("creationTimestamp") or "")
        reading = read_workload(items[-1] if items else None)
        if reading.cluster_queue:
            self.cluster_queue = reading.cluster_queue
        return reading
