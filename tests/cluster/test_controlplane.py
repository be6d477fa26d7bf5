"""The test cluster itself: every component up, the real webhooks answering, and `down` leaving
no process and no port behind (the promise `make cluster-down` makes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.controlplane import USER_NAMESPACE, bin_dir
from harness.procs import alive
from harness.supervisor import read_state

TESTS = Path(__file__).resolve().parents[1]
COMPONENTS = {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
              "trainer-controller-manager", "jobset-controller", "training-operator", "kueue"}


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=TESTS, text=True,
                          capture_output=True, timeout=timeout)


def _open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_every_component_runs_and_crds_are_served(kube):
    assert COMPONENTS <= set(kube.state["components"])
    dyn = kube.dynamic()
    groups = {g.name for g in kube.client().call_api(
        "/apis", "GET", response_type="V1APIGroupList", _return_http_data_only=True).groups}
    assert {"trainer.kubeflow.org", "jobset.x-k8s.io", "kubeflow.org", "kueue.x-k8s.io"} <= groups
    runtime = dyn.resources.get(api_version="trainer.kubeflow.org/v1alpha1",
                                kind="TrainingRuntime").get(name="kfp-nvrx-ft",
                                                            namespace=USER_NAMESPACE)
    assert runtime.metadata.labels["app.kubernetes.io/part-of"] == "kfp-nvrx"
    ctr = dyn.resources.get(api_version="trainer.kubeflow.org/v1alpha1",
                            kind="ClusterTrainingRuntime").get(name="torch-distributed")
    assert ctr.spec.template.spec.replicatedJobs[0].name == "node"


def test_webhooks_are_called_for_real(kube):
    """A TrainJob asking for a dataset initializer its runtime does not have is refused by the
    Trainer's webhook.

    Not a missing runtime: Kueue's TrainJob webhook (topology-aware scheduling, on by default)
    refuses that too, and validating webhooks run in parallel, so whose refusal the server
    returns is a race. Kueue accepts this one (the runtime exists); only the Trainer refuses it.
    """
    from kubernetes.client.rest import ApiException

    res = kube.dynamic().resources.get(api_version="trainer.kubeflow.org/v1alpha1",
                                       kind="TrainJob")
    body = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": "no-dataset-initializer"},
            "spec": {"runtimeRef": {"name": "kfp-nvrx-ft", "kind": "TrainingRuntime",
                                    "apiGroup": "trainer.kubeflow.org"},
                     "initializer": {"dataset": {"storageUri": "hf://absent/absent"}}}}
    with pytest.raises(ApiException) as e:
        res.create(body=body, namespace=USER_NAMESPACE, query_params=[("dryRun", "All")])
    body = e.value.body.decode() if isinstance(e.value.body, bytes) else e.value.body
    assert "validator.trainjob.trainer.kubeflow.org" in body, body
    assert "must have dataset-initializer job" in body, body


@pytest.mark.skipif(bin_dir() is None, reason="cluster tests need `make cluster-bins`")
def test_up_and_down_leave_nothing_behind(tmp_path):
    """`up` prints the kubeconfig; `down` stops every component and frees every port."""
    root = tmp_path / "c"
    up = _cli("up", "--dir", str(root), "--nodes", "0")
    assert up.returncode == 0, up.stdout + up.stderr
    state = read_state(root)
    assert f"KUBECONFIG={state['kubeconfig']}" in up.stdout
    pids = [c["pid"] for c in state["components"].values()] + [state["supervisor"]]
    assert all(alive(p) for p in pids)
    again = _cli("up", "--dir", str(root), "--nodes", "0")  # idempotent: one cluster per dir
    assert again.returncode == 0 and "already running" in again.stdout
    down = _cli("down", "--dir", str(root))
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(alive(p) for p in pids)
    assert not [p for p in state["ports"] if _open(p)]


@pytest.mark.skipif(bin_dir() is None, reason="cluster tests need `make cluster-bins`")
def test_supervisor_killed_takes_every_component_with_it(tmp_path):
    """SIGKILL of the supervisor (no cleanup code runs) still leaves no component running."""
    root = tmp_path / "k"
    assert _cli("up", "--dir", str(root), "--nodes", "0").returncode == 0
    state = read_state(root)
    pids = [c["pid"] for c in state["components"].values()]
    os.kill(state["supervisor"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)


@pytest.mark.skipif(bin_dir() is None, reason="cluster tests need `make cluster-bins`")
def test_a_dead_component_is_reported_with_its_log(tmp_path):
    """A controller that dies makes the cluster report which one and its log's tail."""
    root = tmp_path / "d"
    assert _cli("up", "--dir", str(root), "--nodes", "0").returncode == 0
    state = read_state(root)
    os.kill(state["components"]["jobset-controller"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        failed = (read_state(root) or {}).get("failed")
        if failed:
            break
        time.sleep(0.2)
    assert failed and failed.startswith("jobset-controller exited with -9")
    assert "jobset" in failed.split("\n", 1)[1].lower()  # the log's tail comes with it
    _cli("down", "--dir", str(root))
    assert not any(alive(c["pid"]) for c in state["components"].values())


def test_ports_are_outside_the_outgoing_range_and_never_shared_between_clusters():
    # Two supervisors on one machine (xdist workers) each take ports; none may get one the
    # other holds, and none may come from the range the kernel gives outgoing connections.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from harness.procs import free_port\n"
         "print(' '.join(str(free_port()) for _ in range(100)), flush=True); sys.stdin.read()"],
        cwd=TESTS, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = {int(p) for p in holder.stdout.readline().split()}
        from harness.procs import _ephemeral_start, free_port
        ours = {free_port() for _ in range(100)}
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert len(theirs) == 100 and len(ours) == 100
    assert not theirs & ours
    assert max(theirs | ours) < _ephemeral_start()
