"""One entry point for every launcher backend: ``launch(job, options) -> LaunchResult``.

* ``local`` (:class:`.options.LocalOptions`, the embedded default): the job's trainer part as N
  ft_launcher agents on this machine, with the same ``PET_*`` environment and the same
  ft_launcher command line a pod gets (image, PVC and resources are not used): :mod:`.local`.
* ``kubernetes`` (:class:`.options.KubernetesOptions`): a job of the job API ``job_api`` names
  (:mod:`.job_apis`); ``auto`` asks the cluster first and renders once for the API it serves:
  :mod:`.cluster_launch`.

A surface (CLI, KFP component) resolves its ``JobSpec`` once with :func:`check`, before
credentials are looked at, so bad input is one line naming its field even where no cluster
answers; :func:`launch` takes only the ``ResolvedJob`` that made.
"""

from __future__ import annotations

from collections.abc import Callable

from kfp_nvrx.components.launch import job_apis
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob, resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.options import (
    AUTO,
    KubernetesOptions,
    LocalOptions,
    Options,
    backend_of,
)
from kfp_nvrx.components.launch.result import LaunchResult


def check(spec: JobSpec, opts: Options) -> ResolvedJob:
    """Resolve ``spec`` for ``opts`` and refuse what its job API cannot express.

    With ``auto`` the refusal comes later, once the cluster said which API it serves.

    Raises:
        UserError: Bad input, naming its field; nothing was sent anywhere.
    """
    job = resolve(spec, backend_of(opts))
    if isinstance(opts, KubernetesOptions) and opts.job_api != AUTO:
        job_apis.get(opts.job_api).refuse(job, opts)
    return job


def launch(job: ResolvedJob, opts: Options, *,
           log: Callable[[str], None] = print) -> LaunchResult:
    """Run one resolved training job on a backend and wait for its end.

    Args:
        job: The job :func:`check` resolved for these options.
        opts: The backend's options.
        log: Sink for log and progress lines.

    Returns:
        The same :class:`LaunchResult` from either backend.

    Raises:
        UserError: Bad input (unknown job API, what the job API cannot express).
        ClusterError: The cluster refused or could not answer.
    """
    if isinstance(opts, LocalOptions):
        from kfp_nvrx.components.launch.local.run import LocalRun

        return LocalRun(job, log=log, deadline_s=opts.deadline_s).run()
    from kfp_nvrx.components.launch.cluster_launch import launch_on_cluster

    return launch_on_cluster(job, opts, log)
