"""The Kubernetes job APIs a training job runs on: what one is (:class:`JobApi`), and the registry.

Each job API is one folder of :mod:`kfp_nvrx.components.launch` that renders a resolved job into
its manifest and validates it the way the cluster would (``render.py``, ``validate.py``) and reads
the job object its controller writes while the launcher follows it (``follow.py``); its
``__init__`` holds ``API``, the :class:`JobApi` the launcher calls:

* ``trainjob``: a Kubeflow Trainer v2 TrainJob (:mod:`.trainjob`);
* ``pytorchjob``: a Training Operator v1 PyTorchJob (:mod:`.pytorchjob`).

The registry (:data:`REGISTRY`) names them; everything else (``--job-api`` and ``job_api``
choices, ``auto``'s discovery, the launch) reads it, so a new job API is a new folder and one line
there. ``auto`` (the default of every surface: CLI, KFP component, pipelines) asks the cluster
which API it serves, the first of the registry when several: Kubeflow 1.11 and later install
Trainer v2, older EKS set-ups the Training Operator. A folder is imported only when its API is
used, so the CLI and the pipelines read the names without the Kubernetes client.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kfp_nvrx.components.errors import UserError

if TYPE_CHECKING:
    from kfp_nvrx.components.core.config import Config
    from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
    from kfp_nvrx.components.launch.kube.followed import FollowedJob, Resource
    from kfp_nvrx.components.launch.options import KubernetesOptions

#: Every Kubernetes job API: its name (``--job-api``, ``job_api``) -> the package of its folder,
#: in the order ``auto`` prefers them when the cluster serves several.
REGISTRY: dict[str, str] = {
    "trainjob": "kfp_nvrx.components.launch.trainjob",
    "pytorchjob": "kfp_nvrx.components.launch.pytorchjob",
}
AUTO = "auto"
DEFAULT_JOB_API = AUTO
#: ``render-job`` prints a manifest without asking any cluster, so ``auto`` has no answer there;
#: it keeps the API it always rendered.
RENDER_JOB_API = "pytorchjob"


def names() -> tuple[str, ...]:
    """The registered job APIs, by name."""
    return tuple(sorted(REGISTRY))


def choices() -> tuple[str, ...]:
    """What ``--job-api`` / ``job_api`` accept: a registered job API, or ``auto`` (the last)."""
    return (*names(), AUTO)


@dataclass
class Rendered:
    """A rendered and validated job manifest, and the resolved job it was rendered from.

    Each job API subclasses it with its manifest (``job``) and says how to write it out.
    """

    resolved: ResolvedJob

    @property
    def name(self) -> str:
        """The job's name."""
        return self.resolved.name

    @property
    def run_dir(self) -> str:
        """The run directory inside the pods."""
        return self.resolved.run_dir

    @property
    def config(self) -> Config:
        """The loaded trainer config."""
        return self.resolved.config

    def to_dict(self) -> dict[str, Any]:
        """The manifest as plain JSON-able data (API field names): the body the launcher sends."""
        raise NotImplementedError

    def to_yaml(self, with_runtime: bool = False) -> str:
        """The manifest as YAML (``kubectl apply -f`` ready).

        ``with_runtime``: what it refers to first, when it refers to any (a TrainJob's runtime).
        """
        raise NotImplementedError

    def describe(self) -> str:
        """What is created, for the launcher's line: nodes, processes, run dir."""
        job = self.resolved
        return (f"{job.max_nodes} x {job.worker().profile.name} ({job.procs_per_node} procs "
                f"each), run dir {job.run_dir}")


@runtime_checkable
class JobApi(Protocol):
    """One Kubernetes job API: how a resolved job is refused, rendered and followed on it.

    Attributes:
        name: What ``--job-api`` / ``job_api`` say (the key of :data:`REGISTRY`).
        resource: Its custom resource (group, version, plural, kind): API discovery for ``auto``
            and every call on the job object.
    """

    name: str
    resource: Resource

    def refuse(self, job: ResolvedJob, opts: KubernetesOptions) -> None:
        """Raise UserError for what this API cannot express, naming the field."""

    def render(self, job: ResolvedJob, opts: KubernetesOptions) -> Rendered:
        """The job's manifest, validated the way the cluster would (raises UserError)."""

    def follow(self, job: ResolvedJob, client: Any, say: Callable[[str], None]) -> FollowedJob:
        """The calls on the job's object and the readings of it.

        ``client`` is a bounded ``ApiClient``; ``say`` takes the lines said once (a
        controller's warning).
        """


def get(name: str, field: str = "job_api") -> JobApi:
    """Return the registered job API ``name`` (not ``auto``: see :func:`pick`).

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


def served(client: Any) -> list[str]:
    """The registered job APIs the cluster serves (API discovery, one call each), in order."""
    from kubernetes.client.rest import ApiException

    from kfp_nvrx.components.launch.kube import calls

    out, host = [], calls.host_of(client)
    for name in REGISTRY:
        res = get(name).resource
        action = f"asking the API server for {res.group}/{res.version}"
        try:
            resp = calls.call(action, host, client.call_api, f"/apis/{res.group}/{res.version}",
                              "GET", response_type="object", auth_settings=["BearerToken"],
                              _return_http_data_only=True, ok=(404,))
        except ApiException:
            continue  # the group/version is not served
        resources = calls.expect_object(resp, action, host).get("resources") or []
        if any(isinstance(r, dict) and r.get("name") == res.plural for r in resources):
            out.append(name)
    return out


def pick(job_api: str, client: Any) -> str:
    """Return ``job_api``, or for ``auto`` the first registered API the cluster serves.

    Args:
        job_api: A registered name or ``auto``.
        client: An ``ApiClient`` (asked only for ``auto``; None: it serves none).

    Raises:
        UserError: ``job_api`` is not one of :func:`choices`.
        ClusterError: ``auto`` and the cluster serves none of them.
    """
    if job_api != AUTO:
        return get(job_api).name
    from kfp_nvrx.components.launch.kube.calls import ClusterError

    found = served(client) if client is not None else []
    if found:
        return found[0]
    wanted = " nor ".join(f"{r.plural}.{r.group} ({r.served_by})"
                          for r in (get(name).resource for name in REGISTRY))
    raise ClusterError(f"--job-api auto: the cluster serves neither {wanted}")
