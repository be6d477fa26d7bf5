"""Checks a rendered PyTorchJob the way the cluster would, before anything is created.

Three layers, all offline:

1. The Training Operator CRD schema (release-1.9, vendored in ``schemas/``) with
   ``jsonschema.Draft7Validator`` in *strict* mode: ``additionalProperties: false`` is added to
   every object schema that lists its properties (unless it carries
   ``x-kubernetes-preserve-unknown-fields``), so an unknown or misspelt field fails here the way a
   strict API server (``kubectl apply --validate=strict``) rejects it.
2. The rules only the operator's admission webhook enforces (the schema cannot express them).
3. A Pod built from the worker template, checked by ``kubernetes-validate`` in strict mode against
   the core API schema, plus the API-server rules on resources that no schema carries.

Every failure is a :class:`UserError` naming the manifest field.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import yaml

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.naming import DNS1035, MAX_LABEL
from kfp_nvrx.components.launch.jobspec.spec import same_quantity

SCHEMA_PATH = Path(__file__).parent / "schemas" / "kubeflow.org_pytorchjobs.yaml"
#: Kubernetes minor version the pod template is validated against (EKS standard support).
K8S_VERSION = "1.30.0"
CONTAINER_NAME = "pytorch"
REPLICA_TYPES = ("Master", "Worker")
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
CLEAN_POD_POLICIES = ("All", "Running", "None")
MANAGED_BY = ("kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue")
_PRESERVE = "x-kubernetes-preserve-unknown-fields"


def _strict(node: Any) -> Any:
    """Add ``additionalProperties: false`` to every object schema that lists its properties."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get(_PRESERVE):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@functools.lru_cache(maxsize=1)
def crd_schema(strict: bool = True) -> dict[str, Any]:
    """Load the PyTorchJob ``openAPIV3Schema`` (strict unless asked otherwise)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(SCHEMA_PATH.read_text(), Loader=loader)  # noqa: S506 - a safe loader
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return _strict(copy.deepcopy(schema)) if strict else schema


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(root)"


def validate_schema(manifest: dict[str, Any]) -> None:
    """CRD schema, strict. Raises UserError naming the first bad field."""
    import jsonschema

    validator = jsonschema.Draft7Validator(crd_schema())
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        err = errors[0]
        raise UserError(_path(err.absolute_path),
                        f"rejected by the PyTorchJob schema: {err.message}")


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
        path = f"spec.pytorchReplicaSpecs.{rtype}"
        if rtype not in REPLICA_TYPES:
            raise UserError(path, f"replica type must be one of {', '.join(REPLICA_TYPES)}")
        containers = ((rspec or {}).get("template") or {}).get("spec", {}).get("containers") or []
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
            raise UserError(f"{path}.restartPolicy",
                            f"must be one of {', '.join(RESTART_POLICIES)}")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
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
    run = spec.get("runPolicy", {})
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


def _resource_rules(pod: dict[str, Any]) -> None:
    """API-server rules on containers that no JSON schema expresses."""
    spec = pod["spec"]
    volumes = {v["name"] for v in spec.get("volumes", [])}
    for i, c in enumerate(spec["containers"]):
        base = f"spec.containers[{i}]"
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        for key in set(req) | set(lim):
            extended = "/" in key and not key.startswith("kubernetes.io/")
            paired = extended or key.startswith("hugepages-")
            # As amounts, the way the API server compares them: 1Gi equals 1024Mi.
            if paired and not same_quantity(req.get(key), lim.get(key)):
                raise UserError(f"{base}.resources", f"{key}: request and limit must be equal")
        if any(k.startswith("hugepages-") for k in req) and not ({"cpu", "memory"} & set(req)):
            raise UserError(f"{base}.resources", "hugepages need a cpu or memory request")
        names = [e["name"] for e in c.get("env", [])]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise UserError(f"{base}.env", f"duplicate variables: {', '.join(dupes)}")
        paths = [m["mountPath"] for m in c.get("volumeMounts", [])]
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                raise UserError(f"{base}.volumeMounts", f"{m['name']!r} is not a volume of the pod")
        if len(paths) != len(set(paths)):
            raise UserError(f"{base}.volumeMounts", "mount paths must be unique")


def validate_pod(manifest: dict[str, Any], k8s_version: str = K8S_VERSION) -> None:
    """``kubernetes-validate`` strict on the worker Pod, then the API-server resource rules."""
    import kubernetes_validate

    pod = worker_pod(manifest)
    try:
        kubernetes_validate.validate(pod, k8s_version, strict=True)
    except kubernetes_validate.ValidationError as err:
        path = list(err.path)
        # A Pod's "spec" is the template's "spec": name the field as it sits in the PyTorchJob.
        where = _path(["spec.pytorchReplicaSpecs.Worker.template", *path]) \
            if path[:1] == ["spec"] else _path(["pod", *path])
        raise UserError(where, f"rejected by the Kubernetes {err.version} Pod schema: "
                        f"{err.message}") from None
    try:
        _resource_rules(pod)
    except UserError as err:
        field = f"spec.pytorchReplicaSpecs.Worker.template.{err.field}"
        raise UserError(field, err.message) from None


def validate_job(manifest: dict[str, Any], k8s_version: str = K8S_VERSION) -> None:
    """All three layers; raises UserError on the first problem."""
    validate_schema(manifest)
    validate_webhook(manifest)
    validate_pod(manifest, k8s_version)
