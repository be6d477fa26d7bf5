"""The reads of a queued job's Kueue objects answer the way the API server does (issue 31.2-3):
a missing LocalQueue or WorkloadPriorityClass is bad input, a cluster without Kueue is said so,
a read RBAC forbids is said once and the job goes on without it.

The real answers of a real API server: tests/cluster/test_kueue.py.
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.queue import Queue
from kfp_nvrx.components.launch.kube.kueue import JOB_UID_LABEL, KueueReads


def _status(code: int, message: str) -> ApiException:
    err = ApiException(status=code, reason={403: "Forbidden", 404: "Not Found"}[code])
    err.body = json.dumps({"kind": "Status", "message": message, "code": code})
    return err


class Custom:
    """CustomObjectsApi stand-in: each (plural) answers an object or raises."""

    def __init__(self, answers: dict) -> None:
        self.answers, self.calls = answers, []

    def _answer(self, plural: str, **kw):
        self.calls.append((plural, kw))
        value = self.answers[plural]
        if isinstance(value, Exception):
            raise value
        return value

    def get_namespaced_custom_object(self, group, version, ns, plural, name, **kw):
        return self._answer(plural, **kw)

    def get_cluster_custom_object(self, group, version, plural, name, **kw):
        return self._answer(plural, **kw)

    def list_namespaced_custom_object(self, group, version, ns, plural, **kw):
        return self._answer(plural, **kw)


def _reads(answers: dict, priority: str = "high") -> tuple[KueueReads, list[str]]:
    said: list[str] = []
    reads = KueueReads(client.ApiClient(), "ns", Queue("team-a", priority), said.append)
    reads.custom = Custom(answers)
    return reads, said


def test_both_exist_and_the_cluster_queue_is_learned() -> None:
    reads, said = _reads({"localqueues": {"spec": {"clusterQueue": "p5"}},
                          "workloadpriorityclasses": {"value": 1000}})
    reads.check()
    assert reads.where == "LocalQueue team-a (ClusterQueue p5)" and not said


@pytest.mark.parametrize("answers,field,says", [
    ({"localqueues": _status(404, 'localqueues.kueue.x-k8s.io "team-a" not found')},
     "queue_name", "no LocalQueue 'team-a' in namespace ns"),
    ({"localqueues": {"spec": {"clusterQueue": "p5"}},
      "workloadpriorityclasses": _status(404, 'workloadpriorityclasses "high" not found')},
     "priority_class", "no WorkloadPriorityClass 'high'"),
    ({"localqueues": _status(404, "the server could not find the requested resource")},
     "queue_name", "serves no Kueue"),
])
def test_what_is_missing_is_bad_input(answers: dict, field: str, says: str) -> None:
    reads, _ = _reads(answers)
    with pytest.raises(UserError) as err:
        reads.check()
    assert err.value.field == field and says in err.value.message


def test_a_forbidden_read_is_said_once_and_not_a_failure() -> None:
    forbidden = _status(403, 'workloadpriorityclasses.kueue.x-k8s.io "high" is forbidden: User '
                        '"system:serviceaccount:ns:kfp-nvrx-launcher" cannot get resource')
    reads, said = _reads({"localqueues": {"spec": {"clusterQueue": "p5"}},
                          "workloadpriorityclasses": forbidden})
    reads.check()
    reads.check()
    assert len(said) == 1 and "HTTP 403" in said[0] and "followed without it" in said[0]


def test_the_workload_is_found_by_the_jobs_uid_and_read_bounded() -> None:
    reads, _ = _reads({"workloads": {"items": [
        {"metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"}, "status": {}},
        {"metadata": {"creationTimestamp": "2026-01-01T00:00:09Z"},
         "status": {"admission": {"clusterQueue": "p5"},
                    "conditions": [{"type": "Admitted", "status": "True"}]}}]}})
    reading = reads.workload("uid-1")
    assert reading.admitted and reads.cluster_queue == "p5"
    ((plural, kw),) = reads.custom.calls
    assert kw["label_selector"] == f"{JOB_UID_LABEL}=uid-1" and kw["limit"] == 5
    assert kw["_request_timeout"]  # bounded like every other call
