"""Which refusals of a TrainJob's JobSet end the launch (Trainer v2.3 says them only as Events).

A refusal by admission is final for the TrainJob and its runtime, except the one a webhook makes
from a stale cache: Kueue v0.17's JobSet webhook looks up the owner TrainJob in its informer
cache and refuses with 'TrainJob.trainer.kubeflow.org "<name>" not found' when the Trainer was
faster (three cluster tests failed on it in one CI run, though the Trainer's next try was
accepted and the pods ran).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kubernetes import client as k8s

from kfp_nvrx.components.launch.jobspec.resolve import resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.trainjob.follow import CREATION_FAILED, FollowedTrainJob

NAME = "tj-refused"
STALE = (f'TrainJob resources reconciliation failed: admission webhook "mjobset.kb.io" denied '
         f'the request: TrainJob.trainer.kubeflow.org "{NAME}" not found')
REFUSED = ('TrainJob resources reconciliation failed: admission webhook "vjobset.kb.io" denied '
           'the request: spec.failurePolicy.rules[0].name: Invalid value: "a-b"')


class _Events:
    """CoreV1Api's event list, answering the Trainer's Warning Events of this TrainJob."""

    def __init__(self, messages: list[str]) -> None:
        self.messages, self.selectors = messages, []

    def list_namespaced_event(self, namespace: str, field_selector: str = "", **_kw):
        self.selectors.append(field_selector)
        return SimpleNamespace(items=[SimpleNamespace(message=m) for m in self.messages])


def _followed(messages: list[str]) -> tuple[FollowedTrainJob, list[str], _Events]:
    said: list[str] = []
    job = resolve(JobSpec(name=NAME, namespace="team-a", pvc="fsx-claim", image="trainer:1"))
    followed = FollowedTrainJob(k8s.ApiClient(), job, said.append)
    events = _Events(messages)
    followed.core = events
    return followed, said, events


def _trainjob(jobs_status: list | None = None) -> dict:
    return {"metadata": {"name": NAME, "uid": "u-1"},
            "spec": {"runtimeRef": {"kind": "TrainingRuntime", "name": "kfp-nvrx-ft"}},
            "status": {"jobsStatus": jobs_status} if jobs_status else {}}


def test_a_refusal_from_a_stale_cache_is_said_and_followed_on() -> None:
    followed, said, events = _followed([STALE])
    assert followed.blocked(_trainjob()) is None
    assert len(said) == 1 and CREATION_FAILED in said[0] and f'"{NAME}" not found' in said[0]
    assert events.selectors == [f"involvedObject.uid=u-1,reason={CREATION_FAILED}"]
    assert followed.blocked(_trainjob()) is None and len(said) == 1  # said once


@pytest.mark.parametrize("messages", [[REFUSED], [STALE, REFUSED]])
def test_a_refusal_by_admission_fails_the_job_naming_the_runtime(messages) -> None:
    followed, _said, _events = _followed(messages)
    outcome = followed.blocked(_trainjob())
    assert outcome is not None and outcome.state == "Failed"
    assert outcome.reason.startswith(f"{CREATION_FAILED}: ") and "vjobset.kb.io" in outcome.reason
    assert "TrainingRuntime kfp-nvrx-ft builds an object the cluster refuses" in outcome.reason


def test_another_trainjobs_name_not_found_is_no_stale_cache() -> None:
    other = STALE.replace(f'"{NAME}"', '"tj-refused-2"')
    followed, _said, _events = _followed([other])
    assert followed.blocked(_trainjob()) is not None


def test_once_the_jobset_exists_nothing_is_blocked() -> None:
    followed, said, events = _followed([REFUSED])
    assert followed.blocked(_trainjob([{"name": "node", "ready": 0}])) is None
    assert not events.selectors and not said
