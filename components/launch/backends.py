"""One entry point for every launcher backend: ``launch(spec, options) -> LaunchResult``.

* ``local`` (:class:`LocalOptions`, the embedded default): the job's trainer part as N
  ft_launcher agents on this machine, with the same ``PET_*`` environment and the same
  ft_launcher command line a pod gets (image, PVC and resources are not used).
* ``kubernetes`` (:class:`KubernetesOptions`): a PyTorchJob or a TrainJob, as ``job_api`` says
  (:mod:`.job_apis`); ``auto`` asks the cluster first and renders once for the API it serves.

The spec is resolved once (:mod:`.jobspec.resolve`) before credentials are looked at, so bad input
is one line naming its field even where no cluster answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch import job_apis
from kfp_nvrx.components.launch.jobspec import runtime as rt
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob, resolve, resolve_local
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.result import LaunchResult

BACKENDS = ("local", "kubernetes")


@dataclass(frozen=True)
class LocalOptions:
    """How to run a job on this machine.

    Attributes:
        deadline_s: Wall-clock limit in seconds (None = none).
    """

    deadline_s: float | None = None


@dataclass(frozen=True)
class KubernetesOptions:
    """How to run a job on Kubernetes.

    Attributes:
        job_api: ``pytorchjob``, ``trainjob`` or ``auto`` (:data:`.job_apis.DEFAULT_JOB_API`).
        namespace: Namespace of the job ('' = the job's, else the client's).
        deadline_s: Seconds after the job's creation before the launcher gives up.
        delete_after: ``always`` | ``on_success`` | ``never``.
        poll_s: Seconds between job status reads.
        client_configuration: Kubernetes client configuration (None: in-cluster or kubeconfig).
        runtime: TrainJob: the runtime it refers to.
        runtime_kind: TrainJob: ``TrainingRuntime`` (namespaced, the one we ship) or
            ``ClusterTrainingRuntime``.
    """

    job_api: str = job_apis.DEFAULT_JOB_API
    namespace: str = ""
    deadline_s: float | None = None
    delete_after: str = "on_success"
    poll_s: float = 5.0
    client_configuration: Any = None
    runtime: str = rt.RUNTIME_NAME
    runtime_kind: str = rt.RUNTIME_KIND

    def follow(self) -> Any:
        """The options of one followed job (:class:`.k8s_job.K8sOptions`)."""
        from kfp_nvrx.components.launch.k8s_job import K8sOptions

        return K8sOptions(namespace=self.namespace, deadline_s=self.deadline_s,
                          delete_after=self.delete_after, poll_s=self.poll_s)


Options = LocalOptions | KubernetesOptions


def options(backend: str, **fields: Any) -> Options:
    """The options of ``backend`` (``local`` or ``kubernetes``) from their fields.

    Raises:
        UserError: An unknown backend.
        TypeError: A field the backend does not have (a caller's mistake, not the user's).
    """
    if backend == "local":
        return LocalOptions(**fields)
    if backend == "kubernetes":
        return KubernetesOptions(**fields)
    raise UserError("backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")


def check(spec: JobSpec, opts: Options) -> ResolvedJob:
    """Resolve ``spec`` for ``opts`` and refuse what its job API cannot express (``auto``: later).

    Raises:
        UserError: Bad input, naming its field; nothing was sent anywhere.
    """
    if isinstance(opts, LocalOptions):
        return resolve_local(spec)
    job = resolve(spec)
    if opts.job_api != job_apis.AUTO:
        job_apis.get(opts.job_api).refuse(job, opts)
    return job


def launch(spec: JobSpec | ResolvedJob, backend: str | Options = "local", *,
           log: Callable[[str], None] = print, **fields: Any) -> LaunchResult:
    """Run one training job on a backend and wait for its end.

    Args:
        spec: The job, or the job :func:`check` resolved for these options.
        backend: Typed options, or ``local`` / ``kubernetes`` with their ``fields``.
        log: Sink for log and progress lines.
        **fields: Fields of that backend's options when ``backend`` is a name.

    Returns:
        The same :class:`LaunchResult` from either backend.

    Raises:
        UserError: Bad input (unknown backend or job API, bad spec).
        ClusterError: The cluster refused or could not answer.

    """
    opts = options(backend, **fields) if isinstance(backend, str) else backend
    job = check(spec, opts) if isinstance(spec, JobSpec) else spec
    if isinstance(opts, LocalOptions):
        return job_apis.JOB_APIS[job_apis.LOCAL].launch(job, opts, log, None)
    from kfp_nvrx.components.launch import k8s_api
    from kfp_nvrx.components.launch.k8s_config import check_kubeconfig
    from kfp_nvrx.components.redaction import register_kube_defaults

    if opts.client_configuration is None:  # a FIFO or /dev/zero: refused before it is opened
        check_kubeconfig(None)
    # Credentials the client loads by itself (TrainingClient) are redacted too.
    register_kube_defaults()
    client = None
    name = opts.job_api
    if name == job_apis.AUTO:
        client = k8s_api.api_client(opts.client_configuration)
        name = job_apis.resolve_job_api(name, client)
        log(f"--job-api auto: the cluster serves {name}")
    api = job_apis.get(name)
    return api.launch(api.render(job, opts), opts, log, client)  # rendered once, for that API
