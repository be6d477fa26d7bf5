"""The job APIs a training job runs on, one object each, and the one list of their names.

* ``local``: N ``ft_launcher`` agents on this machine (:mod:`.local`), the trainer part of a job;
* ``pytorchjob``: a Training Operator v1 PyTorchJob (:mod:`.jobspec.pytorchjob`, :mod:`.kubernetes`);
* ``trainjob``: a Kubeflow Trainer v2 TrainJob (:mod:`.jobspec.trainjob`, :mod:`.trainjob`).

Each :class:`JobApi` carries its name, what it cannot express (``refuse``), its renderer, its
launch adapter and the resource the API server's discovery lists for it. ``auto`` (the default of
every surface: CLI, KFP component, pipelines) asks the cluster which Kubernetes API it serves, the
TrainJob when both: Kubeflow 1.11 and later install Trainer v2, older EKS set-ups the Training
Operator. The renderers and the Kubernetes client are imported only when a job is rendered, so the
CLI and the pipelines can read the names without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec import runtime as rt

LOCAL = "local"
AUTO = "auto"
#: The Kubernetes job APIs, in the order ``auto`` prefers them when the cluster serves both.
KUBERNETES_APIS = ("trainjob", "pytorchjob")
#: What ``--job-api`` / ``job_api`` accept, and their default.
JOB_API_CHOICES = ("pytorchjob", "trainjob", AUTO)
DEFAULT_JOB_API = AUTO
#: ``render-job`` prints a manifest without asking any cluster, so ``auto`` has no answer there;
#: it keeps the API it always rendered.
RENDER_JOB_API = "pytorchjob"


@dataclass(frozen=True)
class JobApi:
    """One job API: how a resolved job is checked, rendered and launched on it.

    Attributes:
        name: ``local``, ``pytorchjob`` or ``trainjob``.
        kind: The Kubernetes kind ('' for ``local``).
        resource: ``(group, version, plural)`` the API server's discovery lists (None: local).
        refuse: Raises UserError for what this API cannot express (``(job, options)``).
        render: ``(job, options) -> rendered manifest``, validated (None: local).
        launch: ``(rendered or local job, options, log, api client or None) -> LaunchResult``.
    """

    name: str
    kind: str
    resource: tuple[str, str, str] | None
    refuse: Callable[[Any, Any], None]
    render: Callable[[Any, Any], Any] | None
    launch: Callable[..., Any]


def _refuse_pytorchjob(job: Any, opts: Any) -> None:
    from kfp_nvrx.components.launch.jobspec import pytorchjob

    pytorchjob.refuse(job)


def _refuse_trainjob(job: Any, opts: Any) -> None:
    from kfp_nvrx.components.launch.jobspec import trainjob

    trainjob.refuse(job, opts.runtime, opts.runtime_kind)


def _render_pytorchjob(job: Any, opts: Any) -> Any:
    from kfp_nvrx.components.launch.jobspec import pytorchjob

    return pytorchjob.render(job)


def _render_trainjob(job: Any, opts: Any) -> Any:
    from kfp_nvrx.components.launch.jobspec import trainjob

    return trainjob.render(job, opts.runtime, opts.runtime_kind)


def _launch_local(job: Any, opts: Any, log: Callable[[str], None], api_client: Any) -> Any:
    from kfp_nvrx.components.launch.local import run_local

    return run_local(job, log=log, deadline_s=opts.deadline_s)


def _launch_pytorchjob(rendered: Any, opts: Any, log: Callable[[str], None],
                       api_client: Any) -> Any:
    from kfp_nvrx.components.launch.kubernetes import launch_kubernetes

    return launch_kubernetes(rendered, opts.follow(), log=log,
                             client_configuration=opts.client_configuration)


def _launch_trainjob(rendered: Any, opts: Any, log: Callable[[str], None],
                     api_client: Any) -> Any:
    from kfp_nvrx.components.launch import k8s_api
    from kfp_nvrx.components.launch.trainjob import launch_trainjob

    # Credentials after rendering: bad input is reported before they are looked at.
    return launch_trainjob(rendered, opts.follow(), log=log, api_client=api_client
                           or k8s_api.api_client(opts.client_configuration))


def _nothing_to_refuse(job: Any, opts: Any) -> None:
    """The local launcher runs whatever resolved (its checks are the trainer's own)."""


JOB_APIS: dict[str, JobApi] = {api.name: api for api in (
    JobApi(LOCAL, "", None, _nothing_to_refuse, None, _launch_local),
    JobApi("pytorchjob", "PyTorchJob", ("kubeflow.org", "v1", "pytorchjobs"), _refuse_pytorchjob,
           _render_pytorchjob, _launch_pytorchjob),
    JobApi("trainjob", "TrainJob", (rt.GROUP, rt.API_VERSION.split("/")[1], "trainjobs"),
           _refuse_trainjob, _render_trainjob, _launch_trainjob),
)}


def get(name: str, field: str = "job_api") -> JobApi:
    """Return the Kubernetes job API ``name`` (not ``auto``: see :func:`resolve_job_api`)."""
    if name not in KUBERNETES_APIS:
        raise UserError(field, f"must be {', '.join(JOB_API_CHOICES[:-1])} or "
                        f"{JOB_API_CHOICES[-1]}, got {name!r}")
    return JOB_APIS[name]


def served_job_apis(api: Any) -> set[str]:
    """Return which Kubernetes job APIs the cluster serves (API discovery, one call each)."""
    from kubernetes.client.rest import ApiException

    from kfp_nvrx.components.launch import k8s_api

    served, host = set(), k8s_api.host_of(api)
    for name in KUBERNETES_APIS:
        group, version, plural = JOB_APIS[name].resource
        action = f"asking the API server for {group}/{version}"
        try:
            resp = k8s_api.call(action, host, api.call_api, f"/apis/{group}/{version}", "GET",
                                response_type="object", auth_settings=["BearerToken"],
                                _return_http_data_only=True, ok=(404,))
        except ApiException:
            continue  # the group/version is not served
        resources = k8s_api.expect_object(resp, action, host).get("resources") or []
        if any(isinstance(r, dict) and r.get("name") == plural for r in resources):
            served.add(name)
    return served


def resolve_job_api(job_api: str, api: Any) -> str:
    """Return ``job_api``, or for ``auto`` the API the cluster serves (TrainJob when both).

    Raises:
        UserError: ``job_api`` is not one of :data:`JOB_API_CHOICES`.
        ClusterError: ``auto`` and the cluster serves neither API.
    """
    if job_api != AUTO:
        return get(job_api).name
    from kfp_nvrx.components.launch.k8s_api import ClusterError

    served = served_job_apis(api) if api is not None else set()
    for name in KUBERNETES_APIS:
        if name in served:
            return name
    raise ClusterError("--job-api auto: the cluster serves neither trainjobs.trainer.kubeflow.org "
                       "(Kubeflow Trainer v2) nor pytorchjobs.kubeflow.org (Training Operator v1)")
