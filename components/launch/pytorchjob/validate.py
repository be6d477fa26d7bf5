"""Checks a rendered PyTorchJob the way the cluster would, before anything is created.

Three layers, all offline:

1. The Training Operator CRD schema (release-1.9, vendored in ``schemas/``) with
   ``jsonschema.Draft7Validator`` in *strict* mode (:mod:`..kube.validation`).
2. The rules only the operator's admission webhook enforces (the schema cannot express them).
3. A Pod built from the worker template, checked by ``kubernetes-validate`` in strict mode against
   the core API schema, plus the API-server rules on resources that no schema carries.

Every failure is a :class:`UserError` naming the manifest field.
"""

from __future__ import annotations

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

SCHEMA_PATH = Path(__file__).parent / "schemas" / "kubeflow.org_pytorchjobs.yaml"
CONTAINER_NAME = "pytorch"
REPLICA_TYPES = ("Master", "Worker")
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
CLEAN_POD_POLICIES = ("All", "Running", "None")
MANAGED_BY = ("kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue")
#: Where the worker Pod's ``spec`` sits in a PyTorchJob.
_POD_SPEC_AT = "spec.pytorchReplicaSpecs.Worker.template.spec"


def crd_schema(strict: bool = True) -> dict[str, Any]:
    """Load the PyTorchJob ``openAPIV3Schema`` (strict unless asked otherwise)."""
    return _crd_schema(SCHEMA_PATH, strict)


def validate_schema(manifest: dict[str, Any]) -> None:
    """CRD schema, strict. Raises UserError naming the first bad field."""
    check_schema(manifest, crd_schema(), "PyTorchJob")


def validate_webhook(manifest: dict[str, Any]) -> None:
    """Check the Training Operator webhook's rules (v1.9) and the operator's enumerations."""
    name = manifest.get("metadata", {}).get("name", "")
    if not name or len(name) > MAX_LABEL or not DNS1035.match(name):
        raise UserError("metadata.name", f"{name!r} must be a DNS-1035 label (<= 63 chars, "
                        "lower-case letters, digits, '-', starting with a letter)")
    spec = manifest.get("spec", {})
    replicas = spec.get("pytorchReplicaSpecs")
    if not replicas:
        raise UserError("spec.pytorchReplicaSpecs", "must be set")
    for rtype, rspec in replicas.items():
        _check_replica(name, rtype, rspec or {})
    if spec.get("elasticPolicy") is not None:
        _check_elastic(spec, replicas)
    _check_run_policy(spec.get("runPolicy", {}))


def _check_replica(name: str, rtype: str, rspec: dict[str, Any]) -> None:
    """One replica spec: its type, its containers, its count and restart policy."""
    path = f"spec.pytorchReplicaSpecs.{rtype}"
    if rtype not in REPLICA_TYPES:
        raise UserError(path, f"replica type must be one of {', '.join(REPLICA_TYPES)}")
    containers = (rspec.get("template") or {}).get("spec", {}).get("containers") or []
    if not containers:
        raise UserError(f"{path}.template.spec.containers", "must be specified")
    for i, c in enumerate(containers):
        if not c.get("image"):
            raise UserError(f"{path}.template.spec.containers[{i}].image", "is required")
    if not any(c.get("name") == CONTAINER_NAME for c in containers):
        raise UserError(f"{path}.template.spec.containers",
                        f"must have a container named {CONTAINER_NAME!r}")
    count = rspec.get("replicas")
    # Not the webhook's rule: the operator's Services <job>-<type>-<index> must be DNS-1035
    # labels, and it finds out only when it creates them (FailedCreateService).
    last = count - 1 if isinstance(count, int) and count > 0 else 0
    service = f"{name}-{rtype.lower()}-{last}"
    if len(service) > MAX_LABEL or not DNS1035.match(service):
        raise UserError("metadata.name", f"the operator's Service {service!r} would not be a "
                        f"DNS-1035 label of at most {MAX_LABEL} characters")
    if rtype == "Master" and count != 1:
        raise UserError(f"{path}.replicas", "must be 1 for Master")
    if count is not None and count < 1:
        raise UserError(f"{path}.replicas", "must be at least 1")
    policy = rspec.get("restartPolicy")
    if policy is not None and policy not in RESTART_POLICIES:
        raise UserError(f"{path}.restartPolicy", f"must be one of {', '.join(RESTART_POLICIES)}")


def _check_elastic(spec: dict[str, Any], replicas: dict[str, Any]) -> None:
    """``elasticPolicy``: on workers, one processes-per-node setting, a range that holds them."""
    elastic = spec["elasticPolicy"]
    if "Worker" not in replicas:
        raise UserError("spec.pytorchReplicaSpecs.Worker", "must be set with elasticPolicy")
    if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
        raise UserError("spec.elasticPolicy.nProcPerNode",
                        "must not be used with spec.nprocPerNode")
    lo, hi = elastic.get("minReplicas"), elastic.get("maxReplicas")
    if lo is not None and hi is not None and lo > hi:
        raise UserError("spec.elasticPolicy.minReplicas", "must not exceed maxReplicas")
    workers = replicas["Worker"].get("replicas")
    if workers is not None and hi is not None and workers > hi:
        raise UserError("spec.pytorchReplicaSpecs.Worker.replicas",
                        "must not exceed maxReplicas")


def _check_run_policy(run: dict[str, Any]) -> None:
    """``runPolicy``: no negative limits, a clean-pod policy and manager the operator knows."""
    for key in ("activeDeadlineSeconds", "ttlSecondsAfterFinished", "backoffLimit"):
        if run.get(key) is not None and run[key] < 0:
            raise UserError(f"spec.runPolicy.{key}", "must be >= 0")
    if run.get("cleanPodPolicy") not in (None, *CLEAN_POD_POLICIES):
        raise UserError("spec.runPolicy.cleanPodPolicy",
                        f"must be one of {', '.join(CLEAN_POD_POLICIES)}")
    if run.get("managedBy") not in (None, "", *MANAGED_BY):
        raise UserError("spec.runPolicy.managedBy", f"must be one of {', '.join(MANAGED_BY)}")


def worker_pod(manifest: dict[str, Any]) -> dict[str, Any]:
    """Build the Pod the operator would create for worker 0, for core-API checks."""
    template = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    meta = dict(template.get("metadata") or {})
    meta["name"] = f"{manifest['metadata']['name']}-worker-0"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def validate_pod(manifest: dict[str, Any], k8s_version: str = K8S_VERSION) -> None:
    """``kubernetes-validate`` strict on the worker Pod, then the API-server resource rules."""
    # A Pod's "spec" is the template's "spec": a field is named as it sits in the PyTorchJob.
    check_pod(worker_pod(manifest), _POD_SPEC_AT, "spec.pytorchReplicaSpecs.Worker.template.",
              k8s_version)


def validate_job(manifest: dict[str, Any], k8s_version: str = K8S_VERSION) -> None:
    """All three layers; raises UserError on the first problem."""
    validate_schema(manifest)
    validate_webhook(manifest)
    validate_pod(manifest, k8s_version)
