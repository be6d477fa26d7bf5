"""Kueue settings of a job: the LocalQueue it waits in and its WorkloadPriorityClass.

Kueue (v0.17, ``pkg/controller/constants``) reads both from labels on the job object itself, the
same for a TrainJob and a PyTorchJob: ``kueue.x-k8s.io/queue-name`` names a LocalQueue of the job's
namespace, ``kueue.x-k8s.io/priority-class`` a cluster-scoped WorkloadPriorityClass. Its webhook
refuses a queue name that is not a DNS-1123 subdomain, and a label value has at most 63
characters, so a name is checked against both here. Only the job carries the labels, not its
pods: a cluster that enables Kueue's ``pod`` integration would otherwise see the pods as
workloads of their own.

A priority class without a queue is refused: without a queue Kueue does not manage the job (its
default ``manageJobsWithoutQueueName: false``), so the label would change nothing, and before
Kueue support ``--priority-class`` meant the pods' Kubernetes PriorityClass (now
``pod_priority_class``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kfp_nvrx.components.errors import UserError

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: The LocalQueue Kueue (v0.17: LocalQueueDefaulting, GA) puts every job of a namespace in that
#: names none, when the namespace has one of this name.
DEFAULT_QUEUE = "default"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
#: Kueue's API group and version (the objects the launcher reads while a job is queued).
GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
#: A DNS-1123 subdomain that is also a label value: at most 63 characters.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_NAME = 63


@dataclass(frozen=True)
class Queue:
    """Where Kueue queues a job.

    Attributes:
        name: The LocalQueue (in the job's namespace).
        priority_class: The WorkloadPriorityClass ('' = the queue's default priority).
    """

    name: str
    priority_class: str = ""

    def labels(self) -> dict[str, str]:
        """The labels Kueue reads on the job object."""
        out = {QUEUE_LABEL: self.name}
        if self.priority_class:
            out[PRIORITY_LABEL] = self.priority_class
        return out


def _check_name(field: str, value: str, what: str) -> str:
    if len(value) > MAX_NAME or not _NAME.match(value):
        raise UserError(field, f"{value!r} is not a valid {what} name (lower-case letters, "
                        f"digits, '-' and '.', at most {MAX_NAME} characters: Kueue reads it "
                        "from a label)")
    return value


def resolve_queue(spec: Any) -> Queue | None:
    """The job's queue from a ``JobSpec`` (None: Kueue does not queue it).

    Raises:
        UserError: A bad name, or a priority class without a queue, naming the field.
    """
    name = (spec.queue_name or "").strip()
    priority = (spec.priority_class or "").strip()
    if not name:
        if priority:
            raise UserError("priority_class", f"{priority!r} is a Kueue WorkloadPriorityClass, "
                            "which needs `queue_name` (the LocalQueue the job waits in); for the "
                            "pods' Kubernetes PriorityClass use `pod_priority_class`")
        return None
    _check_name("queue_name", name, "LocalQueue")
    if priority:
        _check_name("priority_class", priority, "WorkloadPriorityClass")
    return Queue(name, priority)


def refuse_local(spec: Any) -> None:
    """The local backend has no cluster, so no queue: refuse one, naming the field."""
    if (spec.queue_name or "").strip() or (spec.priority_class or "").strip():
        field = "queue_name" if (spec.queue_name or "").strip() else "priority_class"
        raise UserError(field, "is a Kueue setting of a Kubernetes job; the local backend runs "
                        "on this machine, where nothing queues (use backend kubernetes)")
