"""Job names, labels and annotations.

The name of a PyTorchJob is derived from the KFP run id and task name, so the same run and task
always produce the same name: a launcher that KFP restarts finds the job it created before and
follows it instead of creating a second one.
"""

from __future__ import annotations

import hashlib
import re

from kfp_nvrx.components.errors import UserError

#: DNS-1035 label: what the Training Operator webhook requires of a PyTorchJob name.
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: Kubernetes label value syntax.
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
#: The operator names each replica's pod and headless Service ``<job>-worker-<index>``; a Service
#: name is itself a DNS-1035 label of at most 63 characters.
REPLICA_INFIX = "-worker-"
MAX_LABEL = 63
#: Derived names stay this short so any index up to 9999 still fits in a PyTorchJob's Service
#: name and in a TrainJob's pod names ``<job>-node-0-<index>-<5 characters>`` (the JobSet webhook
#: refuses longer ones when the Trainer creates the JobSet).
MAX_DERIVED = MAX_LABEL - len("-node-0-") - 4 - len("-abcde")

#: Label/annotation keys (prefix ``kfp-nvrx``: a valid DNS subdomain, owned by this package).
RUN_ID_KEY = "kfp-nvrx/run-id"
TASK_KEY = "kfp-nvrx/task"
VERSION_KEY = "kfp-nvrx/version"
CONFIG_KEY = "kfp-nvrx/config"
RUN_DIR_KEY = "kfp-nvrx/run-dir"
MANAGED_BY = "app.kubernetes.io/managed-by"


def _slug(text: str) -> str:
    """Lower-case, ``[a-z0-9-]`` only, no leading/trailing/double dashes."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return re.sub(r"-{2,}", "-", slug)


def derive_name(run_id: str, task: str) -> str:
    """Derive a stable DNS-1035 job name for a KFP run and task.

    Args:
        run_id: The KFP run id ('' outside KFP).
        task: The KFP task name (e.g. ``train-fsdp``).

    Returns:
        ``<task slug>-<10 hex chars of sha256(run_id/task)>``, at most :data:`MAX_DERIVED` chars,
        or ``kfp-nvrx-<task slug>`` when there is no run id.

    """
    base = _slug(task) or "train"
    if not base[0].isalpha():
        base = f"t-{base}"
    if not run_id:
        return f"kfp-nvrx-{base}"[:MAX_DERIVED].rstrip("-")
    digest = hashlib.sha256(f"{run_id}/{task}".encode()).hexdigest()[:10]
    base = base[: MAX_DERIVED - len(digest) - 1].rstrip("-")
    return f"{base}-{digest}"


def check_name(name: str, max_replicas: int) -> None:
    """Raise UserError naming ``name`` unless ``name`` works for the job and its Services."""
    if not DNS1035.match(name):
        raise UserError(
            "name",
            f"{name!r} is not a DNS-1035 label (lower-case letters, digits and '-', starting with "
            "a letter, ending with a letter or digit)",
        )
    longest = f"{name}{REPLICA_INFIX}{max_replicas - 1}"
    most = MAX_LABEL - len(REPLICA_INFIX) - len(str(max_replicas - 1))
    if len(longest) > MAX_LABEL:
        raise UserError(
            "name",
            f"{name!r} is too long: the operator's Service {longest!r} would exceed {MAX_LABEL} "
            f"characters; use at most {most}",
        )


def label_value(text: str) -> str:
    """Return ``text`` if it is a valid label value, else a readable slug + hash that is one."""
    if len(text) <= MAX_LABEL and _LABEL_VALUE.match(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    slug = _slug(text)[: MAX_LABEL - 11].strip("-")
    return f"{slug}-{digest}" if slug else digest


def name_taken(where: str, owner: str, run_id: str) -> UserError:
    """The error for a job name held by a job that is not this run's (``owner``: its run id).

    Says whose it is in words: "belongs to run '(none)', not '(none)'" told a user who gave no
    run id nothing.
    """
    fix = "delete it or choose another `name`"
    if not owner and not run_id:
        return UserError("name", f"{where} already exists; neither it nor this launch has a run "
                         f"id to tell whether it is this run's: {fix}, or give both a `run_id`")
    if not run_id:
        return UserError("name", f"{where} already exists and belongs to run {owner!r}; give "
                         f"`run_id={owner}` to follow it, or {fix}")
    if not owner:
        return UserError("name", f"{where} already exists and was made without a run id, not by "
                         f"run {run_id!r}; {fix}")
    return UserError("name", f"{where} already exists and belongs to run {owner!r}, not "
                     f"{run_id!r}; {fix}")
