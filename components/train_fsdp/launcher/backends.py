"""One entry point for every launcher backend: ``launch(spec, backend=...) -> LaunchResult``.

* ``local`` (the embedded default): runs the job's trainer part through ``launch-local`` on this
  machine: N ft_launcher agents on localhost with the same ``PET_*`` environment and the same
  ft_launcher command line a PyTorchJob pod gets (:func:`.local.run_local` reads the same
  JobSpec; image, PVC and resources are not used).
* ``kubernetes``: renders, validates and creates the PyTorchJob, then follows it
  (:mod:`.kubernetes`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.train_fsdp.jobspec.spec import JobSpec
from kfp_nvrx.components.train_fsdp.launcher.result import LaunchResult

BACKENDS = ("local", "kubernetes")


def launch(spec: JobSpec, backend: str = "local", *, log: Callable[[str], None] = print,
           deadline_s: float | None = None, namespace: str = "",
           delete_after: str = "on_success", poll_s: float = 5.0,
           client_configuration: Any = None) -> LaunchResult:
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

    Returns:
        The same :class:`LaunchResult` from either backend.

    Raises:
        UserError: Bad input (unknown backend, bad spec).

    """
    if backend == "kubernetes":
        from kfp_nvrx.components.train_fsdp.launcher.kubernetes import K8sOptions, launch_kubernetes

        opts = K8sOptions(namespace=namespace, deadline_s=deadline_s, delete_after=delete_after,
                          poll_s=poll_s)
        return launch_kubernetes(spec, opts, log=log, client_configuration=client_configuration)
    if backend == "local":
        from kfp_nvrx.components.train_fsdp.launcher.local import run_local

        return run_local(spec, log=log, deadline_s=deadline_s)
    raise UserError("--backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
