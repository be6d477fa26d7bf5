"""Checks a rendered TrainJob and its TrainingRuntime the way the cluster would, offline.

The same three layers as :mod:`..pytorchjob.validate` for the PyTorchJob:

1. The Kubeflow Trainer v2.3.0 CRD schemas (vendored in ``schemas/``, sha256 in
   ``trainer-v2.3.0.SHA256SUMS``), strict: unknown fields are rejected.
2. The rules the schema's CEL expressions and the v2 admission webhooks enforce: name format and
   length, the torch plugin's reserved env names, a runtime reference and a patched replicated
   job that exist; and what only bites when the controllers build the job
   (:mod:`.validate_jobset`): the JobSet webhook's rules on the runtime's failure policy and on
   the JobSet-derived Job and pod names, the Job API's rules on its ``podFailurePolicy``.
3. The node Pod the controllers would create (runtime template + runtime patch + trainer fields +
   the torch plugin's env and port), checked by ``kubernetes-validate`` strict and the API-server
   resource rules.

Every failure is a :class:`UserError` naming the manifest field.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.naming import DNS1035, MAX_LABEL
from kfp_nvrx.components.launch.kube.validation import (
    K8S_VERSION,
    check_pod,
    check_schema,
)
from kfp_nvrx.components.launch.kube.validation import (
    crd_schema as _crd_schema,
)
from kfp_nvrx.components.launch.trainjob import runtime as rt
from kfp_nvrx.components.launch.trainjob.validate_jobset import (
    validate_jobset_names,
    validate_runtime,
)

SCHEMAS = Path(__file__).parent / "schemas"
TRAINJOB_CRD = SCHEMAS / "trainer.kubeflow.org_trainjobs.yaml"
RUNTIME_CRD = SCHEMAS / "trainer.kubeflow.org_trainingruntimes.yaml"
CLUSTER_RUNTIME_CRD = SCHEMAS / "trainer.kubeflow.org_clustertrainingruntimes.yaml"
#: The CRD each runtime kind is validated against.
RUNTIME_CRDS = {rt.RUNTIME_KIND: RUNTIME_CRD, rt.CLUSTER_RUNTIME_KIND: CLUSTER_RUNTIME_CRD}
#: The torch plugin injects these into the trainer container; the webhook rejects a TrainJob
#: whose ``trainer.env`` sets any of them (the pod's own reserved names: .jobspec.spec.RESERVED_ENV).
PLUGIN_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
              "PET_MASTER_PORT")
RUNTIME_KINDS = rt.RUNTIME_KINDS
MANAGED_BY = ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue")
MASTER_PORT = 29500
_TRAINJOB_PATCH_PATH = "spec.runtimePatches[0].trainingRuntimeSpec.template.spec"


def crd_schema(path: Path) -> dict[str, Any]:
    """Load a CRD's ``openAPIV3Schema`` in strict form."""
    return _crd_schema(path)


def validate_schema(manifest: dict[str, Any], path: Path) -> None:
    """CRD schema, strict. Raises UserError naming the first bad field."""
    check_schema(manifest, crd_schema(path), manifest.get("kind", "?"))


def _node_job(runtime_spec: dict[str, Any]) -> dict[str, Any] | None:
    jobs = ((runtime_spec.get("template") or {}).get("spec") or {}).get("replicatedJobs") or []
    return next((j for j in jobs if j.get("name") == rt.REPLICATED_JOB), None)


def _runtime_node_job(runtime: dict[str, Any]) -> dict[str, Any]:
    """The runtime's node job; a runtime without one is refused, naming the TrainJob's reference."""
    node = _node_job(runtime["spec"])
    if node is None:
        raise UserError("spec.runtimeRef.name", f"runtime {runtime['metadata']['name']} has no "
                        f"replicated job {rt.REPLICATED_JOB!r}")
    return node


_HTTP_PATH = re.compile(r"^[A-Za-z0-9/\-._~%!$&'()*+,;=:]+$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _domain_prefixed_path(value: str) -> bool:
    """Like apimachinery's IsDomainPrefixedPath: ``<DNS-1123 subdomain>/<http path>``."""
    host, _, path = value.partition("/")
    return bool(host and path and len(host) <= 253 and _DNS1123_SUBDOMAIN.match(host)
                and _HTTP_PATH.match(path))


def validate_rules(job: dict[str, Any], runtime: dict[str, Any]) -> None:
    """CEL and webhook rules of the TrainJob, checked against the runtime it refers to."""
    name = job.get("metadata", {}).get("name", "")
    if not name or len(name) > MAX_LABEL or not DNS1035.match(name):
        raise UserError("metadata.name", f"{name!r} must match RFC 1035 DNS label format "
                        f"(<= {MAX_LABEL} chars)")
    spec = job.get("spec") or {}
    _check_reference(spec, runtime)
    trainer = spec.get("trainer") or {}
    _check_trainer(trainer)
    if spec.get("activeDeadlineSeconds") is not None and spec["activeDeadlineSeconds"] < 1:
        raise UserError("spec.activeDeadlineSeconds", "must be at least 1")
    node_containers = {c.get("name") for c in _runtime_node_job(runtime)["template"]["spec"][
        "template"]["spec"].get("containers") or []}
    for p, patch in enumerate(spec.get("runtimePatches") or []):
        _check_patch(p, patch, node_containers)
    nodes = trainer.get("numNodes") or runtime["spec"].get("mlPolicy", {}).get("numNodes") or 1
    # Checked by the JobSet webhook only when the Trainer creates the JobSet (after acceptance).
    validate_jobset_names(name, nodes)


def _check_reference(spec: dict[str, Any], runtime: dict[str, Any]) -> None:
    """``runtimeRef`` names this runtime, by a kind and group the Trainer serves; ``managedBy``."""
    ref = spec.get("runtimeRef") or {}
    if ref.get("kind", "ClusterTrainingRuntime") not in RUNTIME_KINDS:
        raise UserError("spec.runtimeRef.kind", f"must be one of {', '.join(RUNTIME_KINDS)}")
    if ref.get("apiGroup", rt.GROUP) != rt.GROUP:
        raise UserError("spec.runtimeRef.apiGroup", f"must be {rt.GROUP}")
    if ref.get("name") != runtime["metadata"]["name"] or \
            ref.get("kind", "ClusterTrainingRuntime") != runtime["kind"]:
        raise UserError("spec.runtimeRef", f"refers to {ref.get('kind')}/{ref.get('name')}, not "
                        f"the runtime {runtime['kind']}/{runtime['metadata']['name']}")
    if spec.get("managedBy") not in (None, *MANAGED_BY):
        raise UserError("spec.managedBy", f"must be one of {', '.join(MANAGED_BY)}")


def _check_trainer(trainer: dict[str, Any]) -> None:
    """``spec.trainer``: no env the torch plugin injects, at least one node and process."""
    for i, env in enumerate(trainer.get("env") or []):
        if env.get("name") in PLUGIN_ENV:
            raise UserError(f"spec.trainer.env[{i}].name", f"{env['name']} is reserved: the "
                            "torch plugin injects it")
    for key in ("numNodes", "numProcPerNode"):
        if trainer.get(key) is not None and trainer[key] < 1:
            raise UserError(f"spec.trainer.{key}", "must be at least 1")


def _check_patch(p: int, patch: dict[str, Any], node_containers: set[Any]) -> None:
    """Runtime patch ``p``: a domain-prefixed manager; jobs and containers the runtime has."""
    if not _domain_prefixed_path(patch.get("manager") or ""):
        raise UserError(f"spec.runtimePatches[{p}].manager", "must be a domain-prefixed path "
                        "(such as 'acme.io/foo')")
    tmpl = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
    for j, rjob in enumerate((tmpl.get("spec") or {}).get("replicatedJobs") or []):
        where = f"spec.runtimePatches[{p}].trainingRuntimeSpec.template.spec.replicatedJobs[{j}]"
        if _node_job({"template": {"spec": {"replicatedJobs": [rjob]}}}) is None:
            raise UserError(f"{where}.name", f"the runtime has no replicated job "
                            f"{rjob.get('name')!r}")
        pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get(
            "spec") or {}
        for c, container in enumerate(pod.get("containers") or []):
            _check_patched_container(f"{where}.template.spec.template.spec.containers[{c}]",
                                     container, node_containers)


def _check_patched_container(cpath: str, container: dict[str, Any],
                             node_containers: set[Any]) -> None:
    # The Trainer webhook: a patch may change the runtime's containers, not add any, and the
    # node container's env belongs to trainer.env (PET_* injection).
    if container.get("name") not in node_containers:
        raise UserError(f"{cpath}.name", f"the runtime's {rt.REPLICATED_JOB!r} job "
                        f"has no container {container.get('name')!r}")
    if container.get("env"):
        raise UserError(f"{cpath}.env", "must not be set for the node container "
                        "(use spec.trainer.env)")


def _merge_named(base: list[dict], patch: list[dict], key: str = "name") -> list[dict]:
    """Merge two lists of objects keyed by ``key`` (list-type map), patch values winning.

    A container's ``volumeMounts`` merge by ``mountPath``, as the Trainer's strategic merge
    patch does (the runtime's /fsx mount stays beside a patched mount elsewhere).
    """
    out = [copy.deepcopy(b) for b in base]
    for item in patch:
        old = next((o for o in out if o.get(key) == item.get(key)), None)
        if old is None:
            out.append(copy.deepcopy(item))
            continue
        mounts = _merge_named(old.get("volumeMounts") or [], item.get("volumeMounts") or [],
                              "mountPath")
        old.update(copy.deepcopy(item))
        if mounts:
            old["volumeMounts"] = mounts
    return out


def node_pod(job: dict[str, Any], runtime: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """Build the Pod the controllers would create for node ``index``."""
    name = job["metadata"]["name"]
    base = copy.deepcopy(_runtime_node_job(runtime)["template"]["spec"]["template"])
    meta, pod = base.get("metadata") or {}, base["spec"]
    spec = job["spec"]
    for patch in spec.get("runtimePatches") or []:
        rjob = _node_job(patch.get("trainingRuntimeSpec") or {}) or {}
        ptmpl = ((rjob.get("template") or {}).get("spec") or {}).get("template") or {}
        for key in ("labels", "annotations"):
            if (ptmpl.get("metadata") or {}).get(key):
                meta.setdefault(key, {}).update(ptmpl["metadata"][key])
        for key, value in (ptmpl.get("spec") or {}).items():
            if isinstance(value, list) and key != "tolerations":
                pod[key] = _merge_named(pod.get(key) or [], value)
            elif isinstance(value, dict) and isinstance(pod.get(key), dict):
                pod[key] = {**pod[key], **value}
            else:
                pod[key] = copy.deepcopy(value)
    trainer = spec.get("trainer") or {}
    container = next(c for c in pod["containers"] if c["name"] == rt.CONTAINER_NAME)
    for key, field in (("image", "image"), ("command", "command"), ("args", "args"),
                       ("resourcesPerNode", "resources")):
        if trainer.get(key) is not None:
            container[field] = copy.deepcopy(trainer[key])
    injected: list[dict[str, Any]] = [{"name": "PET_NNODES", "value": str(trainer.get("numNodes", 1))},
                {"name": "PET_NPROC_PER_NODE", "value": str(trainer.get("numProcPerNode", 1))},
                {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": (
                    "metadata.annotations['batch.kubernetes.io/job-completion-index']")}}},
                {"name": "PET_MASTER_ADDR", "value": f"{name}-{rt.REPLICATED_JOB}-0-0.{name}"},
                {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)}]
    container["env"] = _merge_named(container.get("env") or [],
                                    [*(trainer.get("env") or []), *injected])
    container["ports"] = [{"containerPort": MASTER_PORT}]
    pod["hostname"], pod["subdomain"] = f"{name}-{rt.REPLICATED_JOB}-0-{index}", name
    meta["name"] = f"{name}-{rt.REPLICATED_JOB}-0-{index}-abcde"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod}


def validate_pod(job: dict[str, Any], runtime: dict[str, Any],
                 k8s_version: str = K8S_VERSION) -> None:
    """``kubernetes-validate`` strict on the node Pod, then the API-server resource rules."""
    check_pod(node_pod(job, runtime), _TRAINJOB_PATCH_PATH, "node pod ", k8s_version)


def validate_trainjob(job: dict[str, Any], runtime: dict[str, Any],
                      k8s_version: str = K8S_VERSION) -> None:
    """All layers for the TrainJob and its runtime; raises UserError on the first problem."""
    crd = RUNTIME_CRDS.get(runtime.get("kind", ""))
    if crd is None:
        raise UserError("kind", f"the runtime must be one of {', '.join(RUNTIME_KINDS)}")
    validate_schema(runtime, crd)
    validate_runtime(runtime)
    validate_schema(job, TRAINJOB_CRD)
    validate_rules(job, runtime)
    validate_pod(job, runtime, k8s_version)
