"""The registry of the Kubernetes job APIs a training job runs on.

Each job API is one folder of :mod:`kfp_nvrx.components.launch` that renders a resolved job into
its manifest and validates it the way the cluster would (``render.py``, ``validate.py``) and reads
the job object its controller writes while the launcher follows it (``follow.py``); its
``__init__`` holds ``API``, the :class:`~.job_api.JobApi` the launcher calls:

* ``trainjob``: a Kubeflow Trainer v2 TrainJob (:mod:`.trainjob`);
* ``pytorchjob``: a Training Operator v1 PyTorchJob (:mod:`.pytorchjob`).

The registry (:data:`REGISTRY`) names them; everything else (``--job-api`` and ``job_api``
choices, ``auto``'s discovery, the launch) reads it, so a new job API is a new folder and one line
there. ``auto`` (:data:`.options.AUTO`, the default of every surface: CLI, KFP component,
pipelines) asks the cluster which API it serves, the first of the registry when several
(:mod:`.cluster_launch` asks): Kubeflow 1.11 and later install Trainer v2, older EKS set-ups the
Training Operator. A folder is imported only when its API is used, so the CLI and the pipelines
read the names without the Kubernetes client. The registry names the folders, so it sits above
them (``tests/unit/test_import_graph.py`` counts its imports by name); they implement
:mod:`.job_api`, below it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.job_api import JobApi
from kfp_nvrx.components.launch.options import AUTO

if TYPE_CHECKING:
    from kfp_nvrx.components.launch.kube.followed import Resource

#: Every Kubernetes job API: its name (``--job-api``, ``job_api``) -> the package of its folder,
#: in the order ``auto`` prefers them when the cluster serves several.
REGISTRY: dict[str, str] = {
    "trainjob": "kfp_nvrx.components.launch.trainjob",
    "pytorchjob": "kfp_nvrx.components.launch.pytorchjob",
}
#: ``render-job`` prints a manifest without asking any cluster, so ``auto`` has no answer there;
#: it keeps the API it always rendered.
RENDER_JOB_API = "pytorchjob"


def names() -> tuple[str, ...]:
    """The registered job APIs, by name."""
    return tuple(sorted(REGISTRY))


def choices() -> tuple[str, ...]:
    """What ``--job-api`` / ``job_api`` accept: a registered job API, or ``auto`` (the last)."""
    return (*names(), AUTO)


def get(name: str, field: str = "job_api") -> JobApi:
    """Return the registered job API ``name`` (not ``auto``: see :func:`.cluster_launch.pick`).

    Raises:
        UserError: ``name`` is not registered, naming ``field``.
    """
    if name not in REGISTRY:
        known = choices()
        raise UserError(field, f"must be {', '.join(known[:-1])} or {known[-1]}, got {name!r}")
    api = importlib.import_module(REGISTRY[name]).API
    if not isinstance(api, JobApi):
        raise TypeError(f"{REGISTRY[name]}.API is not a JobApi")  # a registry mistake, ours
    return api


def resources() -> list[Resource]:
    """The custom resource of every registered job API, by name (each API's folder is imported)."""
    return [get(name).resource for name in names()]
