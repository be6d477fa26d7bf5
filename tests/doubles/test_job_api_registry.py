"""A third job API is one folder and one registry line: a fake one, registered here, goes the whole way.

``FakeJob`` (defined in this module, as a job API's folder would define it: render, validate,
follow, ``API``) is registered with one line (``job_apis.REGISTRY``) and is then: offered by
``--job-api``; rendered by ``render-job`` through the shared worker pod and validated; refused
what it cannot express, naming the field; chosen by ``auto`` when the cluster serves only it; and
launched, followed and deleted against the Kubernetes API test double by ``kfp-nvrx launch``, with
its pods' logs streamed, exactly like the two real ones. Nothing else of the product is touched.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import k8s_double_http
from support.k8s_double import K8sDouble

from kfp_nvrx.components.cli import main as cli
from kfp_nvrx.components.core.launch_command import FT_LAUNCHER
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch import cluster_launch, job_apis
from kfp_nvrx.components.launch.job_api import Rendered
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec.pod import (
    job_annotations,
    labels,
    pod_spec,
    to_dict,
    trainer_command,
)
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
from kfp_nvrx.components.launch.kube.cluster import api_client
from kfp_nvrx.components.launch.kube.followed import (
    FollowedJob,
    JobPods,
    Outcome,
    Resource,
    condition,
    true_conditions,
)
from kfp_nvrx.components.launch.options import KubernetesOptions

# -- the fake job API: what its folder would hold -----------------------------------------------

RESOURCE = Resource("fake.kfp-nvrx.io", "v1", "fakejobs", "FakeJob", "the fake controller")
JOB_LABEL = "fake.kfp-nvrx.io/job-name"
CONTAINER = "trainer"


@dataclass
class RenderedFakeJob(Rendered):
    """A rendered FakeJob: a plain dict."""

    job: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.job)

    def to_yaml(self, with_runtime: bool = False) -> str:
        return yaml.safe_dump(self.job, sort_keys=False)


def validate(manifest: dict[str, Any]) -> None:
    """What the fake controller's webhook would refuse."""
    if manifest["spec"]["replicas"] < 1:
        raise UserError("spec.replicas", "must be at least 1")


def render(job: ResolvedJob) -> RenderedFakeJob:
    """The shared worker pod (one ft_launcher command builder) as N replicas of a FakeJob."""
    refuse(job)
    command = trainer_command(job, rdzv_endpoint=f"{job.name}-0:29500", rdzv_id=job.name)
    pod = to_dict(pod_spec(job, container_name=CONTAINER, command=command))
    meta: dict[str, Any] = {"name": job.name, "labels": labels(job),
                            "annotations": job_annotations(job)}
    if job.namespace:
        meta["namespace"] = job.namespace
    manifest = {"apiVersion": RESOURCE.api_version, "kind": RESOURCE.kind, "metadata": meta,
                "spec": {"replicas": job.max_nodes, "template": {"spec": pod}}}
    validate(manifest)
    return RenderedFakeJob(resolved=job, job=manifest)


def refuse(job: ResolvedJob) -> None:
    """A FakeJob has a fixed size."""
    if job.elastic:
        raise UserError("nodes", "a FakeJob has a fixed node count; use `nodes=N`")


class FollowedFakeJob(FollowedJob):
    """What the fake controller writes: conditions, like the Training Operator."""

    resource = RESOURCE
    crd = "the fake controller (fake.kfp-nvrx.io FakeJob CRD)"
    controller = "the fake controller"

    @property
    def pods(self) -> JobPods:
        return JobPods(job=self.name, selector=f"{JOB_LABEL}={self.name}", container=CONTAINER,
                       replica=lambda pod: pod.metadata.name, first_success_ends_job=False)

    def state(self, job: dict[str, Any]) -> str:
        conds = true_conditions(job)
        return str(conds[-1]["type"]) if conds else "Pending"

    def outcome(self, job: dict[str, Any]) -> Outcome | None:
        final = condition(job, ("Succeeded", "Failed"))
        return None if final is None else Outcome(final["type"], final.get("reason", ""), 0.0)

    def has_status(self, job: dict[str, Any]) -> bool:
        return bool(job.get("status"))

    def suspended(self, job: dict[str, Any]) -> bool:
        return False

    def creation_warnings(self) -> list[str]:
        return []


class FakeJobApi:
    """The fake job API as the launcher sees it."""

    name = "fakejob"
    resource = RESOURCE

    def refuse(self, job: ResolvedJob, opts: KubernetesOptions) -> None:
        refuse(job)

    def render(self, job: ResolvedJob, opts: KubernetesOptions) -> RenderedFakeJob:
        return render(job)

    def follow(self, job: ResolvedJob, client: Any,
               say: Callable[[str], None]) -> FollowedFakeJob:
        return FollowedFakeJob(client, job, say)


API = FakeJobApi()

# -- the test -------------------------------------------------------------------------------------

JOB = ["--instance-type", "cpu", "--image", "img:1", "--pvc", "fsx", "--nodes", "2",
       "--run-id", "run-fake", "--task", "train", "--set", "train.steps=6"]


@pytest.fixture()
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The one registry line (and the double serving its resource, as a cluster would)."""
    monkeypatch.setitem(job_apis.REGISTRY, API.name, __name__)
    monkeypatch.setitem(k8s_double_http.JOB_APIS, RESOURCE.plural,
                        (RESOURCE.group, RESOURCE.version))
    monkeypatch.setattr(k8s_double_http, "JOB_LABELS", (*k8s_double_http.JOB_LABELS, JOB_LABEL))
    yield


def test_a_registered_job_api_is_offered_rendered_and_refused(registered, capsys) -> None:
    assert "fakejob" in job_apis.choices() and job_apis.get("fakejob") is API
    assert cli.main(["render-job", "--job-api", "fakejob", *JOB]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    assert manifest["kind"] == "FakeJob" and manifest["spec"]["replicas"] == 2
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == CONTAINER and FT_LAUNCHER in container["command"]
    with pytest.raises(SystemExit):  # what an unregistered name gets from argparse
        cli.main(["render-job", "--job-api", "rayjob", *JOB])
    assert cli.main(["render-job", "--job-api", "fakejob", *JOB, "--nodes", "1:2"]) == 2
    assert "--nodes: a FakeJob has a fixed node count; use --nodes N" in capsys.readouterr().err


def test_auto_chooses_it_when_the_cluster_serves_only_it(registered, double: K8sDouble) -> None:
    double.served = {RESOURCE.plural}
    assert cluster_launch.pick("auto", api_client(double.configuration())) == "fakejob"


def _play(double: K8sDouble, name: str) -> None:
    """The fake controller: two pods, one logs its last step, both exit 0, the job succeeds."""
    double.wait_for_job(name, ns="team-a")
    double.set_condition(name, "Running", ns="team-a")
    pods = [double.add_pod(name, i, "team-a", name=f"{name}-{i}", labels={JOB_LABEL: name},
                           container=CONTAINER) for i in (0, 1)]
    for pod in pods:
        double.start(pod, "team-a")
    deadline = time.monotonic() + 10
    while not double.calls("GET", f"/pods/{pods[0]}/log") and time.monotonic() < deadline:
        time.sleep(0.05)  # the launcher follows the pod's log now
    double.log(pods[0], "[trainer] step 6/6 loss 3.0", ns="team-a")
    time.sleep(0.3)
    for pod in pods:
        double.terminate(pod, 0, ns="team-a")
    double.set_condition(name, "Succeeded", ns="team-a")


def test_kfp_nvrx_launch_runs_and_follows_it(registered, double: K8sDouble, tmp_path: Path,
                                             capsys) -> None:
    kubeconfig = double.write_kubeconfig(tmp_path / "kubeconfig", namespace="team-a")
    name = naming.derive_name("run-fake", "train")  # the name the launcher derives
    player = threading.Thread(target=_play, args=(double, name), daemon=True)
    player.start()
    rc = cli.main(["launch", "--backend", "kubernetes", "--job-api", "fakejob", *JOB,
                   "--kubeconfig", str(kubeconfig), "--poll-interval", "0.1"])
    player.join(10)
    out = capsys.readouterr().out
    assert rc == 0, out
    (post,) = double.calls("POST")
    assert post["path"] == "/apis/fake.kfp-nvrx.io/v1/namespaces/team-a/fakejobs"
    assert post["body"]["metadata"]["namespace"] == "team-a"  # rendered there, not patched in
    assert f"created FakeJob team-a/{name}: 2 x cpu (1 procs each)" in out
    assert f"[{name}-0] [trainer] step 6/6 loss 3.0" in out
    assert f"Succeeded: {name} (kubernetes)" in out
    assert double.calls("DELETE") and not double.jobs  # on_success: deleted

