"""How a resolved job is launched: the options of the two backends and of following a cluster job.

* :class:`LocalOptions`: N ``ft_launcher`` agents on this machine (:mod:`.local`);
* :class:`KubernetesOptions`: which job API (:mod:`.job_apis`), which cluster (:mod:`.kube.cluster`),
  the TrainJob's runtime, and how the job is followed (:class:`FollowOptions`).

The job itself (namespace included) is the ``ResolvedJob``'s alone; these say only how to run it.
Torch-free and client-free: the CLI and the KFP component build them before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.resolve import BACKENDS, KUBERNETES, LOCAL
from kfp_nvrx.components.launch.kube.missing import MISSING_S

if TYPE_CHECKING:
    from kfp_nvrx.components.launch.kube.cluster import Cluster

DELETE_AFTER = ("always", "on_success", "never")
#: ``job_api``: ask the cluster which registered job API it serves (:mod:`.cluster_launch`).
AUTO = "auto"
#: The job API of every surface (CLI, KFP component, pipelines) unless told otherwise.
DEFAULT_JOB_API = AUTO


@dataclass(frozen=True)
class LocalOptions:
    """How to run a job on this machine.

    Attributes:
        deadline_s: Wall-clock limit in seconds (None = none).
    """

    deadline_s: float | None = None


@dataclass(frozen=True)
class FollowOptions:
    """How to follow a job on a cluster.

    Attributes:
        deadline_s: Seconds after the job's creation before the launcher gives up (None:
            ``activeDeadlineSeconds`` + :data:`.kube.follow.DEADLINE_MARGIN_S`, or no limit).
        delete_after: ``always`` | ``on_success`` | ``never``: delete the job when it ends.
        poll_s: Seconds between job status reads.
        progress_s: Seconds between progress lines (0: on every change).
        tail_lines: Log lines of the failing replica kept in the result.
        watch_timeout_s: Length of one pod watch request.
        handle_signals: Install SIGTERM/SIGINT handlers (main thread only) that delete the job.
        drain_s: Seconds open log streams may run on after the end (last lines of the pods).
        no_controller_s: Seconds without any job status before the launcher asks whether the
            job's controller runs (a CRD installed without its controller).
        missing_s: Seconds the pods may wait for a PVC or Secret that does not exist before
            the launch fails (:mod:`.kube.missing`).
    """

    deadline_s: float | None = None
    delete_after: str = "on_success"
    poll_s: float = 5.0
    progress_s: float = 30.0
    tail_lines: int = 40
    watch_timeout_s: int = 30
    handle_signals: bool = True
    drain_s: float = 5.0
    no_controller_s: float = 120.0
    missing_s: float = MISSING_S

    def checked(self) -> FollowOptions:
        """These options, ``delete_after`` checked.

        Raises:
            UserError: ``delete_after`` is not one of :data:`DELETE_AFTER`.
        """
        if self.delete_after not in DELETE_AFTER:
            raise UserError("delete_after", f"must be one of {', '.join(DELETE_AFTER)}, "
                            f"got {self.delete_after!r}")
        return self


@dataclass(frozen=True)
class KubernetesOptions:
    """How to run a job on Kubernetes.

    Attributes:
        job_api: A registered job API (:mod:`.job_apis`) or ``auto`` (ask the cluster).
        cluster: The API server and the namespace of a job that names none (None: in-cluster
            or kubeconfig credentials, loaded once they are needed).
        runtime: TrainJob: the runtime it refers to ('' = the one ``images/deploy`` ships).
        runtime_kind: TrainJob: ``TrainingRuntime`` (namespaced) or ``ClusterTrainingRuntime``
            ('' = the shipped runtime's kind).
        follow: How the job is followed once created.
    """

    job_api: str = DEFAULT_JOB_API
    cluster: Cluster | None = None
    runtime: str = ""
    runtime_kind: str = ""
    follow: FollowOptions = field(default_factory=FollowOptions)


Options = LocalOptions | KubernetesOptions


def options(backend: str, *, deadline_s: float | None = None, **fields: Any) -> Options:
    """The options of ``backend`` (``local`` or ``kubernetes``) with a deadline and its fields.

    Raises:
        UserError: An unknown backend.
        TypeError: A field the backend does not have (a caller's mistake, not the user's).
    """
    if backend == LOCAL:
        return LocalOptions(deadline_s=deadline_s, **fields)
    if backend == KUBERNETES:
        return KubernetesOptions(follow=FollowOptions(deadline_s=deadline_s), **fields)
    raise UserError("backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")


def backend_of(opts: Options) -> str:
    """The backend ``opts`` are for (what a job is resolved for)."""
    return LOCAL if isinstance(opts, LocalOptions) else KUBERNETES
