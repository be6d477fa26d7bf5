"""Checks of the cluster-facing ``JobSpec`` fields the API server or the kubelet would refuse.

Object names, label selectors, fsGroup and mount paths are checked; ``$`` in container arguments
is escaped (the kubelet would expand ``$(VAR)``).

Every renderer (PyTorchJob, TrainJob) calls :func:`check_cluster_fields` before it builds
anything, and passes every user string that ends up in a container's command through
:func:`escape_expansion`.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from kfp_nvrx.components.errors import UserError

#: DNS-1123 label (namespaces): lower-case alphanumerics and '-', at most 63 characters.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: DNS-1123 subdomain (service accounts, priority classes, scheduler names), at most 253.
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
#: The name part of a label key and a label value: alphanumerics, '-', '_', '.', at most 63.
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
#: Folders of the image a volume must not hide (mounted over, or over a folder holding them).
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/sbin", "/sys",
               "/usr", "/var/run", "/run")
#: Largest fsGroup (a Linux GID, int32 in the Pod API).
MAX_GID = 2**31 - 1


def _check(flag: str, value: str, pattern: re.Pattern[str], limit: int, what: str) -> None:
    if len(value) > limit or not pattern.match(value):
        raise UserError(flag, f"{value!r} is not a valid {what} (lower-case letters, digits and "
                        f"'-'{', ' + repr('.') if pattern is _DNS_SUBDOMAIN else ''}; at most "
                        f"{limit} characters)")


def check_label_key(flag: str, key: str) -> None:
    """Check a label key: ``[prefix/]name`` (prefix a DNS subdomain)."""
    prefix, slash, name = key.rpartition("/")
    if slash:
        _check(flag, prefix, _DNS_SUBDOMAIN, 253, "label key prefix")
    if len(name) > 63 or not _LABEL_NAME.match(name):
        raise UserError(flag, f"{key!r} is not a valid label key (letters, digits, '-', '_', "
                        "'.', at most 63 characters, optionally after a DNS prefix and '/')")


def check_label_value(flag: str, value: str) -> None:
    """Check a label value: empty, or like a label name."""
    if value and (len(value) > 63 or not _LABEL_NAME.match(value)):
        raise UserError(flag, f"{value!r} is not a valid label value (letters, digits, '-', '_', "
                        "'.', at most 63 characters)")


def check_mount_path(flag: str, path: str) -> None:
    """Refuse a mount path that would hide the image's system folders (``/``, ``/usr`` ...)."""
    norm = posixpath.normpath(path)
    for sysdir in SYSTEM_DIRS:
        if norm == "/" or norm == sysdir or norm.startswith(sysdir + "/") \
                or sysdir.startswith(norm.rstrip("/") + "/"):
            raise UserError(flag, f"{path} would hide {sysdir if norm != '/' else 'the whole '}"
                            f"{'' if norm != '/' else 'image'} in the pod; mount the volume at "
                            "its own folder such as /fsx")


def check_cluster_fields(spec: Any) -> None:
    """Check the names, selectors, fsGroup and mount paths of a ``JobSpec``.

    Raises:
        UserError: Naming the flag and what the API server would accept.

    """
    if spec.namespace:
        _check("namespace", spec.namespace, _DNS_LABEL, 63, "namespace")
    for flag, value in (("service_account", spec.service_account),
                        ("pod_priority_class", spec.pod_priority_class),
                        ("scheduler_name", spec.scheduler_name)):
        if value:
            _check(flag, value, _DNS_SUBDOMAIN, 253, "Kubernetes name")
    for key, value in dict(spec.node_selector).items():
        check_label_key("node_selector", key)
        check_label_value("node_selector", value)
    fs_group = spec.fs_group
    if fs_group is not None and (isinstance(fs_group, bool) or not isinstance(fs_group, int)
                                 or not 0 <= fs_group <= MAX_GID):
        raise UserError("fs_group", f"must be a group id within 0-{MAX_GID}, got {fs_group!r}")
    if spec.mount and spec.mount.startswith("/"):
        check_mount_path("mount", spec.mount)
    for item in spec.extra_pvcs:
        parts = str(item).split(":")
        if len(parts) >= 2 and parts[1].startswith("/"):
            check_mount_path("extra_pvcs", parts[1])


def escape_expansion(value: str) -> str:
    """Escape ``$`` for a container command, so the text reaches the program unchanged.

    The kubelet expands ``$(VAR)`` there (secret env values included) and reduces ``$$`` to
    ``$``, so doubling every ``$`` is exact.
    """
    return value.replace("$", "$$")
