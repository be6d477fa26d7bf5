"""Kueue settings of a job: the labels Kueue reads, on the job only; what is refused (issue 31.2).

The real webhooks' answer to these labels is tests/cluster/test_kueue.py's.
"""

from __future__ import annotations

import pytest
from kubernetes import client
from support.golden_specs import IMAGE
from support.rendering import render_pytorchjob, render_trainjob

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch import backends
from kfp_nvrx.components.launch.jobspec.queue import PRIORITY_LABEL, QUEUE_LABEL
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.options import LocalOptions
from kfp_nvrx.components.launch.trainjob import runtime as rt

QUEUED = {"queue_name": "team-a", "priority_class": "high"}


def _spec(**kw) -> JobSpec:
    return JobSpec(image=IMAGE, pvc="fsx", name="job", nodes="2", instance_type="cpu", **kw)


def _trainjob(**kw) -> dict:
    return render_trainjob(_spec(**kw)).to_dict()


def _pytorchjob(**kw) -> dict:
    return client.ApiClient().sanitize_for_serialization(render_pytorchjob(_spec(**kw)).job)


def _trainjob_pod(job: dict) -> dict:
    return job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]


@pytest.mark.parametrize("render,pod", [
    (_trainjob, _trainjob_pod),
    (_pytorchjob, lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]),
])
def test_labels_on_the_job_not_on_its_pods(render, pod) -> None:
    job = render(**QUEUED)
    assert job["metadata"]["labels"][QUEUE_LABEL] == "team-a"
    assert job["metadata"]["labels"][PRIORITY_LABEL] == "high"
    assert not {QUEUE_LABEL, PRIORITY_LABEL} & set(pod(job)["metadata"]["labels"])
    plain = render()
    assert not {QUEUE_LABEL, PRIORITY_LABEL} & set(plain["metadata"]["labels"])
    no_priority = render(queue_name="team-a")
    assert PRIORITY_LABEL not in no_priority["metadata"]["labels"]


def test_a_queued_trainjob_takes_the_runtimes_grace_period() -> None:
    """Kueue v0.17 drops a TrainJob's own grace period (see jobspec.trainjob): not rendered."""
    assert "terminationGracePeriodSeconds" in _trainjob_pod(_trainjob())["spec"]
    assert "terminationGracePeriodSeconds" not in _trainjob_pod(_trainjob(**QUEUED))["spec"]
    pod = rt.build_runtime()["spec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == rt.GRACE_PERIOD_S
    # The PyTorchJob keeps it: Kueue knows every field of its pod template.
    assert _pytorchjob(**QUEUED)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
        "terminationGracePeriodSeconds"]


def test_a_queued_trainjob_needing_more_grace_than_the_runtime_is_refused() -> None:
    with pytest.raises(UserError) as err:
        _trainjob(overrides=["resilience.workers_stop_timeout=900"], **QUEUED)
    assert err.value.field == "queue_name" and f"({rt.GRACE_PERIOD_S} s" in err.value.message
    _trainjob(overrides=["resilience.workers_stop_timeout=900"])  # not queued: its own grace
    _pytorchjob(overrides=["resilience.workers_stop_timeout=900"], **QUEUED)


@pytest.mark.parametrize("change,field,says", [
    ({"priority_class": "high"}, "priority_class", "`queue_name`"),
    ({"queue_name": "Team_A"}, "queue_name", "at most 63"),
    ({"queue_name": "q" * 64}, "queue_name", "at most 63"),
    ({"queue_name": "team-a", "priority_class": "High"}, "priority_class", "lower-case"),
])
def test_names_kueue_cannot_read_are_refused(change: dict, field: str, says: str) -> None:
    for render in (render_trainjob, render_pytorchjob):
        with pytest.raises(UserError) as err:
            render(_spec(**change))
        assert err.value.field == field and says in err.value.message
        assert "\n" not in str(err.value)


def test_the_local_backend_has_no_queue() -> None:
    with pytest.raises(UserError) as err:
        backends.check(JobSpec(run_dir="runs/x", queue_name="team-a"), LocalOptions())
    assert err.value.field == "queue_name"


def test_pod_priority_class_is_the_pods_priority_class_name() -> None:
    job = _pytorchjob(pod_priority_class="training-high")
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
        "priorityClassName"] == "training-high"
    assert PRIORITY_LABEL not in job["metadata"]["labels"]
