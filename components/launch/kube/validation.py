"""The API server's checks of a job manifest, offline: what every job API's ``validate`` uses.

* a CRD's ``openAPIV3Schema`` in *strict* form (:func:`strict`): ``additionalProperties: false``
  on every object schema that lists its properties (unless it carries
  ``x-kubernetes-preserve-unknown-fields``), so an unknown or misspelt field fails here the way a
  strict API server (``kubectl apply --validate=strict``) rejects it;
* the Pod a controller would create, checked by ``kubernetes-validate`` in strict mode against the
  core API schema (:func:`check_pod`), plus the API-server rules on resources, env and mounts that
  no schema carries (:func:`resource_rules`).

Every failure is a :class:`UserError` naming the manifest field.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import yaml

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.spec import same_quantity

#: Kubernetes minor version the pod templates are validated against (EKS standard support).
K8S_VERSION = "1.30.0"
_PRESERVE = "x-kubernetes-preserve-unknown-fields"


def strict(node: Any) -> Any:
    """Add ``additionalProperties: false`` to every object schema that lists its properties."""
    if isinstance(node, dict):
        out = {k: strict(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get(_PRESERVE):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [strict(v) for v in node]
    return node


@functools.lru_cache(maxsize=8)
def crd_schema(path: Path, strict_form: bool = True) -> dict[str, Any]:
    """A vendored CRD's ``openAPIV3Schema`` (strict unless asked otherwise)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(path.read_text(), Loader=loader)  # noqa: S506 - a safe loader
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return strict(copy.deepcopy(schema)) if strict_form else schema


def field_path(parts: Any) -> str:
    """``spec.containers[0].env`` from ``["spec", "containers", 0, "env"]``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(root)"


def check_schema(manifest: dict[str, Any], schema: dict[str, Any], what: str) -> None:
    """``manifest`` against ``schema``; raises UserError naming the first bad field."""
    import jsonschema

    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        err = errors[0]
        raise UserError(field_path(err.absolute_path),
                        f"rejected by the {what} schema: {err.message}")


def resource_rules(pod: dict[str, Any]) -> None:
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


def check_pod(pod: dict[str, Any], spec_at: str, rules_at: str,
              k8s_version: str = K8S_VERSION) -> None:
    """``kubernetes-validate`` strict on ``pod``, then the API-server resource rules.

    Args:
        pod: The Pod a controller would create from the manifest.
        spec_at: Where the Pod's ``spec`` sits in the manifest: a bad field is named there.
        rules_at: What a resource rule's field is named after (``node pod ``).
        k8s_version: The Kubernetes version whose Pod schema applies.
    """
    import kubernetes_validate

    try:
        kubernetes_validate.validate(pod, k8s_version, strict=True)
    except kubernetes_validate.ValidationError as err:
        path = list(err.path)
        where = field_path([spec_at, *path[1:]]) if path[:1] == ["spec"] \
            else field_path(["pod", *path])
        raise UserError(where, f"rejected by the Kubernetes {err.version} Pod schema: "
                        f"{err.message}") from None
    try:
        resource_rules(pod)
    except UserError as err:
        raise UserError(f"{rules_at}{err.field}", err.message) from None
