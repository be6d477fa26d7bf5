"""``JobSpec`` -> ``KubeflowOrgV1PyTorchJob`` (kubeflow.org/v1), validated before anyone sees it.

Shape of the job (why each setting is there is also in docs/eks.md):

* Workers only, ``elasticPolicy`` with the c10d rendezvous: the operator injects ``PET_NNODES``
  (``min:max``), ``PET_RDZV_ENDPOINT`` (``<job>-worker-0:23456``), ``PET_NPROC_PER_NODE`` and
  ``PET_MAX_RESTARTS``; ``ft_launcher`` reads them, so the container command is exactly the one
  ``launch-local`` runs, plus ``--local-addr=$(POD_IP)``.
* ``restartPolicy: ExitCode``: in-job restarts belong to ft_launcher. When it gives up (restarts
  exhausted, bad config) it exits 1..127 and the job fails at once instead of Kubernetes looping
  the same failure; when the container is killed by a signal (exit >= 128: OOM kill, SIGKILL) the
  operator recreates the pod and its agent re-joins the rendezvous.
* ``runPolicy``: ``cleanPodPolicy: Running`` stops pods still running when the job ends (a hung
  rank must not hold 8 GPUs) but keeps finished pods so their logs stay readable;
  ``ttlSecondsAfterFinished`` removes the job a day later; ``activeDeadlineSeconds`` is the
  cluster-side backstop if the launcher that watches the job dies; ``backoffLimit`` bounds container
  restarts (the operator counts it only for container restarts, which ExitCode pods do not have).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from kubeflow.training import models
from kubeflow.training.constants import constants
from kubernetes import client as k8s

from kfp_nvrx.components.core.config import Config, load_config
from kfp_nvrx.components.launch.jobspec.cluster_fields import check_cluster_fields
from kfp_nvrx.components.launch.jobspec.pod import (
    annotations,
    check_pod_paths,
    labels,
    pod_spec,
    to_dict,
    trainer_command,
)
from kfp_nvrx.components.launch.jobspec.spec import JobSpec, check_seconds

CONTAINER_NAME = "pytorch"  # the operator (and its webhook) require this name
REPLICA_TYPE = "Worker"
RESTART_POLICY = "ExitCode"
CLEAN_POD_POLICY = "Running"
RDZV_PORT = 23456  # the operator's default port; PET_RDZV_ENDPOINT points at worker-0 on it


@dataclass
class RenderedJob:
    """A built PyTorchJob and the values it was built from."""

    job: models.KubeflowOrgV1PyTorchJob
    name: str
    run_dir: str
    config: Config
    min_nodes: int
    max_nodes: int
    procs_per_node: int

    def to_dict(self) -> dict[str, Any]:
        """Return the manifest as plain JSON-able data (camelCase field names)."""
        return to_dict(self.job)

    def to_yaml(self) -> str:
        """Return the manifest as YAML (``kubectl apply -f`` ready)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


def build_pytorchjob(spec: JobSpec) -> RenderedJob:
    """Build (do not validate) the PyTorchJob for ``spec``.

    Raises:
        UserError: On any bad value, naming the flag.

    """
    check_cluster_fields(spec)
    lo, hi = spec.node_range()
    procs = spec.procs_per_node()
    name = spec.job_name()
    run_dir = spec.run_dir_path(name)
    cfg = load_config(spec.config, list(spec.overrides))  # validates --config / --set
    check_pod_paths(spec, cfg)
    pod_labels = labels(spec)
    check_seconds("--active-deadline", spec.active_deadline_s, 1)
    check_seconds("--ttl-after-finished", spec.ttl_after_finished_s, 0)
    check_seconds("--backoff-limit", spec.backoff_limit, 0)
    template = k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(
            labels=pod_labels,
            # Kubeflow profile namespaces often inject Istio sidecars: they intercept the c10d
            # rendezvous/NCCL bootstrap ports and keep finished pods from completing.
            annotations={"sidecar.istio.io/inject": "false"},
        ),
        spec=pod_spec(spec, cfg, run_dir, procs, container_name=CONTAINER_NAME,
                      command=trainer_command(spec, cfg, run_dir, procs),
                      ports=[k8s.V1ContainerPort(name="pytorchjob-port",
                                                 container_port=RDZV_PORT)]),
    )
    job = models.KubeflowOrgV1PyTorchJob(
        api_version=constants.API_VERSION,
        kind=constants.PYTORCHJOB_KIND,
        metadata=k8s.V1ObjectMeta(
            name=name,
            namespace=spec.namespace or None,
            labels=pod_labels,
            annotations=annotations(spec, run_dir),
        ),
        spec=models.KubeflowOrgV1PyTorchJobSpec(
            elastic_policy=models.KubeflowOrgV1ElasticPolicy(
                rdzv_backend="c10d",
                min_replicas=lo,
                max_replicas=hi,
                max_restarts=cfg.resilience.max_restarts,
            ),
            nproc_per_node=str(procs),
            pytorch_replica_specs={
                REPLICA_TYPE: models.KubeflowOrgV1ReplicaSpec(
                    replicas=hi,
                    restart_policy=RESTART_POLICY,
                    template=template,
                )
            },
            run_policy=models.KubeflowOrgV1RunPolicy(
                clean_pod_policy=CLEAN_POD_POLICY,
                backoff_limit=spec.backoff_limit,
                active_deadline_seconds=spec.active_deadline_s,
                ttl_seconds_after_finished=spec.ttl_after_finished_s,
            ),
        ),
    )
    return RenderedJob(job=job, name=name, run_dir=run_dir, config=cfg, min_nodes=lo,
                       max_nodes=hi, procs_per_node=procs)


def render(spec: JobSpec) -> RenderedJob:
    """Build the PyTorchJob and validate it (CRD schema, webhook rules, pod) before returning.

    Raises:
        UserError: Bad input, naming the flag or the manifest field.

    """
    from kfp_nvrx.components.launch.jobspec.validate import validate_job

    rendered = build_pytorchjob(spec)
    validate_job(rendered.to_dict())
    return rendered
