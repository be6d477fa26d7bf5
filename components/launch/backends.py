"""One entry point for every launcher backend: ``launch(spec, backend=...) -> LaunchResult``.

* ``local`` (the embedded default): runs the job's trainer part through ``launch-local`` on this
  machine: N ft_launcher agents on localhost with the same ``PET_*`` environment and the same
  ft_launcher command line a PyTorchJob pod gets (:func:`.local.run_local` reads the same
  JobSpec; image, PVC and resources are not used).
* ``kubernetes``: renders, validates and creates the PyTorchJob (:mod:`.kubernetes`) or the
  Kubeflow Trainer v2 TrainJob (:mod:`.trainjob`), then follows it; ``job_api="auto"`` asks the
  cluster which of the two it serves and takes the TrainJob when it serves both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.result import LaunchResult

BACKENDS = ("local", "kubernetes")


def _api_client(configuration: Any) -> Any:
    """A Kubernetes ApiClient: ``configuration``, else in-cluster or kubeconfig credentials."""
    from kubernetes import client, config

    from kfp_nvrx.components.launch.k8s_job import ClusterError
    from kfp_nvrx.components.redaction import register_kube_configuration, register_kubeconfig

    if configuration is None:
        configuration = client.Configuration()
        register_kubeconfig(None)  # before loading: a loader error must not quote a token
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            try:
                config.load_kube_config(client_configuration=configuration)
            except Exception as err:  # noqa: BLE001 - no kubeconfig: one line
                raise ClusterError(f"no Kubernetes credentials: {' '.join(str(err).split())}") \
                    from None
    register_kube_configuration(configuration)  # every later line we print is redacted
    return client.ApiClient(configuration)


def _check_for_some_api(spec: JobSpec, runtime: str, runtime_kind: str) -> None:
    """Raise the PyTorchJob's UserError when neither job API could run ``spec``."""
    from kfp_nvrx.components.launch.jobspec import pytorchjob, trainjob

    try:
        pytorchjob.render(spec)
    except UserError as err:
        try:
            trainjob.render(spec, runtime, runtime_kind)
        except UserError:
            raise err from None


def launch(spec: JobSpec, backend: str = "local", *, log: Callable[[str], None] = print,
           deadline_s: float | None = None, namespace: str = "",
           delete_after: str = "on_success", poll_s: float = 5.0,
           client_configuration: Any = None, job_api: str = "pytorchjob",
           runtime: str = "kfp-nvrx-ft", runtime_kind: str = "TrainingRuntime") -> LaunchResult:
    """Run one training job on a backend and wait for its end.

    Args:
        spec: The job.
        backend: ``local`` or ``kubernetes``.
        log: Sink for log and progress lines.
        deadline_s: Give up after this many seconds (kubernetes: counted from the job's creation).
        namespace: Kubernetes namespace ('' = the client's default).
        delete_after: Kubernetes: ``always`` | ``on_success`` | ``never``.
        poll_s: Kubernetes: seconds between job status reads.
        client_configuration: Kubernetes client configuration (None: kubeconfig / in-cluster).
        job_api: Kubernetes: ``pytorchjob``, ``trainjob`` or ``auto``.
        runtime: Kubernetes, TrainJob: the runtime it refers to.
        runtime_kind: Kubernetes, TrainJob: ``TrainingRuntime`` (namespaced, the one we ship) or
            ``ClusterTrainingRuntime``.

    Returns:
        The same :class:`LaunchResult` from either backend.

    Raises:
        UserError: Bad input (unknown backend, bad spec).

    """
    if backend == "kubernetes":
        from kfp_nvrx.components.launch.k8s_job import K8sOptions
        from kfp_nvrx.components.launch.kubernetes import launch_kubernetes
        from kfp_nvrx.components.redaction import register_kube_defaults

        # Credentials the client loads by itself (TrainingClient) are redacted too.
        register_kube_defaults()

        opts = K8sOptions(namespace=namespace, deadline_s=deadline_s, delete_after=delete_after,
                          poll_s=poll_s)
        if job_api == "pytorchjob":
            return launch_kubernetes(spec, opts, log=log,
                                     client_configuration=client_configuration)
        from kfp_nvrx.components.launch import trainjob

        api = None
        if job_api == "auto":
            # Bad input is reported before credentials are looked at.
            _check_for_some_api(spec, runtime, runtime_kind)
            api = _api_client(client_configuration)
            job_api = trainjob.resolve_job_api(job_api, api)
            log(f"--job-api auto: the cluster serves {job_api}")
            if job_api == "pytorchjob":
                return launch_kubernetes(spec, opts, log=log,
                                         client_configuration=client_configuration)
        elif job_api != "trainjob":
            raise UserError("--job-api", f"must be pytorchjob, trainjob or auto, got {job_api!r}")
        return trainjob.launch_trainjob(spec, opts, log=log, runtime=runtime,
                                        runtime_kind=runtime_kind,
                                        api_client=api or _api_client(client_configuration))
    if backend == "local":
        from kfp_nvrx.components.launch.local import run_local

        return run_local(spec, log=log, deadline_s=deadline_s)
    raise UserError("--backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
