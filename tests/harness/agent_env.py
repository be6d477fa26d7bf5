"""What the test node agent computes for a container the way a kubelet does: its environment
(downward-API fields, Secret and ConfigMap references, ``$(VAR)`` expansion) and its command line.

Only what a pod spec says reaches the process, plus the image's usual defaults (PATH, HOME,
HOSTNAME). The image itself is not used: PATH starts with this checkout's virtual environment, so
``ft_launcher``, ``python`` and ``kfp-nvrx`` are the installed ones.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
BASE_PATH = f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_SUFFIX = {"": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
           "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
           "Pi": 2**50, "Ei": 2**60}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(?:[eE]([+-]?[0-9]+)|(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?)$")


class ConfigError(Exception):
    """The container cannot be started as specified (kubelet: ``CreateContainerConfigError``)."""


def quantity(text: str | int | float) -> Decimal:
    """Parse a Kubernetes resource quantity (``500m``, ``4Gi``, ``1e3``)."""
    m = _QUANTITY.match(str(text).strip())
    if not m:
        raise ConfigError(f"bad quantity {text!r}")
    value = Decimal(m.group(1))
    if m.group(2) is not None:
        return value * (Decimal(10) ** int(m.group(2)))
    return value * Decimal(_SUFFIX[m.group(3) or ""])


def expand(text: str, env: dict[str, str]) -> str:
    """Kubelet ``$(VAR)`` expansion: a defined VAR is replaced, an undefined one is kept as
    written, ``$$`` is a literal ``$`` (k8s.io/kubernetes third_party/forked/golang/expansion)."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 == n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:  # unterminated: the rest is literal
                out.append(text[i:])
                break
            name = text[i + 2:end]
            out.append(env[name] if name in env else text[i:end + 1])
            i = end + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def field_ref(pod: dict[str, Any], path: str) -> str:
    """The value of a downward-API ``fieldRef.fieldPath`` for ``pod``."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {
        "metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""), "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": status.get("hostIP", ""), "status.podIP": status.get("podIP", ""),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs") or []),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs") or []),
    }
    if path not in simple:
        raise ConfigError(f"unsupported fieldRef {path!r}")
    return simple[path]


def resource_ref(pod: dict[str, Any], container: dict[str, Any], ref: dict[str, Any],
                 allocatable: dict[str, str]) -> str:
    """A ``resourceFieldRef`` value: the limit (or request), else the node's allocatable, divided
    by the divisor and rounded up, as the kubelet does."""
    name = ref.get("containerName") or container["name"]
    target = next((c for c in pod["spec"]["containers"] if c["name"] == name), container)
    kind, _, res = ref["resource"].partition(".")
    value = ((target.get("resources") or {}).get(kind) or {}).get(res)
    if value is None:
        value = allocatable.get(res, "0")
    divisor = quantity(ref.get("divisor") or "1")
    return str(math.ceil(quantity(value) / divisor))


Lookup = Callable[[str, str, str], dict[str, str] | None]


def _key_ref(kind: str, ref: dict[str, Any], namespace: str, lookup: Lookup) -> str | None:
    data = lookup(kind, namespace, ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        if data is None:  # the kubelet's words (what the launcher reads back)
            raise ConfigError(f'{kind} "{ref["name"]}" not found')
        title = "Secret" if kind == "secret" else "ConfigMap"
        raise ConfigError(f"couldn't find key {ref['key']} in {title} {namespace}/{ref['name']}")
    return data[ref["key"]]


def container_env(pod: dict[str, Any], container: dict[str, Any], lookup: Lookup,
                  allocatable: dict[str, str], hostname: str) -> dict[str, str]:
    """The process environment of ``container``.

    Args:
        pod: The pod (with its status: ``podIP`` set).
        container: One of its containers.
        lookup: ``(kind, namespace, name)`` -> decoded data of a ``secret``/``configmap``, or None.
        allocatable: The node's allocatable resources (for resourceFieldRef without a limit).
        hostname: The pod's hostname.

    Raises:
        ConfigError: A reference cannot be resolved.
    """
    ns = pod["metadata"]["namespace"]
    env = {"PATH": BASE_PATH, "HOME": "/root", "HOSTNAME": hostname}
    for src in container.get("envFrom") or []:
        env.update(_env_from(src, ns, lookup))
    for item in container.get("env") or []:
        name, vf = item["name"], item.get("valueFrom")
        if vf is None:
            env[name] = expand(item.get("value", ""), env)  # may refer to earlier variables
            continue
        value = _value_from(name, vf, pod, container, lookup, allocatable)
        if value is not None:
            env[name] = value
    return env


def _env_from(src: dict[str, Any], namespace: str, lookup: Lookup) -> dict[str, str]:
    """The variables one ``envFrom`` entry brings (its ConfigMap's or Secret's data, prefixed)."""
    prefix = src.get("prefix", "")
    out: dict[str, str] = {}
    for kind, key in (("configmap", "configMapRef"), ("secret", "secretRef")):
        if key in src:
            data = lookup(kind, namespace, src[key]["name"])
            if data is None and not src[key].get("optional"):
                raise ConfigError(f'{kind} "{src[key]["name"]}" not found')
            out.update({prefix + k: v for k, v in (data or {}).items()})
    return out


def _value_from(name: str, vf: dict[str, Any], pod: dict[str, Any], container: dict[str, Any],
                lookup: Lookup, allocatable: dict[str, str]) -> str | None:
    """The value of env ``name``'s ``valueFrom`` (None: an optional key that is absent)."""
    ns = pod["metadata"]["namespace"]
    if "fieldRef" in vf:
        return field_ref(pod, vf["fieldRef"]["fieldPath"])
    if "resourceFieldRef" in vf:
        return resource_ref(pod, container, vf["resourceFieldRef"], allocatable)
    if "secretKeyRef" in vf:
        return _key_ref("secret", vf["secretKeyRef"], ns, lookup)
    if "configMapKeyRef" in vf:
        return _key_ref("configmap", vf["configMapKeyRef"], ns, lookup)
    raise ConfigError(f"env {name}: unsupported valueFrom {sorted(vf)}")


def container_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """``command`` + ``args`` after ``$(VAR)`` expansion (no image entrypoint exists here)."""
    argv = [expand(a, env) for a in (container.get("command") or [])]
    argv += [expand(a, env) for a in (container.get("args") or [])]
    if not argv:
        raise ConfigError(f"container {container['name']}: no command (the agent has no image "
                          "entrypoint to fall back on)")
    return argv


def decode_secret(obj: dict[str, Any]) -> dict[str, str]:
    """A Secret's ``data`` (base64) and ``stringData`` as text."""
    out = {k: base64.b64decode(v).decode("utf-8", "replace")
           for k, v in (obj.get("data") or {}).items()}
    out.update(obj.get("stringData") or {})
    return out
