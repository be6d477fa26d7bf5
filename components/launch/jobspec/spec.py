"""``JobSpec``: what the user said about one training job, as plain values; nothing is derived here.

:func:`.resolve.resolve` turns it into the ``ResolvedJob`` every renderer and launcher reads (the
only place its values are derived and checked); the local backend uses only the trainer part
(nodes, processes, run dir, config, overrides, faults, env).
Parsing helpers here turn CLI strings (``--nodes 2:4``, ``--extra-pvc claim:/path:ro``) into
values and raise :class:`UserError` naming the JobSpec field (each surface words it: ``core.fields``).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kfp_nvrx.components.errors import UserError

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
#: Kubernetes resource names (PVCs, Secrets, PriorityClasses): DNS-1123 subdomain.
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
#: Variables the pod spec, ft_launcher or the Training Operator set, and why a user value would
#: break the job. Everything else (EFA/libfabric ``FI_*``, ``NCCL_*``, ``RDMAV_*``, ...) a user may
#: set; a user value replaces our default of the same name.
RESERVED_ENV = {
    "POD_IP": "the downward API sets it for ft_launcher --local-addr",
    "POD_NAME": "the downward API sets it",
    "POD_NAMESPACE": "the downward API sets it (the job's run-dir claim names it)",
    "KFP_NVRX_RUN_DIR": "the pod spec sets it: the run dir the pods claim (one writer per run dir)",
    "KFP_NVRX_RUN_HOLDER": "the pod spec sets it: the job that claims the run dir",
    "MASTER_ADDR": "ft_launcher sets it per worker from the rendezvous",
    "MASTER_PORT": "ft_launcher sets it per worker from the rendezvous",
    "WORLD_SIZE": "ft_launcher sets it per worker from the rendezvous",
    "RANK": "ft_launcher sets it per worker from the rendezvous",
    "LOCAL_RANK": "ft_launcher sets it per worker",
    "PYTHONUNBUFFERED": "the Training Operator sets it",
}


@dataclass
class JobSpec:
    """One training job.

    Attributes:
        image: Trainer image (must contain ``ft_launcher`` and this package).
        pvc: PersistentVolumeClaim of the shared file system (FSx for Lustre) for data, run dir and
            checkpoints; every pod mounts it at ``mount``.
        name: Job name; '' derives a stable one from ``run_id`` and ``task``.
        run_id: KFP run id (labels, annotations, stable name, re-attach).
        task: KFP task name.
        namespace: Namespace of the job ('' = the cluster connection's: its kubeconfig context's,
            or the pod's own in a cluster).
        nodes: ``N`` or ``MIN:MAX`` worker pods (elastic range).
        instance_type: Profile name (``p5.48xlarge``, ``p4d.24xlarge``, ``cpu``).
        nproc_per_node: Processes per pod; on GPU profiles one per GPU, so also the GPU request.
        mount: Mount path of ``pvc`` in every pod.
        run_dir: Run directory (checkpoints, events); '' = ``<runs_dir>/<name>``.
        runs_dir: Folder of the runs when ``run_dir`` is '' ('' = ``<mount>/runs``; locally
            ``runs``); what is wrong with it is said of ``run_dir``, the folder made from it.
        config: Trainer config preset or YAML path (as the pod sees it).
        overrides: Trainer ``--set section.key=value`` items.
        faults: Trainer ``--fault KIND@STEP[/RANK]`` items (drills).
        env: Extra container env.
        secret_env: ``NAME=secret:key`` items: env from Secrets.
        extra_pvcs: ``claim:/path[:ro]`` items: more PVC mounts.
        cpu, memory, efa, hugepages, shm_size: Overrides of the profile's values
            ('' / None = profile value; ``hugepages='0'`` drops the hugepages request).
        node_selector: Extra node selector terms (the instance type is always selected).
        tolerations: Extra tolerations (dicts in Kubernetes field names).
        affinity: Pod affinity (dict in Kubernetes field names) or None.
        queue_name: Kueue ``LocalQueue`` the job waits in for quota (the job's
            ``kueue.x-k8s.io/queue-name`` label; '' = not queued by Kueue).
        priority_class: Kueue ``WorkloadPriorityClass`` of the job (its
            ``kueue.x-k8s.io/priority-class`` label; needs ``queue_name``; '' = none).
        pod_priority_class: The worker pods' Kubernetes ``priorityClassName`` ('' = none).
        scheduler_name: ``schedulerName`` ('' = default scheduler).
        service_account: ``serviceAccountName`` of the worker pods ('' = namespace default).
        image_pull_policy: ``imagePullPolicy`` of the trainer container.
        fs_group: Pod ``fsGroup`` (with ``fsGroupChangePolicy: OnRootMismatch``) or None.
        active_deadline_s: ``runPolicy.activeDeadlineSeconds`` (None = no cluster-side limit).
        ttl_after_finished_s: ``runPolicy.ttlSecondsAfterFinished`` (None = keep forever).
        backoff_limit: ``runPolicy.backoffLimit``.

    """

    image: str = ""
    pvc: str = ""
    name: str = ""
    run_id: str = ""
    task: str = "train"
    namespace: str = ""
    nodes: str = "1"
    instance_type: str = "p5.48xlarge"
    nproc_per_node: int | None = None
    mount: str = "/fsx"
    run_dir: str = ""
    runs_dir: str = ""
    config: str = "tiny"
    overrides: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    secret_env: list[str] = field(default_factory=list)
    extra_pvcs: list[str] = field(default_factory=list)
    cpu: str = ""
    memory: str = ""
    efa: int | None = None
    hugepages: str = ""
    shm_size: str = ""
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] | None = None
    queue_name: str = ""
    priority_class: str = ""
    pod_priority_class: str = ""
    scheduler_name: str = ""
    service_account: str = ""
    image_pull_policy: str = "IfNotPresent"
    fs_group: int | None = None
    active_deadline_s: int | None = 7 * 24 * 3600
    ttl_after_finished_s: int | None = 24 * 3600
    backoff_limit: int = 3


# -- parsers for CLI strings ---------------------------------------------------------------------


#: More nodes than any cluster has (and than a local launcher could start).
MAX_NODES = 65_536


def parse_nodes(text: str | int) -> tuple[int, int]:
    """``"N"`` -> (N, N); ``"MIN:MAX"`` -> (MIN, MAX); raises UserError naming ``nodes``."""
    raw = str(text).strip()
    parts = raw.split(":")
    if len(parts) not in (1, 2) or not all(re.fullmatch(r"-?[0-9]+", p.strip()) for p in parts):
        raise UserError("nodes", f"expected N or MIN:MAX (integers), got {raw!r}")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo < 1:
        raise UserError("nodes", f"need at least 1 node, got {raw!r}")
    if lo > hi:
        raise UserError("nodes", f"MIN must not exceed MAX, got {raw!r}")
    if hi > MAX_NODES:  # 2**70 nodes raised OverflowError in the local launcher (exit 1)
        raise UserError("nodes", f"at most {MAX_NODES:,} nodes, got {raw!r}")
    return lo, hi


def check_procs(n: object) -> int:
    """Processes per node: an integer >= 1 (raises UserError naming ``nproc_per_node``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError("nproc_per_node", f"must be an integer >= 1, got {n!r}")
    return n


def check_seconds(flag: str, value: object, least: int) -> None:
    """``None`` or a whole number of seconds >= ``least`` (raises UserError naming ``flag``)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < least):
        raise UserError(flag, f"must be a whole number of seconds >= {least}, got {value!r}")


def check_abs_path(flag: str, path: str) -> str:
    """Return a normalised absolute POSIX path, or raise UserError naming ``flag``."""
    if not path or not path.startswith("/"):
        raise UserError(flag, f"must be an absolute path, got {path!r}")
    if any(part == ".." for part in path.split("/")):
        raise UserError(flag, f"must not contain '..', got {path!r}")
    return posixpath.normpath(path)


def check_quantity(flag: str, value: str) -> str:
    """Check a Kubernetes resource quantity (``64Gi``, ``500m``, ``180``)."""
    if not _QUANTITY.match(value):
        raise UserError(flag, f"expected a Kubernetes quantity like 64Gi, 500m or 8, got {value!r}")
    return value


def quantity(value: str) -> Decimal:
    """The amount a Kubernetes quantity stands for: ``1Gi`` and ``1024Mi`` are one amount.

    Parsed by the Kubernetes client's own ``parse_quantity``, so we compare as the API server
    does, never the text.

    Raises:
        ValueError: ``value`` is not a quantity.
    """
    from kubernetes.utils.quantity import parse_quantity  # the client's import is not free

    return parse_quantity(value)


def same_quantity(a: Any, b: Any) -> bool:
    """Whether two values are one amount (``1Gi``, ``1024Mi``); non-quantities: the same text."""
    try:
        return quantity(a) == quantity(b)
    except ValueError:
        return str(a) == str(b)


def check_resource_name(flag: str, value: str) -> str:
    """Check a Kubernetes object name (DNS-1123 subdomain)."""
    if not value or len(value) > 253 or not _DNS1123.match(value):
        raise UserError(flag,
                        f"expected a Kubernetes object name (lower-case, '-', '.'), got {value!r}")
    return value


def check_image(value: str) -> str:
    """Check the trainer image: required, and a reference by the container reference grammar."""
    from kfp_nvrx.components.images import check_reference

    return check_reference("image", value)


def parse_key_values(flag: str, items: list[str]) -> dict[str, str]:
    """``K=V`` items -> dict; raises UserError naming ``flag``."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(flag, f"expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


def check_env_name(flag: str, name: str) -> str:
    """Check for a valid env var name that the pod spec does not own."""
    if not _ENV_NAME.match(name):
        raise UserError(flag, f"{name!r} is not a valid environment variable name")
    if name in RESERVED_ENV:
        raise UserError(flag, f"{name} is ours: {RESERVED_ENV[name]}; don't set it")
    if name.startswith("PET_"):
        raise UserError(flag, f"{name} is ours: the Training Operator sets PET_* from "
                              "elasticPolicy (use `nodes`, `nproc_per_node`, "
                              "`overrides=resilience.max_restarts=N`)")
    return name


def parse_secret_env(item: str) -> tuple[str, str, str]:
    """``NAME=secret:key`` -> (NAME, secret, key)."""
    name, sep, ref = item.partition("=")
    secret, sep2, key = ref.partition(":")
    if not sep or not sep2 or not key:
        raise UserError("secret_env", f"expected NAME=SECRET:KEY, got {item!r}")
    check_env_name("secret_env", name.strip())
    check_resource_name("secret_env", secret.strip())
    return name.strip(), secret.strip(), key.strip()


def parse_extra_pvc(item: str) -> tuple[str, str, bool]:
    """``claim:/path[:ro]`` -> (claim, path, read_only)."""
    parts = item.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise UserError("extra_pvcs", f"expected CLAIM:/PATH[:ro], got {item!r}")
    claim = check_resource_name("extra_pvcs", parts[0])
    path = check_abs_path("extra_pvcs", parts[1])
    return claim, path, len(parts) == 3 and parts[2] == "ro"


def parse_toleration(item: str) -> dict[str, str]:
    """``KEY[=VALUE]:EFFECT`` -> a toleration dict (``Exists`` when there is no value)."""
    spec, sep, effect = item.rpartition(":")
    effects = ("NoSchedule", "PreferNoSchedule", "NoExecute")
    if not sep or effect not in effects or not spec:
        raise UserError("tolerations", f"expected KEY[=VALUE]:{'|'.join(effects)}, got {item!r}")
    key, eq, value = spec.partition("=")
    if eq:
        return {"key": key, "operator": "Equal", "value": value, "effect": effect}
    return {"key": key, "operator": "Exists", "effect": effect}
