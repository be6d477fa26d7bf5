"""Cluster manifests under images/deploy: strict schema validation, kustomize structure, contents.

No Kubernetes API server exists here, so objects are validated offline with kubernetes-validate
(strict: unknown fields are errors, as ``kubectl apply --validate=strict`` would report). The
kustomizations are rendered by a small renderer below (resources, components, strategic-merge
patches of whole objects, the NamespaceTransformer and labels: everything these files use); where
a ``kubectl``/``kustomize`` binary exists, its ``kustomize`` output must equal ours, so the
renderer cannot drift from the real tool.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kfp_nvrx.components.launch.trainjob.validate import RUNTIME_CRD, validate_schema

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "images/deploy"
K8S_VERSION = "1.30"
BUILDS = ["base", "overlays/p5"]
CLUSTER_SCOPED = {"PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "Namespace", "PriorityClass"}
KUSTOMIZE_KINDS = {"Kustomization", "Component"}
TRAINER_GROUP = "trainer.kubeflow.org/"


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomizations() -> list[Path]:
    return sorted(DEPLOY.rglob("kustomization.yaml"))


# --------------------------------------------------------------------------------------------
# A renderer for the kustomize features these files use.
# --------------------------------------------------------------------------------------------
def _merge(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def render(directory: Path) -> list[dict]:
    """Objects of a kustomization (or component) directory, transformed as kustomize does."""
    kust = load(directory / "kustomization.yaml")[0]
    objs: list[dict] = []
    for entry in kust.get("resources", []):
        path = directory / entry
        objs += render(path) if path.is_dir() else load(path)
    for entry in kust.get("components", []):
        objs += render(directory / entry)
    for entry in kust.get("patches", []):
        _patch(objs, directory, entry["path"])
    for label in kust.get("labels", []):
        assert label.get("includeSelectors") is False  # only metadata labels are implemented
        for obj in objs:
            obj["metadata"].setdefault("labels", {}).update(label["pairs"])
    for entry in kust.get("transformers", []):
        _transform(objs, directory / entry)
    return objs


def _patch(objs: list[dict], directory: Path, name: str) -> None:
    """Merge each strategic-merge patch of ``directory/name`` into the one object it names."""
    for patch in load(directory / name):
        key = (patch["kind"], patch["metadata"]["name"])
        hits = [i for i, o in enumerate(objs) if (o["kind"], o["metadata"]["name"]) == key]
        assert len(hits) == 1, f"{directory}/{name}: patch target {key} not unique"
        objs[hits[0]] = _merge(objs[hits[0]], patch)


def _transform(objs: list[dict], path: Path) -> None:
    """Apply the NamespaceTransformer in ``path`` (the only transformer these files use)."""
    (cfg,) = load(path)
    assert cfg["kind"] == "NamespaceTransformer", f"unsupported transformer {cfg['kind']}"
    namespace = cfg["metadata"]["namespace"]
    all_subjects = cfg.get("setRoleBindingSubjects") == "allServiceAccounts"
    for obj in objs:
        if obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace
        if obj["kind"] == "RoleBinding" and all_subjects:
            for subject in obj["subjects"]:
                if subject["kind"] == "ServiceAccount":
                    subject["namespace"] = namespace


def _key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@pytest.fixture(scope="module", params=BUILDS)
def built(request: pytest.FixtureRequest) -> tuple[str, dict[tuple[str, str], dict]]:
    objs = render(DEPLOY / request.param)
    keys = [_key(o) for o in objs]
    assert len(keys) == len(set(keys)), f"duplicate objects in {request.param}"
    return request.param, dict(zip(keys, objs, strict=True))


def _gib(quantity: str) -> int:
    m = re.fullmatch(r"(\d+)(Gi|Ti)", quantity)
    assert m, f"{quantity}: use Gi or Ti"
    return int(m[1]) * (1024 if m[2] == "Ti" else 1)


# --------------------------------------------------------------------------------------------
# Files and structure
# --------------------------------------------------------------------------------------------
def test_every_file_is_used_and_every_reference_exists() -> None:
    used = set()
    for kust_path in kustomizations():
        kust = load(kust_path)[0]
        assert kust["kind"] in KUSTOMIZE_KINDS
        here = kust_path.parent
        refs = [*kust.get("resources", []), *kust.get("components", []),
                *(p["path"] for p in kust.get("patches", [])), *kust.get("transformers", [])]
        for ref in refs:
            path = (here / ref).resolve()
            assert path.exists(), f"{kust_path}: {ref} does not exist"
            used.add(path / "kustomization.yaml" if path.is_dir() else path)
    files = {p.resolve() for p in DEPLOY.rglob("*.yaml")}
    top = {p.resolve() for p in kustomizations() if p.parent.name in ("base", "p5")}
    assert files - used - top == set(), "YAML files no kustomization uses"


def test_every_object_file_validates_strict() -> None:
    kinds = set()
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in load(path):
            if doc["kind"] in KUSTOMIZE_KINDS or doc["apiVersion"] == "builtin":
                continue
            if doc["apiVersion"].startswith(TRAINER_GROUP):
                validate_schema(doc, RUNTIME_CRD)  # the vendored v2.3.0 CRD, strict
                kinds.add(doc["kind"])
                continue
            if "spec" in doc and "overlays" in path.parts:
                continue  # partial patches: validated below, merged into what they patch
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            kinds.add(doc["kind"])
    assert kinds >= {"ServiceAccount", "Role", "RoleBinding", "PersistentVolume",
                     "PersistentVolumeClaim", "StorageClass", "TrainingRuntime"}


def test_strict_validation_rejects_unknown_fields() -> None:
    (pvc,) = load(DEPLOY / "fsx-dynamic/pvc.yaml")
    pvc["spec"]["storageclass"] = "typo"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pvc, K8S_VERSION, strict=True)


def test_built_objects_validate_strict_in_one_namespace(built) -> None:
    name, objs = built
    namespaces = set()
    for obj in objs.values():
        if obj["apiVersion"].startswith(TRAINER_GROUP):
            validate_schema(obj, RUNTIME_CRD)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kfp-nvrx"
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], _key(obj)
        else:
            namespaces.add(obj["metadata"]["namespace"])
    for subject in objs[("RoleBinding", "kfp-nvrx-launcher")]["subjects"]:
        namespaces.add(subject["namespace"])
    assert len(namespaces) == 1, f"{name}: objects and subjects in {namespaces}"


@pytest.mark.skipif(not (shutil.which("kubectl") or shutil.which("kustomize")),
                    reason="no kubectl/kustomize binary to compare the renderer with")
@pytest.mark.parametrize("build", BUILDS)
def test_renderer_matches_real_kustomize(build: str) -> None:
    cmd = (["kubectl", "kustomize"] if shutil.which("kubectl") else ["kustomize", "build"])
    out = subprocess.run([*cmd, str(DEPLOY / build)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    real = {_key(o): o for o in yaml.safe_load_all(out) if o}
    ours = {_key(o): o for o in render(DEPLOY / build)}
    assert real == ours


# --------------------------------------------------------------------------------------------
# Contents
# --------------------------------------------------------------------------------------------
def test_rbac_is_exactly_what_the_launcher_needs(built) -> None:
    _, objs = built
    assert not [k for k in objs if k[0] in ("ClusterRole", "ClusterRoleBinding")]
    granted = set()
    for rule in objs[("Role", "kfp-nvrx-launcher")]["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, res, verb)
                    granted.add((group, res, verb))
    want = {("kubeflow.org", "pytorchjobs", v) for v in ("create", "get", "list", "watch",
                                                          "delete")}
    want |= {("trainer.kubeflow.org", "trainjobs", v) for v in ("create", "get", "list",
                                                                "watch", "delete")}
    want |= {("trainer.kubeflow.org", "trainingruntimes", v) for v in ("get", "list")}
    want |= {("", "pods", v) for v in ("get", "list", "watch")}
    want |= {("", "pods/log", "get"), ("", "events", "list")}
    # Kueue: a queued job's LocalQueue and Workload (why it waits, why it was preempted).
    want |= {("kueue.x-k8s.io", "localqueues", "get"), ("kueue.x-k8s.io", "workloads", "list")}
    assert granted == want
    binding = objs[("RoleBinding", "kfp-nvrx-launcher")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "kfp-nvrx-launcher"}
    names = {s["name"] for s in binding["subjects"] if s["kind"] == "ServiceAccount"}
    assert ("ServiceAccount", "kfp-nvrx-launcher") in objs and "kfp-nvrx-launcher" in names


def test_static_fsx_volume_and_claim(built) -> None:
    _, objs = built
    pv, pvc = objs[("PersistentVolume", "kfp-nvrx-shared")], objs[("PersistentVolumeClaim",
                                                                  "kfp-nvrx-shared")]
    csi = pv["spec"]["csi"]
    assert csi["driver"] == "fsx.csi.aws.com"
    assert re.fullmatch(r"fs-[0-9a-f]{8,17}", csi["volumeHandle"])
    attrs = csi["volumeAttributes"]
    assert re.fullmatch(rf"{csi['volumeHandle']}\.fsx\.[a-z0-9-]+\.amazonaws\.com",
                        attrs["dnsname"])
    assert re.fullmatch(r"[a-z0-9]{8}", attrs["mountname"])
    assert "flock" in pv["spec"]["mountOptions"]
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    # Static binding: no class on either side, the claim names the volume.
    assert pv["spec"]["storageClassName"] == pvc["spec"]["storageClassName"] == ""
    assert pvc["spec"]["volumeName"] == "kfp-nvrx-shared"
    assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert _gib(pvc["spec"]["resources"]["requests"]["storage"]) <= _gib(
        pv["spec"]["capacity"]["storage"])


def scratch2_size_ok(gib: int) -> bool:
    """SCRATCH_2 capacities: 1200 GiB, 2400 GiB or a multiple of 2400 GiB (FSx CSI driver docs)."""
    return gib in (1200, 2400) or (gib > 0 and gib % 2400 == 0)


def test_scratch2_size_rule() -> None:
    assert [g for g in (1200, 2400, 3600, 4800, 7200, 1000) if scratch2_size_ok(g)] == [
        1200, 2400, 4800, 7200]


def test_dynamic_scratch_class_and_claim() -> None:
    objs = {_key(o): o for o in render(DEPLOY / "overlays/p5")}
    sc = objs[("StorageClass", "kfp-nvrx-scratch")]
    assert sc["provisioner"] == "fsx.csi.aws.com"
    params = sc["parameters"]
    assert params["deploymentType"] == "SCRATCH_2"
    assert re.fullmatch(r"subnet-[0-9a-f]{8,17}", params["subnetId"])
    assert all(re.fullmatch(r"sg-[0-9a-f]{8,17}", g) for g in params["securityGroupIds"].split(","))
    assert "flock" in sc["mountOptions"]
    claims = [o for o in objs.values() if o["kind"] == "PersistentVolumeClaim"
              and o["spec"].get("storageClassName") == "kfp-nvrx-scratch"]
    assert claims
    for claim in claims:
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        assert scratch2_size_ok(_gib(claim["spec"]["resources"]["requests"]["storage"]))
    (example,) = load(DEPLOY / "fsx-dynamic/pvc.yaml")
    assert scratch2_size_ok(_gib(example["spec"]["resources"]["requests"]["storage"]))


def test_p5_overlay_places_storage_in_the_gpu_zone() -> None:
    base = {_key(o): o for o in render(DEPLOY / "base")}
    p5 = {_key(o): o for o in render(DEPLOY / "overlays/p5")}
    assert set(base) < set(p5)
    pv = p5[("PersistentVolume", "kfp-nvrx-shared")]
    (term,) = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    (expr,) = term["matchExpressions"]
    assert expr["key"] == "topology.kubernetes.io/zone" and expr["operator"] == "In"
    assert all(re.fullmatch(r"[a-z]{2}-[a-z]+-\d[a-z]", z) for z in expr["values"])
    # Only the patched fields differ from the base.
    assert {k: v for k, v in pv["spec"].items() if k != "nodeAffinity"} == base[
        ("PersistentVolume", "kfp-nvrx-shared")]["spec"]


def test_cluster_setup_guide_names_paths_that_exist() -> None:
    text = (ROOT / "docs/eks.md").read_text()
    m = re.search(r"^## Cluster setup\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, "docs/eks.md has no '## Cluster setup' section"
    paths = set(re.findall(r"\bimages/[\w./-]*[\w/]", m[1]))
    assert {"images/deploy/overlays/p5", "images/trainer/Dockerfile",
            "images/components/Dockerfile"} <= paths
    for path in paths:
        assert (ROOT / path).exists(), f"docs/eks.md mentions {path}, which does not exist"


def test_compiled_pipelines_default_to_the_shared_claim() -> None:
    claim = {_key(o): o for o in render(DEPLOY / "base")}[("PersistentVolumeClaim",
                                                           "kfp-nvrx-shared")]
    compiled = sorted((ROOT / "pipelines/compiled").glob("*.yaml"))
    assert compiled
    for path in compiled:
        spec = next(yaml.safe_load_all(path.read_text()))
        params = spec["root"]["inputDefinitions"]["parameters"]
        assert params["pvc_name"]["defaultValue"] == claim["metadata"]["name"], path.name
