"""What a Kubeflow install puts on the test cluster, from the upstream manifests at the built
versions: CRDs, the controllers' webhook configurations (kustomize's JSON patches applied, the
Service reference turned into a loopback URL with this run's CA), the upstream
``torch-distributed`` ClusterTrainingRuntime, and our own ``images/deploy`` objects.
"""

from __future__ import annotations

import base64
import copy
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from . import kueue

if TYPE_CHECKING:
    from .controlplane import ControlPlane

REPO = Path(__file__).resolve().parents[2]

#: Upstream webhook configurations: (controller, manifest, {kind: patch file}, registered name).
WEBHOOKS = {
    "trainer": ("trainer/webhook/manifests.yaml", {
        "MutatingWebhookConfiguration": "trainer/webhook/patch_mutating.yaml",
        "ValidatingWebhookConfiguration": "trainer/webhook/patch_validating.yaml"}),
    "jobset": ("jobset/webhook/manifests.yaml", {
        "MutatingWebhookConfiguration": "jobset/webhook/patches/mutating-patch.yaml",
        "ValidatingWebhookConfiguration": "jobset/webhook/patches/validating-patch.yaml"}),
    "training-operator": ("training-operator/webhook/manifests.yaml", {
        "ValidatingWebhookConfiguration": "training-operator/webhook/patch.yaml"}),
}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply RFC 6902 ``add``/``replace``/``remove`` operations (what kustomize's patches use)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent: Any = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if isinstance(parent, list):
            idx = len(parent) if last == "-" else int(last)
            if op["op"] == "add":
                parent.insert(idx, op["value"])
            elif op["op"] == "replace":
                parent[idx] = op["value"]
            else:
                del parent[idx]
        elif op["op"] in ("add", "replace"):
            parent[last] = op["value"]
        else:
            del parent[last]
    return doc


def webhook_configurations(manifests: Path, controller: str, port: int,
                           ca_pem: bytes) -> list[dict[str, Any]]:
    """One controller's webhook configurations, pointed at ``https://127.0.0.1:<port>``."""
    manifest, patches = WEBHOOKS[controller]
    out = []
    for doc in _docs(manifests / manifest):
        kind = doc["kind"]
        if kind in patches:
            doc = json_patch(doc, yaml.safe_load((manifests / patches[kind]).read_text()))
        doc["metadata"].pop("namespace", None)
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"].get("path", "/")
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                    "caBundle": base64.b64encode(ca_pem).decode()}
        out.append(doc)
    return out


def _dynamic(cp: ControlPlane):
    from kubernetes import client, config, dynamic

    api = config.new_client_from_config(config_file=str(cp.kubeconfig))
    return dynamic.DynamicClient(api), client


def apply(cp: ControlPlane, docs: list[dict[str, Any]], namespace: str | None = None,
          retry_s: float = 60.0) -> None:
    """Create (or server-side apply) each object; retries while a webhook is not yet serving.

    Args:
        cp: The control plane.
        docs: Objects.
        namespace: Namespace for namespaced objects without one.
        retry_s: How long to retry a refused call (webhook not up, CRD not yet established).
    """
    dyn, _ = _dynamic(cp)
    for doc in docs:
        deadline = time.monotonic() + retry_s
        while True:
            try:
                res = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
                ns = doc["metadata"].get("namespace") or (namespace if res.namespaced else None)
                res.server_side_apply(body=doc, namespace=ns, field_manager="kfp-nvrx-test",
                                      force_conflicts=True)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
                dyn.resources.invalidate_cache()


def crds(cp: ControlPlane) -> None:
    """Install the upstream CRDs (Kueue's too) and wait until each is Established."""
    m = cp.manifests
    files = sorted((m / "trainer" / "crds").glob("*.yaml")) + sorted(
        (m / "jobset" / "crds").glob("*.yaml")) + sorted(
        (m / "training-operator" / "crds").glob("*.yaml"))
    docs = [d for f in files for d in _docs(f) if d.get("kind") == "CustomResourceDefinition"]
    docs += kueue.crds(m, cp.ep.controller("kueue")["webhook"], cp.pki.ca_pem)
    apply(cp, docs)
    dyn, _ = _dynamic(cp)
    res = dyn.resources.get(api_version="apiextensions.k8s.io/v1",
                            kind="CustomResourceDefinition")
    deadline = time.monotonic() + 60
    for d in docs:
        while True:
            obj = res.get(name=d["metadata"]["name"]).to_dict()
            conds = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}
            if conds.get("Established") == "True":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"CRD {d['metadata']['name']} not Established: {conds}")
            time.sleep(0.2)


def namespaces(cp: ControlPlane, names: list[str]) -> None:
    """Create namespaces."""
    apply(cp, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}}
               for n in names])


def secret(cp: ControlPlane, namespace: str, name: str, data: dict[str, bytes]) -> None:
    """Create an Opaque Secret."""
    apply(cp, [{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": namespace},
                "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}])


def webhooks(cp: ControlPlane) -> None:
    """Register every controller's webhooks (Kueue's too) with this run's CA."""
    docs = []
    for controller in WEBHOOKS:
        port = cp.ep.controller(controller)["webhook"]
        docs += webhook_configurations(cp.manifests, controller, port, cp.pki.ca_pem)
    docs += kueue.webhook_configurations(cp.manifests, cp.ep.controller("kueue")["webhook"],
                                         cp.pki.ca_pem)
    apply(cp, docs)


def upstream_runtimes(cp: ControlPlane) -> None:
    """The upstream ``torch-distributed`` ClusterTrainingRuntime (what a default install has)."""
    apply(cp, _docs(cp.manifests / "trainer" / "runtimes" / "torch_distributed.yaml"))


def deploy_manifests(namespace: str) -> list[dict[str, Any]]:
    """Our images/deploy/base objects with kustomize's NamespaceTransformer applied.

    Namespaced objects get ``namespace``; RoleBinding ServiceAccount subjects move with them
    (``setRoleBindingSubjects: allServiceAccounts``); cluster-scoped objects are left alone.
    """
    base = REPO / "images" / "deploy" / "base"
    kust = yaml.safe_load((base / "kustomization.yaml").read_text())
    labels = {}
    for entry in kust.get("labels", []):
        labels.update(entry["pairs"])
    out = []
    for res in kust["resources"]:
        for doc in _docs(base / res):
            meta = doc.setdefault("metadata", {})
            meta.setdefault("labels", {}).update(labels)
            if doc["kind"] not in ("PersistentVolume", "StorageClass", "ClusterRole",
                                   "ClusterRoleBinding", "ClusterTrainingRuntime"):
                meta["namespace"] = namespace
            if doc["kind"] == "RoleBinding":
                for s in doc.get("subjects", []):
                    if s.get("kind") == "ServiceAccount":
                        s["namespace"] = namespace
            out.append(doc)
    return out


def ours(cp: ControlPlane, namespace: str) -> None:
    """Apply our deploy manifests (RBAC, the FSx PV/PVC, the ``kfp-nvrx-ft`` runtime)."""
    apply(cp, deploy_manifests(namespace))
