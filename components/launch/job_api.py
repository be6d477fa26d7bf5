"""What one Kubernetes job API is: :class:`JobApi`, and the manifest it renders (:class:`Rendered`).

The interface every job API folder implements (:mod:`.pytorchjob`, :mod:`.trainjob`) and the
cluster launch (:mod:`.kube.job_run`) consumes; it sits below them and below the registry of
job APIs (:mod:`.job_apis`), which names the folders that implement it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kfp_nvrx.components.core.config import Config
    from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
    from kfp_nvrx.components.launch.kube.followed import FollowedJob, Resource
    from kfp_nvrx.components.launch.options import KubernetesOptions


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
        name: What ``--job-api`` / ``job_api`` say (the key of :data:`.job_apis.REGISTRY`).
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
