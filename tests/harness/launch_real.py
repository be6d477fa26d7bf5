"""Helpers of the launcher tests against the real control plane (tests/cluster/test_launcher_*).

Nothing here stands in for a component: the API server, etcd and the controllers are real. No
kubelet runs (until the node agent does), so where a test needs a pod to run or end it does what
a kubelet does, through the same API: it patches the pod's status.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from kfp_nvrx.components.launch import backends
from kfp_nvrx.components.launch.jobspec.resolve import resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.kube.cluster import Cluster
from kfp_nvrx.components.launch.options import FollowOptions, KubernetesOptions
from kfp_nvrx.components.launch.result import LaunchResult

PVC = "kfp-nvrx-shared"
SA = "kfp-nvrx-launcher"
#: Label selector and container of each job API's pods.
PODS = {"pytorchjob": ("training.kubeflow.org/job-name", "pytorch"),
        "trainjob": ("jobset.sigs.k8s.io/jobset-name", "node")}
#: The generous bound of every wait on the cluster (a loaded 2-core machine).
WAIT_S = 180.0


def job_spec(name: str, run_id: str = "run-real", nodes: str = "2") -> JobSpec:
    """A small CPU job (its pods never run a container here)."""
    return JobSpec(image="img:1", pvc=PVC, instance_type="cpu", nodes=nodes, run_id=run_id,
                   task="train", name=name, overrides=["train.steps=6"])


def cli_args(name: str, job_api: str, run_id: str = "run-real", *extra: str) -> list[str]:
    """``kfp-nvrx launch`` arguments for :func:`job_spec`'s job."""
    return ["launch", "--backend", "kubernetes", "--job-api", job_api, "--name", name,
            "--run-id", run_id, "--nodes", "2", "--image", "img:1", "--pvc", PVC,
            "--instance-type", "cpu", "--config", "tiny", "--set", "train.steps=6",
            "--poll-interval", "0.5", *extra]


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    """Poll ``check`` until it returns something truthy; fail the test naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}", pytrace=False)


def admin_configuration(kube: Any) -> client.Configuration:
    """The admin kubeconfig as a client Configuration."""
    from kubernetes import config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kube.kubeconfig), client_configuration=cfg)
    return cfg


def sa_kubeconfig(kube: Any, folder: Path, sa: str = SA) -> Path:
    """A kubeconfig that authenticates as ServiceAccount ``sa`` (a TokenRequest token)."""
    core = client.CoreV1Api(kube.client())
    req = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))
    token = core.create_namespaced_service_account_token(sa, kube.namespace, req).status.token
    admin = yaml.safe_load(Path(kube.kubeconfig).read_text())
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": sa,
           "clusters": admin["clusters"],
           "users": [{"name": sa, "user": {"token": token}}],
           "contexts": [{"name": sa, "context": {"cluster": admin["clusters"][0]["name"],
                                                 "user": sa, "namespace": kube.namespace}}]}
    path = folder / f"{sa}.kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    path.chmod(0o600)
    return path


def configuration_from(kubeconfig: Path) -> client.Configuration:
    """A client Configuration from a kubeconfig file."""
    from kubernetes import config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    return cfg


class Background:
    """``backends.launch`` in a thread (no signal handlers there), its lines collected."""

    def __init__(self, spec: JobSpec, cfg: client.Configuration, namespace: str,
                 job_api: str = "auto", **follow: Any) -> None:
        self.lines: list[str] = []
        self.result: LaunchResult | None = None
        self.error: BaseException | None = None
        opts = KubernetesOptions(job_api=job_api, cluster=Cluster(cfg, namespace),
                                 follow=FollowOptions(**{"poll_s": 0.5, **follow}))

        def run() -> None:
            try:
                self.result = backends.launch(resolve(spec), opts, log=self.lines.append)
            except BaseException as err:  # noqa: BLE001 - re-raised in the test by join()
                self.error = err

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout_s: float = WAIT_S) -> LaunchResult:
        """Wait for the launcher's result (fail the test if it does not come)."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            pytest.fail(f"launcher still following after {timeout_s:.0f} s:\n"
                        + "\n".join(self.lines[-20:]), pytrace=False)
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def saw(self, text: str) -> bool:
        """Whether the launcher printed a line containing ``text``."""
        return any(text in line for line in list(self.lines))


class Cli:
    """``kfp-nvrx launch`` as its own process, the way KFP runs it."""

    def __init__(self, args: list[str], kubeconfig: Path, tmp: Path) -> None:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.out: list[str] = []
        self.err_path = tmp / f"stderr-{time.monotonic_ns()}.txt"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from kfp_nvrx.components.cli.main import main; "
             "sys.exit(main())", *args], stdout=subprocess.PIPE,
            stderr=open(self.err_path, "wb"), env=env, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.out.append(line.rstrip("\n"))

    def wait_line(self, text: str) -> None:
        """Wait until the launcher printed a line containing ``text``."""
        wait_for(f"launcher line {text!r}",
                 lambda: any(text in line for line in list(self.out)) or self.proc.poll() is not None)
        if not any(text in line for line in self.out):
            pytest.fail(f"launcher exited {self.proc.returncode} before {text!r}:\n"
                        + "\n".join(self.out[-20:]) + "\n" + self.stderr(), pytrace=False)

    def wait(self, timeout_s: float = WAIT_S) -> int:
        """The exit status."""
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail("launcher did not exit:\n" + "\n".join(self.out[-20:]), pytrace=False)
        self._reader.join(10)
        return rc

    def stderr(self) -> str:
        """What it wrote to stderr."""
        return self.err_path.read_text(errors="replace")


def job_pods(core: client.CoreV1Api, ns: str, job_api: str, name: str) -> list[client.V1Pod]:
    """The job's pods, oldest first."""
    label, _ = PODS[job_api]
    items = core.list_namespaced_pod(ns, label_selector=f"{label}={name}").items
    return sorted(items, key=lambda p: p.metadata.name)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def kubelet_run(core: client.CoreV1Api, pod: client.V1Pod, container: str) -> None:
    """What a kubelet reports once the container started: phase Running, Ready."""
    now = _now()
    core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": {
        "phase": "Running", "startTime": now,
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
        "containerStatuses": [{"name": container, "image": "img:1", "imageID": "",
                               "ready": True, "restartCount": 0, "started": True,
                               "state": {"running": {"startedAt": now}}}]}})


def kubelet_exit(core: client.CoreV1Api, pod: client.V1Pod, container: str, code: int) -> None:
    """What a kubelet reports once the container exited with ``code`` (restartPolicy Never)."""
    now = _now()
    core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": {
        "phase": "Succeeded" if code == 0 else "Failed",
        "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
        "containerStatuses": [{"name": container, "image": "img:1", "imageID": "",
                               "ready": False, "restartCount": 0, "started": False,
                               "state": {"terminated": {
                                   "exitCode": code, "reason": "Completed" if code == 0
                                   else "Error", "startedAt": now, "finishedAt": now}}}]}})


def leftovers(api: client.ApiClient, ns: str, name: str) -> dict[str, list[str]]:
    """Every object of the job still there: the job, JobSet, Jobs, Pods, Services, ConfigMaps."""
    core, batch, custom = client.CoreV1Api(api), client.BatchV1Api(api), \
        client.CustomObjectsApi(api)

    def mine(names: list[str]) -> list[str]:
        return [n for n in names if n == name or n.startswith(f"{name}-")]

    def custom_names(group: str, version: str, plural: str) -> list[str]:
        items = custom.list_namespaced_custom_object(group, version, ns, plural)["items"]
        return [i["metadata"]["name"] for i in items]

    found = {
        "TrainJob": custom_names("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
        "PyTorchJob": custom_names("kubeflow.org", "v1", "pytorchjobs"),
        "JobSet": custom_names("jobset.x-k8s.io", "v1alpha2", "jobsets"),
        "Job": [j.metadata.name for j in batch.list_namespaced_job(ns).items],
        "Pod": [p.metadata.name for p in core.list_namespaced_pod(ns).items],
        "Service": [s.metadata.name for s in core.list_namespaced_service(ns).items],
        "ConfigMap": [c.metadata.name for c in core.list_namespaced_config_map(ns).items],
    }
    return {kind: mine(names) for kind, names in found.items() if mine(names)}


def audit_records(kube: Any, offset: int = 0) -> list[dict[str, Any]]:
    """The API server's audit records from byte ``offset`` on, one per request (auditID)."""
    path = Path(kube.root) / "logs" / "audit.log"
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    by_id: dict[str, dict[str, Any]] = {}
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a record being written as we read
        by_id.setdefault(rec["auditID"], rec)
    return list(by_id.values())


def audit_offset(kube: Any) -> int:
    """Where the audit log ends now."""
    path = Path(kube.root) / "logs" / "audit.log"
    return path.stat().st_size if path.exists() else 0


def b64(text: str) -> str:
    """Base64 of ``text`` (etcd's v3 HTTP gateway takes keys so)."""
    return base64.b64encode(text.encode()).decode()
