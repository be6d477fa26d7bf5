"""``kfp-nvrx launch --backend kubernetes`` against the real control plane (issue 20, item 3).

The API server, etcd, the Trainer v2.3, JobSet and Training Operator v1.9 controllers and their
webhooks are real. The job's pods are kept off every node (a node selector no node has), and the
test plays the kubelet where a pod must run or end, by patching the pod's status through the API.
"""

from __future__ import annotations

import copy
import signal

import pytest
from harness.kutil import wait_runtime_seen
from harness.launch_real import (
    PODS,
    Background,
    Cli,
    admin_configuration,
    cli_args,
    configuration_from,
    job_pods,
    job_spec,
    kubelet_exit,
    kubelet_run,
    leftovers,
    sa_kubeconfig,
    wait_for,
)
from kubernetes import client

from kfp_nvrx.components.launch import cluster_launch
from kfp_nvrx.components.launch.trainjob import runtime as rt

#: No node carries this label: the scheduler never binds our pods, so no node agent runs them and
#: the test is the only one writing their status.
NO_NODE = "kfp-nvrx.test/no-node=true"
KINDS = {"pytorchjob": "PyTorchJob", "trainjob": "TrainJob"}


def _spec(name: str, **kw):
    spec = job_spec(name, **kw)
    spec.node_selector = dict([NO_NODE.split("=")])
    return spec


def _args(name: str, job_api: str, *extra: str) -> list[str]:
    return cli_args(name, job_api, "run-real", "--node-selector", NO_NODE, *extra)


def _two_pods(kube, job_api: str, name: str) -> list[client.V1Pod]:
    core = client.CoreV1Api(kube.client())
    return wait_for(f"2 pods of {name}", lambda: (p := job_pods(core, kube.namespace, job_api,
                                                                    name)) and len(p) == 2 and p)


def _finish(kube, job_api: str, name: str, codes: tuple[int | None, int | None]) -> None:
    """Exit the two pods' containers with ``codes`` (None: leave that pod as it is)."""
    core = client.CoreV1Api(kube.client())
    for pod, code in zip(_two_pods(kube, job_api, name), codes, strict=True):
        if code is not None:
            kubelet_exit(core, pod, PODS[job_api][1], code)


def _set_served(api: client.ApiClient, crd: str, served: bool) -> None:
    client.ApiextensionsV1Api(api).patch_custom_resource_definition(
        crd, [{"op": "replace", "path": "/spec/versions/0/served", "value": served}])


def test_auto_reads_the_real_servers_api_groups(kube) -> None:
    """Both APIs served: TrainJob. The TrainJob CRD unserved (one-API cluster): PyTorchJob."""
    api = kube.client()
    assert cluster_launch.served(api) == ["trainjob", "pytorchjob"]
    assert cluster_launch.pick("auto", api) == "trainjob"
    crd = "trainjobs.trainer.kubeflow.org"
    try:
        _set_served(api, crd, False)
        wait_for("discovery without trainjobs", lambda: cluster_launch.served(api)
                 == ["pytorchjob"])
        assert cluster_launch.pick("auto", api) == "pytorchjob"
        # And the launcher, asked for auto, creates a PyTorchJob there.
        name = "real-auto-v1"
        run = Background(_spec(name), admin_configuration(kube), kube.namespace,
                         job_api="auto", deadline_s=2.0)
        assert run.join().state == "DeadlineExceeded"
        assert run.saw("--job-api auto: the cluster serves pytorchjob")
        assert run.saw(f"created PyTorchJob {kube.namespace}/{name}")
    finally:
        _set_served(api, crd, True)
        wait_for("trainjobs served again", lambda: "trainjob" in cluster_launch.served(api))


def test_pytorchjob_failure_names_operator_reason_and_replica(kube) -> None:
    name = "real-pj-fail"
    run = Background(_spec(name), admin_configuration(kube), kube.namespace,
                     job_api="pytorchjob")
    # worker-1 exits 1: permanent under restartPolicy ExitCode. (worker-0 stays pending: the
    # operator counts a PyTorchJob without a master as Succeeded when worker-0 succeeds.)
    _finish(kube, "pytorchjob", name, (None, 1))
    result = run.join()
    assert result.state == "Failed"
    # The Training Operator's own condition reason, then the replica from the pod status.
    assert result.reason.startswith("PyTorchJobFailed: ")
    assert "(worker-1 exited with code 1, Error: ft_launcher gave up" in result.reason
    assert result.extra["failed_replica"] == "worker-1"
    # on_success keeps a failed job for inspection.
    assert leftovers(kube.client(), kube.namespace, name).get("PyTorchJob") == [name]
    client.CustomObjectsApi(kube.client()).delete_namespaced_custom_object(
        "kubeflow.org", "v1", kube.namespace, "pytorchjobs", name)


def test_trainjob_by_auto_runs_to_complete_and_leaves_nothing(kube) -> None:
    name = "real-tj-ok"
    run = Background(_spec(name), admin_configuration(kube), kube.namespace, job_api="auto")
    core = client.CoreV1Api(kube.client())
    pods = _two_pods(kube, "trainjob", name)
    assert {p.metadata.labels["batch.kubernetes.io/job-completion-index"] for p in pods} == \
        {"0", "1"}
    for pod in pods:
        kubelet_run(core, pod, rt.CONTAINER_NAME)
    wait_for("TrainJob Running", lambda: run.saw(f"TrainJob {name}: Running"))
    _finish(kube, "trainjob", name, (0, 0))
    result = run.join()
    assert result.state == "Succeeded", result.reason
    assert result.extra["job_api"] == "trainjob" and run.saw("--job-api auto: the cluster "
                                                             "serves trainjob")
    assert run.saw(f"deleted TrainJob {kube.namespace}/{name}")
    assert leftovers(kube.client(), kube.namespace, name) == {}


@pytest.mark.parametrize("how", ["exit-1", "active-deadline"])
def test_trainjob_failure_carries_the_trainers_reason(kube, how: str) -> None:
    """A node exiting 1 (ft_launcher gave up) or the TrainJob's activeDeadlineSeconds passing."""
    name = f"real-tj-{how}"
    spec = _spec(name)
    if how == "active-deadline":
        spec.active_deadline_s = 2  # the Trainer's own deadline, well before the launcher's
    run = Background(spec, admin_configuration(kube), kube.namespace, job_api="trainjob")
    if how == "exit-1":
        _finish(kube, "trainjob", name, (None, 1))
    result = run.join()
    assert result.state == "Failed"
    if how == "exit-1":  # JobSet's reason, passed on by the Trainer; then the pod's exit
        assert result.reason.startswith("FailJobSetFailurePolicyAction: ")
        assert "(node-1 exited with code 1, Error: ft_launcher gave up" in result.reason
        assert result.extra["failed_replica"] == "node-1"
    else:
        assert result.reason == "DeadlineExceeded: TrainJob exceeded its active deadline"
    client.CustomObjectsApi(kube.client()).delete_namespaced_custom_object(
        rt.GROUP, "v1alpha1", kube.namespace, "trainjobs", name)


def test_trainjob_whose_jobset_is_refused_fails_in_one_line(kube, tmp_path) -> None:
    """A runtime whose JobSet the real JobSet webhook refuses: one line, exit 1, not a wait.

    Run as the launcher's ServiceAccount: reading the TrainJob's Events is within its Role.
    """
    api = client.CustomObjectsApi(kube.client())
    runtime = copy.deepcopy(api.get_namespaced_custom_object(
        rt.GROUP, "v1alpha1", kube.namespace, "trainingruntimes", rt.RUNTIME_NAME))
    runtime["metadata"] = {"name": "real-bad-rules", "namespace": kube.namespace}
    rules = runtime["spec"]["template"]["spec"]["failurePolicy"]["rules"]
    rules[0]["name"] = "ft-launcher-gave-up"  # JobSet v0.12 refuses '-' in rule names
    api.create_namespaced_custom_object(rt.GROUP, "v1alpha1", kube.namespace,
                                        "trainingruntimes", runtime)
    wait_runtime_seen(kube.dynamic(), runtime, kube.namespace)
    name = "real-tj-refused"
    try:
        cli = Cli(_args(name, "trainjob", "--runtime", "real-bad-rules"),
                  sa_kubeconfig(kube, tmp_path), tmp_path)
        assert cli.wait() == 1
        err = cli.stderr()
        assert "Traceback" not in err and "WARNING" not in err
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("kfp-nvrx launch: Failed: TrainJobResourcesCreationFailed: ")
        assert 'admission webhook "vjobset.kb.io" denied the request' in lines[0]
        assert "TrainingRuntime real-bad-rules" in lines[0]
    finally:
        api.delete_namespaced_custom_object(rt.GROUP, "v1alpha1", kube.namespace,
                                            "trainjobs", name)
        api.delete_namespaced_custom_object(rt.GROUP, "v1alpha1", kube.namespace,
                                            "trainingruntimes", "real-bad-rules")


@pytest.mark.parametrize("job_api", ["pytorchjob", "trainjob"])
def test_sigterm_deletes_the_job_and_all_it_made(kube, tmp_path, job_api: str) -> None:
    name = f"real-term-{job_api[:2]}"
    cli = Cli(_args(name, job_api), kube.kubeconfig, tmp_path)
    cli.wait_line(f"created {KINDS[job_api]}")
    # What the controllers built, so "nothing left" below means something.
    expected = {"pytorchjob": {"PyTorchJob", "Pod", "Service"},
                "trainjob": {"TrainJob", "JobSet", "Job", "Pod", "Service"}}[job_api]
    wait_for(f"{expected} of {name}", lambda: expected <= set(
        leftovers(kube.client(), kube.namespace, name)))
    cli.proc.send_signal(signal.SIGTERM)
    assert cli.wait() == 128 + signal.SIGTERM
    assert any(line.startswith("deleted ") for line in cli.out), cli.out
    assert leftovers(kube.client(), kube.namespace, name) == {}


@pytest.mark.parametrize("job_api", ["pytorchjob", "trainjob"])
def test_reattaches_after_the_launcher_is_killed(kube, tmp_path, job_api: str) -> None:
    name, kind = f"real-reattach-{job_api[:2]}", KINDS[job_api]
    first = Cli(_args(name, job_api), kube.kubeconfig, tmp_path)
    first.wait_line(f"created {kind}")
    first.proc.kill()  # no cleanup: what a node loss or OOM kill of the KFP step does
    first.wait()
    second = Cli(_args(name, job_api), kube.kubeconfig, tmp_path)
    second.wait_line(f"re-attaching to {kind} {kube.namespace}/{name} (run run-real)")
    # A PyTorchJob without a master succeeds when worker-0 does; a TrainJob when all nodes do.
    _finish(kube, job_api, name, (0, None) if job_api == "pytorchjob" else (0, 0))
    assert second.wait() == 0, second.stderr()
    assert not any(line.startswith("created ") for line in second.out)
    assert leftovers(kube.client(), kube.namespace, name) == {}


def test_deadline_ends_following_and_deletes(kube) -> None:
    name = "real-deadline"
    run = Background(_spec(name), admin_configuration(kube), kube.namespace,
                     job_api="pytorchjob", deadline_s=3.0)
    result = run.join()
    assert result.state == "DeadlineExceeded"
    assert result.reason == "launcher deadline of 3s after job creation passed"
    assert leftovers(kube.client(), kube.namespace, name) == {}


def test_service_account_role_is_enough_for_a_whole_run(kube, tmp_path) -> None:
    """Create, follow, succeed and delete a PyTorchJob as ``kfp-nvrx-launcher`` (TokenRequest)."""
    name = "real-sa-run"
    cfg = configuration_from(sa_kubeconfig(kube, tmp_path))
    run = Background(_spec(name), cfg, kube.namespace, job_api="auto")
    _two_pods(kube, "trainjob", name)
    _finish(kube, "trainjob", name, (0, 0))
    result = run.join()
    assert result.state == "Succeeded", (result.reason, run.lines)
    assert not any("403" in line or "Forbidden" in line for line in run.lines), run.lines
    assert leftovers(kube.client(), kube.namespace, name) == {}


def test_refusals_are_one_line_and_say_whose(kube, tmp_path) -> None:
    """A webhook refusing a missing runtime is not called RBAC; RBAC's own 403 is.

    The Trainer's and Kueue's TrainJob webhooks both refuse a missing runtime and validating
    webhooks run in parallel, so either may be the one the server returns; the line says which.
    The second run is the namespace's ``default`` ServiceAccount, which no Role binds.
    """
    cases = [(kube.kubeconfig, "no-such-runtime", 'admission webhook "', '" denied the request',
              "no-such-runtime", "not found"),
             (sa_kubeconfig(kube, tmp_path, "default"), rt.RUNTIME_NAME,
              "answered HTTP 403 Forbidden. RBAC forbids it (see docs/eks.md).",
              'cannot get resource "trainjobs"')]
    for kubeconfig, runtime, *says in cases:
        cli = Cli(_args("real-refused", "trainjob", "--runtime", runtime), kubeconfig, tmp_path)
        assert cli.wait() == 1
        lines = cli.stderr().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kfp-nvrx launch: cluster error: ")
        assert all(s in lines[0] for s in says), lines[0]
        assert ("RBAC" in lines[0]) == ("admission" not in lines[0]), lines[0]
        assert '{"kind":"Status"' not in lines[0]  # the server's message, not its JSON
    assert leftovers(kube.client(), kube.namespace, "real-refused") == {}


@pytest.fixture(scope="module")
def quota_namespace(cluster):
    """A namespace whose ResourceQuota admits no pod (deleted after this module's tests)."""
    core = client.CoreV1Api(cluster.client())
    ns = "kfp-nvrx-no-pods"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    core.create_namespaced_resource_quota(ns, client.V1ResourceQuota(
        metadata=client.V1ObjectMeta(name="no-pods"), spec=client.V1ResourceQuotaSpec(
            hard={"pods": "0"})))
    # Until the quota controller has written status.hard, admission refuses pods with "status
    # unknown for quota", not the "exceeded quota" the test asserts on.
    def counted() -> bool:
        quota = core.read_namespaced_resource_quota("no-pods", ns)
        return (quota.status.hard or {}).get("pods") == "0"

    wait_for(f"the quota controller to count namespace {ns}", counted)
    yield ns
    core.delete_namespace(ns)


@pytest.mark.parametrize(("job_api", "says"), [
    ("pytorchjob", "(FailedCreatePod on PyTorchJob kfp-nvrx-no-pods/real-quota-py)"),
    ("trainjob", "(FailedCreate on Job kfp-nvrx-no-pods/real-quota-tr-node-0)")])
def test_pods_refused_by_quota_are_said_once_not_just_pending(kube, tmp_path, quota_namespace,
                                                              job_api: str, says: str) -> None:
    """The controller's FailedCreate(Pod) event is shown: 'Pending' alone would hide it."""
    name = f"real-quota-{job_api[:2]}"
    cli = Cli(_args(name, job_api, "--namespace", quota_namespace, "--runtime",
                    "torch-distributed", "--runtime-kind", "ClusterTrainingRuntime"),
              kube.kubeconfig, tmp_path)
    cli.wait_line("warning: pods cannot be created: ")
    cli.proc.send_signal(signal.SIGTERM)
    assert cli.wait() == 128 + signal.SIGTERM
    warnings = [line for line in cli.out if line.startswith("warning: pods cannot be created: ")]
    # One line, however often the controller retried (each retry names a new pod).
    assert len(warnings) == 1 and warnings[0].endswith(says), cli.out
    assert "pods is forbidden: exceeded quota: no-pods, requested: pods=1" in warnings[0]
    assert leftovers(kube.client(), quota_namespace, name) == {}


def test_a_job_no_controller_takes_up_is_said(kube) -> None:
    """A TrainJob the real Trainer skips (``managedBy`` Kueue, which is not installed)."""
    from support.rendering import render_trainjob

    from kfp_nvrx.components.launch.backends import launch
    from kfp_nvrx.components.launch.jobspec.resolve import resolve
    from kfp_nvrx.components.launch.kube.cluster import Cluster
    from kfp_nvrx.components.launch.options import FollowOptions, KubernetesOptions

    name = "real-unmanaged"
    spec = _spec(name)
    body = render_trainjob(spec, rt.RUNTIME_NAME, rt.RUNTIME_KIND).job
    body["metadata"]["namespace"] = kube.namespace
    body["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    api = client.CustomObjectsApi(kube.client())
    api.create_namespaced_custom_object(rt.GROUP, "v1alpha1", kube.namespace, "trainjobs", body)
    lines: list[str] = []
    opts = KubernetesOptions(job_api="trainjob", cluster=Cluster(kube.client().configuration,
                                                                 kube.namespace),
                             follow=FollowOptions(poll_s=0.5, deadline_s=14.0,
                                                  no_controller_s=2.0, handle_signals=False))
    result = launch(resolve(spec), opts, log=lines.append)
    assert result.state == "DeadlineExceeded" and result.extra["attached"] is True
    said = [line for line in lines if "has no status" in line]
    assert said == [f"warning: TrainJob {kube.namespace}/{name} has no status 2s after its "
                    "creation: is the Kubeflow Trainer controller manager (and Kueue, for a "
                    "TrainJob with spec.managedBy) running?"], lines
    assert leftovers(kube.client(), kube.namespace, name) == {}
