"""Kueue in the test control plane: its controller manager, CRDs and webhooks, and the queue objects
the tests make (ResourceFlavor, ClusterQueue, LocalQueue, WorkloadPriorityClass).

Kueue v0.17.0 is built from its Go module (``controllers/kueue``) with its own pins (Trainer v2.2.0
APIs, JobSet v0.11.1), which is what its release image holds; it runs against our Trainer v2.3.0,
JobSet v0.12.0 and Training Operator v1.9.4. Its Configuration enables the TrainJob, PyTorchJob and
JobSet integrations and nothing else, manages only jobs that name a queue
(``manageJobsWithoutQueueName: false``, Kueue's default), and registers only the webhooks of those
integrations and of Kueue's own objects: a job without a queue label is left alone, and no pod,
Deployment or StatefulSet creation waits on Kueue.

Two upstream choices need working around outside a cluster, without changing Kueue:

* without its internal certificate rotation, Kueue reads a metrics certificate from the fixed path
  ``/etc/kueue/metrics/certs`` even when metrics are off, and exits when there is none. It runs in
  a mount namespace of its own where ``/etc`` is an overlay whose upper layer (a private tmpfs)
  holds that certificate: nothing is written to the host's ``/etc``.
* its visibility API server (``VisibilityOnDemand``) binds port 8082 on every interface; two
  clusters on one machine would collide. The gate is off (nothing here reads pending positions).
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from .controlplane import ControlPlane
    from .procs import Proc

API = "kueue.x-k8s.io/v1beta2"
GROUP = "kueue.x-k8s.io"
#: The job integrations this cluster enables, and the (group, resource) of each one's webhooks.
INTEGRATIONS = {
    "trainer.kubeflow.org/trainjob": ("trainer.kubeflow.org", "trainjobs"),
    "kubeflow.org/pytorchjob": ("kubeflow.org", "pytorchjobs"),
    "jobset.x-k8s.io/jobset": ("jobset.x-k8s.io", "jobsets"),
}
#: The upstream kustomization's ``namePrefix`` (config/default): the bare names
#: ``mutating-webhook-configuration`` / ``validating-webhook-configuration`` are JobSet's too.
NAME_PREFIX = "kueue-"
#: The flavor every test ClusterQueue offers (no node labels: any test node fits).
FLAVOR = "default-flavor"

# An overlay on /etc in Kueue's own mount namespace: $0 = a private folder (a tmpfs goes on it),
# $1 = the certificate folder; the rest is Kueue's command line.
_WRAPPER = (
    'mount -t tmpfs kueue-etc "$0" && mkdir -p "$0/upper/kueue/metrics" "$0/work" && '
    'cp -r "$1" "$0/upper/kueue/metrics/certs" && '
    'mount -t overlay kueue-etc -o "lowerdir=/etc,upperdir=$0/upper,workdir=$0/work" /etc && '
    'shift && exec "$@"')


def configuration(cp: ControlPlane, certs: Path) -> dict[str, Any]:
    """Kueue's Configuration (``config.kueue.x-k8s.io/v1beta2``) for this run."""
    from .controlplane import SYSTEM_NAMESPACE

    ports = cp.ep.controller("kueue")
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": SYSTEM_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['health']}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": ports["webhook"], "host": "127.0.0.1", "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        # Certificates come from this run's CA; the rotator would issue them for a Service name.
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": list(INTEGRATIONS)},
        "featureGates": {"VisibilityOnDemand": False},
    }


def start(cp: ControlPlane) -> Proc:
    """Start Kueue's controller manager (webhooks on a loopback port of this run)."""
    certs = cp.webhook_certs("kueue")
    folder = cp.root / "kueue"
    cfg = folder / "config.yaml"
    cfg.write_text(yaml.safe_dump(configuration(cp, certs)))
    private = folder / "etc-overlay"
    private.mkdir(exist_ok=True)
    return cp._proc("kueue", [
        "unshare", "--mount", "--propagation", "private", "sh", "-c", _WRAPPER,
        str(private), str(certs), str(cp.bins / "kueue"), "--config", str(cfg),
        "--zap-log-level", "info"], env={"KUBECONFIG": str(cp.kubeconfig)})


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def crds(manifests: Path, port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """Kueue's CRDs; those the upstream kustomization converts by webhook point at ours."""
    root = manifests / "kueue"
    converted = {}
    for patch in sorted((root / "patches").glob("webhook_in_*.yaml")):
        doc = yaml.safe_load(patch.read_text())
        converted[doc["metadata"]["name"]] = doc["spec"]["conversion"]
    out = []
    for path in sorted((root / "crds").glob("*.yaml")):
        for doc in _docs(path):
            conversion = converted.get(doc["metadata"]["name"])
            if conversion is not None:
                conversion = copy.deepcopy(conversion)
                hook = conversion["webhook"]
                path_ = hook["clientConfig"]["service"].get("path", "/convert")
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path_}",
                                        "caBundle": base64.b64encode(ca_pem).decode()}
                doc["spec"]["conversion"] = conversion
            out.append(doc)
    return out


def _kept(hook: dict[str, Any]) -> bool:
    """A webhook of Kueue's own objects or of an enabled integration."""
    wanted = set(INTEGRATIONS.values())
    for rule in hook.get("rules") or []:
        for group in rule.get("apiGroups") or []:
            if group == GROUP:
                continue
            if any((group, r) not in wanted for r in rule.get("resources") or []):
                return False
    return True


def webhook_configurations(manifests: Path, port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, only the hooks this cluster needs, on ``127.0.0.1:port``."""
    out = []
    for doc in _docs(manifests / "kueue" / "webhook" / "manifests.yaml"):
        doc["metadata"]["name"] = NAME_PREFIX + doc["metadata"]["name"]
        doc["webhooks"] = [h for h in doc["webhooks"] if _kept(h)]
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"].get("path", "/")
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                    "caBundle": base64.b64encode(ca_pem).decode()}
        out.append(doc)
    return out


def queue_objects(namespace: str, cluster_queue: str, local_queue: str, cpu: str,
                  preemption: bool = True) -> list[dict[str, Any]]:
    """A flavor, a ClusterQueue with ``cpu`` of quota (memory unlimited for the tests), and a
    LocalQueue in ``namespace`` pointing at it; with ``preemption``, a higher-priority workload
    preempts lower ones inside the ClusterQueue."""
    cq_spec: dict[str, Any] = {
        "namespaceSelector": {},
        "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [{
            "name": FLAVOR, "resources": [{"name": "cpu", "nominalQuota": cpu},
                                          {"name": "memory", "nominalQuota": "1Ti"}]}]}]}
    if preemption:
        cq_spec["preemption"] = {"withinClusterQueue": "LowerPriority"}
    return [
        {"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}},
        {"apiVersion": API, "kind": "ClusterQueue", "metadata": {"name": cluster_queue},
         "spec": cq_spec},
        {"apiVersion": API, "kind": "LocalQueue",
         "metadata": {"name": local_queue, "namespace": namespace},
         "spec": {"clusterQueue": cluster_queue}},
    ]


def priority_class(name: str, value: int) -> dict[str, Any]:
    """A WorkloadPriorityClass."""
    return {"apiVersion": API, "kind": "WorkloadPriorityClass", "metadata": {"name": name},
            "value": value, "description": "kfp-nvrx cluster tests"}
