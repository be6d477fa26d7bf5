"""From a notebook (issue 40): the Kubeflow SDK's ``TrainerClient`` (kubeflow 0.5.0) runs our
fault-tolerant trainer on the ``kfp-nvrx-ft`` runtime, on the real controllers.

What a notebook user types (README, docs/notebook.md): the runtime is listed and picked by name,
``CustomTrainerContainer(image, num_nodes, resources_per_node, env={KFP_NVRX_*})`` says what to
train; nothing of ours is imported. The SDK's job trains under ft_launcher, survives an in-job kill
and a deleted pod, and ends with the weights of a ``kfp-nvrx launch`` run bitwise; the SDK's
``wait_for_job_status``, ``get_job`` and ``get_job_logs`` show it as any TrainJob, our ``goodput``
and ``export`` read the run dir it wrote; with the SDK's ``Labels`` option it is queued by Kueue;
bad config fails the TrainJob at once with one line in its log.

The reference is ``kfp-nvrx launch``'s run ``kq-after`` of tests/cluster/test_kueue.py when this
session ran it (same preset, data, steps, 2 nodes x 1 process), else one of our own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import install, kueue
from harness.kueue_launch import DATA, Launch, LaunchArgs, prepare_data
from harness.launch_real import wait_for
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from cluster.test_train_e2e import _assert_bitwise, _assert_nothing_left, _claim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUNTIME = "kfp-nvrx-ft"
STEPS = 30  # as kq-after's: its weights are the reference when this session has them
SETS = f"data.path=/fsx/{DATA} train.steps={STEPS} checkpoint.interval=10"
RESOURCES = {"cpu": 1, "memory": "1Gi"}  # CPU: the torch plugin runs 1 process per CPU
CQ, LQ = "kfp-nvrx-sdk-cq", "kfp-nvrx-sdk-lq"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
RUN_S = 600


@pytest.fixture(scope="module")
def sdk(cluster):
    """A ``TrainerClient`` on the test cluster, as a notebook makes one; every TrainJob it made
    here is deleted at the end (ours only)."""
    from kubeflow.common.types import KubernetesBackendConfig
    from kubeflow.trainer import TrainerClient

    prepare_data(cluster)
    tc = TrainerClient(KubernetesBackendConfig(namespace=cluster.namespace,
                                               config_file=str(cluster.kubeconfig)))
    made: list[str] = []
    original = tc.train

    def train(*args, **kw) -> str:
        made.append(original(*args, **kw))
        return made[-1]

    tc.train = train
    yield tc
    for name in made:
        try:
            tc.delete_job(name)
        except RuntimeError:
            pass


def _container(env: dict[str, str], nodes: int = 2):
    from kubeflow.trainer import CustomTrainerContainer

    return CustomTrainerContainer(image="kfp-nvrx-trainer:test", num_nodes=nodes,
                                  resources_per_node=RESOURCES, env=env)


def _run_dir(kube, name: str) -> Path:
    return _claim(kube) / "runs" / name


def _committed(run_dir: Path) -> list[int]:
    from kfp_nvrx.components.core.rundir import committed_steps

    root = run_dir / "checkpoints"
    return committed_steps(root) if root.is_dir() else []


def _weights(run_dir: Path):
    from kfp_nvrx.components.core.rundir import step_dir
    from kfp_nvrx.components.training.export.consolidate import load_model_state

    assert _committed(run_dir)[0] == STEPS, _committed(run_dir)
    return load_model_state(step_dir(run_dir / "checkpoints", STEPS))


def _starts(run_dir: Path) -> list[dict]:
    from kfp_nvrx.components.core.events import Start, read_events

    if not (run_dir / "events.jsonl").is_file():
        return []
    return [e.to_dict() for e in read_events(run_dir) if isinstance(e, Start)]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "kfp-nvrx"), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def reference(sdk, cluster):
    """The final weights of a fault-free ``kfp-nvrx launch`` run of the same training."""
    kept = _run_dir(cluster, "kq-after")
    if STEPS in _committed(kept):
        return _weights(kept)
    run = Launch(cluster, LaunchArgs("sdk-ref", "trainjob", steps=STEPS))
    assert run.wait() == 0, run.text()[-4000:]
    return _weights(_run_dir(cluster, "sdk-ref"))


def _node_pods(kube, name: str) -> list:
    pods = k8s.CoreV1Api(kube.client()).list_namespaced_pod(
        kube.namespace, label_selector=f"{JOBSET_LABEL}={name}").items
    return [p for p in pods if not p.metadata.deletion_timestamp]


def test_our_runtime_is_listed_and_picked_by_name(sdk) -> None:
    runtimes = {r.name: r for r in sdk.list_runtimes()}
    assert RUNTIME in runtimes, sorted(runtimes)
    ours = sdk.get_runtime(RUNTIME)
    assert ours.trainer.framework == "torch" and ours.trainer.trainer_type.name == "CUSTOM_TRAINER"


def test_an_sdk_job_trains_recovers_and_matches_a_launched_run_bitwise(kube, sdk,
                                                                       reference) -> None:
    name = sdk.train(runtime=RUNTIME, trainer=_container({
        "KFP_NVRX_CONFIG": "tiny", "KFP_NVRX_SET": SETS, "KFP_NVRX_FAULTS": "kill@14/1"}))
    run_dir = _run_dir(kube, name)
    # 1. the in-job kill: ft_launcher restarts the workers inside the first pods
    wait_for("the in-job restart", lambda: len(_starts(run_dir)) >= 2, RUN_S)
    first = {p.metadata.uid for p in _node_pods(kube, name)}
    wait_for("a commit after the restart", lambda: (_committed(run_dir) or [0])[0] >= 20, RUN_S)
    # 2. a pod deleted (kubectl delete pod): the JobSet recreates both pods, the run resumes
    newest = _committed(run_dir)[0]
    victim = next(p for p in _node_pods(kube, name) if p.metadata.labels[INDEX_LABEL] == "0")
    assert victim.metadata.uid in first, "the in-job restart recreated a pod"
    k8s.CoreV1Api(kube.client()).delete_namespaced_pod(victim.metadata.name, kube.namespace)
    job = sdk.wait_for_job_status(name, status={"Complete"}, timeout=RUN_S, polling_interval=2)
    assert job.status == "Complete" and job.num_nodes == 2 and job.runtime.name == RUNTIME
    shown = sdk.get_job(name)
    assert shown.status == "Complete"
    assert sorted(s.name for s in shown.steps) == ["node-0", "node-1"], shown.steps
    assert {s.status for s in shown.steps} == {"Succeeded"}
    pods = _node_pods(kube, name)
    assert {p.metadata.labels[ATTEMPT_LABEL] for p in pods} == {"1"}, "no JobSet restart"
    assert not {p.metadata.uid for p in pods} & first
    logs = list(sdk.get_job_logs(name))  # node 0 of the recreated pods
    assert any(line.startswith(f"kfp-nvrx runtime: TrainJob {kube.namespace}/{name}: tiny")
               for line in logs), logs[:20]
    assert any("ft_launcher" in line and "joined round" in line for line in logs), logs[-20:]
    resumed = [s["resumed_from"] for s in _starts(run_dir)]
    assert resumed[0] is None and resumed[1] == 10 and resumed[-1] >= newest, resumed
    _assert_bitwise(_weights(run_dir), reference)
    _our_tools_read_the_run_dir(run_dir, kube)
    _assert_nothing_left(kube)


def _our_tools_read_the_run_dir(run_dir: Path, kube) -> None:
    """``kfp-nvrx goodput`` and ``export`` on the run dir the SDK's job wrote."""
    out = _cli("goodput", "--run-dir", str(run_dir), "--json")
    assert out.returncode == 0, out.stderr
    goodput = json.loads(out.stdout)
    assert goodput["restarts"] == {"in-job": 1, "pod": 1}, goodput
    assert 0 < goodput["goodput"] < 1 and goodput["recovery_s"], goodput
    model = kube.root / f"export-{run_dir.name}"
    # The run's data.path is the pod's /fsx view; this machine reads the same claim directly.
    out = _cli("export", "--run-dir", str(run_dir), "--out", str(model),
               "--data", str(_claim(kube) / DATA))
    assert out.returncode == 0, out.stderr
    assert (model / "model.safetensors").is_file()


def test_the_sdks_label_option_queues_it_through_kueue(kube, sdk) -> None:
    from kubeflow.trainer.options import Labels

    objs = kueue.queue_objects(kube.namespace, CQ, LQ, cpu="2")
    install.apply(type("CP", (), {"kubeconfig": kube.kubeconfig})(), objs)
    custom = k8s.CustomObjectsApi(kube.client())
    name = None
    try:
        name = sdk.train(runtime=RUNTIME, trainer=_container({
            "KFP_NVRX_CONFIG": "tiny",
            "KFP_NVRX_SET": f"data.path=/fsx/{DATA} train.steps=4 checkpoint.interval=2"}),
            options=[Labels({"kueue.x-k8s.io/queue-name": LQ})])
        made = custom.get_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1",
                                                   kube.namespace, "trainjobs", name)
        assert made["spec"].get("suspend") is True  # Kueue's webhook: held until admitted
        job = sdk.wait_for_job_status(name, status={"Complete"}, timeout=RUN_S,
                                      polling_interval=2)
        assert job.status == "Complete"
        workloads = [w for w in custom.list_namespaced_custom_object(
            kueue.GROUP, "v1beta2", kube.namespace, "workloads")["items"]
            if any(o["name"] == name for o in w["metadata"].get("ownerReferences") or [])]
        assert len(workloads) == 1, workloads
        status = workloads[0]["status"]
        assert status["admission"]["clusterQueue"] == CQ
        assert any(c["type"] == "Admitted" for c in status["conditions"]), status
        assert _committed(_run_dir(kube, name))[0] == 4
    finally:
        if name is not None:  # before its queue (the fixture's delete then finds it gone)
            sdk.delete_job(name)
        _delete_queue(custom, kube.namespace)


def _delete_queue(custom, namespace: str) -> None:
    """Our LocalQueue and ClusterQueue (the flavor is shared by every test queue)."""
    for call, args in ((custom.delete_namespaced_custom_object,
                        (kueue.GROUP, "v1beta2", namespace, "localqueues", LQ)),
                       (custom.delete_cluster_custom_object,
                        (kueue.GROUP, "v1beta2", "clusterqueues", CQ))):
        try:
            call(*args)
        except ApiException as err:
            if err.status != 404:
                raise


def test_bad_config_fails_the_trainjob_at_once_in_one_line(kube, sdk) -> None:
    name = sdk.train(runtime=RUNTIME, trainer=_container({
        "KFP_NVRX_CONFIG": "tiny", "KFP_NVRX_SET": f"data.path=/fsx/{DATA} train.stepz=3"}))
    job = sdk.wait_for_job_status(name, status={"Failed"}, timeout=RUN_S, polling_interval=2)
    assert job.status == "Failed"
    logs = list(sdk.get_job_logs(name))
    assert len(logs) == 1 and logs[0].startswith("kfp-nvrx runtime: train"), logs
    assert "stepz" in logs[0]
    pods = _node_pods(kube, name)
    assert {p.metadata.labels[ATTEMPT_LABEL] for p in pods} == {"0"}, "restarted bad input"
    assert not _run_dir(kube, name).exists()
