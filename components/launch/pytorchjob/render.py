"""``ResolvedJob`` -> ``KubeflowOrgV1PyTorchJob`` (kubeflow.org/v1), validated before anyone sees it.

Shape of the job (why each setting is there is also in docs/eks.md):

* Workers only, ``elasticPolicy`` with the c10d rendezvous: the operator injects ``PET_NNODES``
  (``min:max``), ``PET_RDZV_ENDPOINT`` (``<job>-worker-0:23456``), ``PET_NPROC_PER_NODE`` and
  ``PET_MAX_RESTARTS``; ``ft_launcher`` reads them, so the container command is exactly the one
  ``launch-local`` runs, plus ``--local-addr=$(POD_IP)``.
* ``restartPolicy: ExitCode``: in-job restarts belong to ft_launcher. When it gives up (restarts
  exhausted, bad config) it exits 1..127 and the job fails at once instead of Kubernetes looping
  the same failure; when the container is killed by a signal (exit >= 128: OOM kill, SIGKILL),
  stopped (143) or lost a peer or worker-0, the rendezvous host (200, ``pod_entry``), the
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

from kfp_nvrx.components.core.launch_command import agent_max_restarts
from kfp_nvrx.components.core.pod_entry import PEER_WAIT_ENV
from kfp_nvrx.components.launch.job_api import Rendered
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec.pod import (
    job_annotations,
    labels,
    pod_spec,
    to_dict,
    trainer_command,
)
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
from kfp_nvrx.components.launch.pytorchjob.validate import validate_job

CONTAINER_NAME = "pytorch"  # the operator (and its webhook) require this name
REPLICA_TYPE = "Worker"
RESTART_POLICY = "ExitCode"
CLEAN_POD_POLICY = "Running"
RDZV_PORT = 23456  # the operator's default port; PET_RDZV_ENDPOINT points at worker-0 on it


@dataclass
class RenderedJob(Rendered):
    """A built PyTorchJob and the resolved job it was built from."""

    job: models.KubeflowOrgV1PyTorchJob

    def to_dict(self) -> dict[str, Any]:
        """Return the manifest as plain JSON-able data (camelCase field names)."""
        return to_dict(self.job)

    def to_yaml(self, with_runtime: bool = False) -> str:
        """Return the manifest as YAML (``kubectl apply -f`` ready; it refers to no runtime)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


def refuse(job: ResolvedJob) -> None:
    """Raise UserError for what a PyTorchJob cannot carry: a name its Services cannot take."""
    naming.check_name(job.name, job.max_nodes)


def build_pytorchjob(job: ResolvedJob) -> RenderedJob:
    """Build (do not validate) the PyTorchJob for a resolved job.

    Raises:
        UserError: On a name the operator's Services cannot take.

    """
    refuse(job)
    worker = job.worker()
    pod_labels = labels(job)
    pod = pod_spec(job, container_name=CONTAINER_NAME, command=trainer_command(job),
                   ports=[k8s.V1ContainerPort(name="pytorchjob-port", container_port=RDZV_PORT)])
    if all(e.name != PEER_WAIT_ENV for e in pod.containers[0].env):  # --env may set it
        # FT: a pod whose ft_launcher lost a peer or worker-0 (the rendezvous host) exits 200 at
        # once: ExitCode recreates it, and a peer's give-up (1) fails the job whenever it comes.
        # (A TrainJob's pod waits instead: pod_entry's docstring.)
        pod.containers[0].env.append(k8s.V1EnvVar(name=PEER_WAIT_ENV, value="0"))
    template = k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(
            labels=pod_labels,
            # Kubeflow profile namespaces often inject Istio sidecars: they intercept the c10d
            # rendezvous/NCCL bootstrap ports and keep finished pods from completing.
            annotations={"sidecar.istio.io/inject": "false"},
        ),
        spec=pod,
    )
    manifest = models.KubeflowOrgV1PyTorchJob(
        api_version=constants.API_VERSION,
        kind=constants.PYTORCHJOB_KIND,
        metadata=k8s.V1ObjectMeta(
            name=job.name,
            namespace=job.namespace or None,
            # Kueue reads its labels on the PyTorchJob only (jobspec.queue), not on the pods.
            labels={**pod_labels, **(job.queue.labels() if job.queue else {})},
            annotations=job_annotations(job),
        ),
        spec=models.KubeflowOrgV1PyTorchJobSpec(
            elastic_policy=models.KubeflowOrgV1ElasticPolicy(
                rdzv_backend="c10d",
                min_replicas=job.min_nodes,
                max_replicas=job.max_nodes,
                # the operator passes it on as PET_MAX_RESTARTS: ft_launcher's backstop
                max_restarts=agent_max_restarts(job.config.resilience.max_restarts),
            ),
            nproc_per_node=str(job.procs_per_node),
            pytorch_replica_specs={
                REPLICA_TYPE: models.KubeflowOrgV1ReplicaSpec(
                    replicas=job.max_nodes,
                    restart_policy=RESTART_POLICY,
                    template=template,
                )
            },
            run_policy=models.KubeflowOrgV1RunPolicy(
                clean_pod_policy=CLEAN_POD_POLICY,
                backoff_limit=worker.backoff_limit,
                active_deadline_seconds=worker.active_deadline_s,
                ttl_seconds_after_finished=worker.ttl_after_finished_s,
            ),
        ),
    )
    return RenderedJob(job=manifest, resolved=job)


def render(job: ResolvedJob) -> RenderedJob:
    """Build the PyTorchJob and validate it (CRD schema, webhook rules, pod) before returning.

    Raises:
        UserError: Bad input, naming the field or the manifest field.

    """
    rendered = build_pytorchjob(job)
    validate_job(rendered.to_dict())
    return rendered
