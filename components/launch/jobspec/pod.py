"""The worker pod of a training job, shared by the PyTorchJob and the TrainJob renderers.

One ``ResolvedJob`` means the same pod on both APIs: the same ft_launcher command
(:func:`trainer_command`), resources (GPUs, EFA, hugepages), volumes (the shared volume, a
memory-backed /dev/shm, extra PVCs), env, placement and security settings. Every value was checked
when the job was resolved (:mod:`.resolve`); this module only builds the client models.
:mod:`..pytorchjob.render` puts this pod in the worker replica spec; :mod:`..trainjob.render`
splits it into the TrainJob's ``trainer`` and ``runtimePatches``; a new job API builds on the same
pod.
"""

from __future__ import annotations

from typing import Any

from kubeflow.training.api_client import ApiClient
from kubernetes import client as k8s

from kfp_nvrx.components import __version__
from kfp_nvrx.components.core.launch_command import (
    Rendezvous,
    ft_launcher_argv,
    pod_grace_period_s,
)
from kfp_nvrx.components.core.run_claim import HOLDER_ENV, RUN_DIR_ENV, kube_holder
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec.cluster_fields import escape_expansion
from kfp_nvrx.components.launch.jobspec.profiles import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    HUGEPAGES_RESOURCE,
)
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob

SHM_VOLUME = "dshm"
DATA_VOLUME = "shared"


def to_dict(model: Any) -> dict[str, Any]:
    """Serialise a client model (pod spec, SDK job) the way the API client sends it."""
    return ApiClient().sanitize_for_serialization(model)


def _field_ref(path: str) -> k8s.V1EnvVarSource:
    return k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path=path))


def container_env(job: ResolvedJob) -> list[k8s.V1EnvVar]:
    """The trainer container's env: downward API, then defaults and user env, then Secrets.

    ``POD_IP`` comes first: it feeds ``--local-addr=$(POD_IP)``; ``POD_NAMESPACE`` names the
    job in its run-dir claim (``$(POD_NAMESPACE)``, expanded by the kubelet).
    """
    env = [
        k8s.V1EnvVar(name="POD_IP", value_from=_field_ref("status.podIP")),
        k8s.V1EnvVar(name="POD_NAME", value_from=_field_ref("metadata.name")),
        k8s.V1EnvVar(name="POD_NAMESPACE", value_from=_field_ref("metadata.namespace")),
        # FT: one writer per run dir: the pods' entrypoint claims it for this job (core.run_claim)
        k8s.V1EnvVar(name=RUN_DIR_ENV, value=escape_expansion(job.run_dir)),
        k8s.V1EnvVar(name=HOLDER_ENV, value=kube_holder("$(POD_NAMESPACE)", job.name)),
    ]
    pod = job.worker()
    env += [k8s.V1EnvVar(name=k, value=v) for k, v in pod.env]
    env += [k8s.V1EnvVar(name=ref.name, value_from=k8s.V1EnvVarSource(
        secret_key_ref=k8s.V1SecretKeySelector(name=ref.secret, key=ref.key)))
        for ref in pod.secret_env]
    return env


def resources(job: ResolvedJob) -> k8s.V1ResourceRequirements:
    """Requests and limits of the worker container: cpu/memory, GPUs, EFA, hugepages."""
    pod = job.worker()
    requests: dict[str, str] = {"cpu": pod.cpu, "memory": pod.memory}
    limits: dict[str, str] = {}
    for name, amount in ((GPU_RESOURCE, pod.gpus), (EFA_RESOURCE, pod.efa),
                         (HUGEPAGES_RESOURCE, pod.hugepages)):
        if amount:  # extended resources and hugepages must have limit == request
            requests[name] = limits[name] = str(amount)
    # No cpu/memory limit: the pod owns its node; a memory limit would also count /dev/shm
    # (memory-backed) against the container and OOM-kill it under DataLoader load.
    return k8s.V1ResourceRequirements(requests=requests, limits=limits or None)


def volumes(job: ResolvedJob) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
    """The shared volume, a memory-backed /dev/shm and the extra PVCs, with their mounts."""
    pod = job.worker()
    vols = [
        k8s.V1Volume(
            name=DATA_VOLUME,
            persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=pod.pvc),
        ),
        # NCCL and DataLoader workers use /dev/shm; the container runtime default is 64 MiB.
        k8s.V1Volume(name=SHM_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource(
            medium="Memory", size_limit=pod.shm_size)),
    ]
    mounts = [
        k8s.V1VolumeMount(name=DATA_VOLUME, mount_path=pod.mount),
        k8s.V1VolumeMount(name=SHM_VOLUME, mount_path="/dev/shm"),
    ]
    for i, extra in enumerate(pod.volumes):
        name, read_only = f"extra-{i}", extra.read_only or None
        vols.append(k8s.V1Volume(name=name, persistent_volume_claim=(
            k8s.V1PersistentVolumeClaimVolumeSource(claim_name=extra.claim, read_only=read_only))))
        mounts.append(k8s.V1VolumeMount(name=name, mount_path=extra.path, read_only=read_only))
    return vols, mounts


def labels(job: ResolvedJob) -> dict[str, str]:
    """Labels of the job and its pods (selectable values: run id and task are shortened)."""
    out = {
        "app.kubernetes.io/name": "kfp-nvrx",
        naming.MANAGED_BY: "kfp-nvrx",
        naming.VERSION_KEY: naming.label_value(__version__),
        naming.TASK_KEY: naming.label_value(job.task),
    }
    if job.run_id:
        out[naming.RUN_ID_KEY] = naming.label_value(job.run_id)
    return out


def job_annotations(job: ResolvedJob) -> dict[str, str]:
    """Annotations of the job: the full run id, task, version, config and run dir (re-attach)."""
    config = " ".join([job.config_ref, *(f"--set {o}" for o in job.overrides)])
    return {
        naming.RUN_ID_KEY: job.run_id,
        naming.TASK_KEY: job.task,
        naming.VERSION_KEY: __version__,
        naming.CONFIG_KEY: config,
        naming.RUN_DIR_KEY: job.run_dir,
    }


#: The container's entrypoint in front of ft_launcher: ft_launcher exits 1 whether it gave up, was
#: stopped or lost a peer; the failure policies read 1 as "gave up", so a pod stopped by SIGTERM
#: (deleted, drained, its JobSet recreated) exits 143 and one whose peer or rendezvous host
#: vanished exits 200 (:mod:`kfp_nvrx.components.core.pod_entry`; the table in docs/eks.md).
POD_ENTRY = ["python", "-m", "kfp_nvrx.components.core.pod_entry"]


def trainer_command(job: ResolvedJob, *, rdzv_endpoint: str = "",
                    rdzv_id: str = "") -> list[str]:
    """The worker container's ft_launcher command, the same for a PyTorchJob and a TrainJob.

    Args:
        job: The job.
        rdzv_endpoint: c10d endpoint on the command line ('' = from ``PET_RDZV_ENDPOINT``).
        rdzv_id: Rendezvous id on the command line ('' = from ``PET_RDZV_ID``).

    """
    args = job.trainer_args()
    # The kubelet expands $(VAR) in a command (secret env values included): user text is escaped.
    args.config, args.run_dir = escape_expansion(args.config), escape_expansion(args.run_dir)
    args.overrides = [escape_expansion(o) for o in args.overrides]
    args.faults = [escape_expansion(f) for f in args.faults]
    # FT: one builder for pods and launch-local; $(POD_IP) is expanded by the kubelet from the env.
    return [*POD_ENTRY, *ft_launcher_argv(job.config.resilience, args, local_addr="$(POD_IP)",
                                          nic_monitor=job.worker().profile.nic_monitor,
                                          rdzv=Rendezvous(rdzv_endpoint, rdzv_id))]


def pod_spec(job: ResolvedJob, *, container_name: str, command: list[str],
             ports: list[k8s.V1ContainerPort] | None = None) -> k8s.V1PodSpec:
    """The worker pod: one container running ``command``, its volumes, placement and security."""
    pod = job.worker()
    vols, mounts = volumes(job)
    security = None
    if pod.efa:  # libfabric pins (mlocks) buffers for RDMA.
        security = k8s.V1SecurityContext(capabilities=k8s.V1Capabilities(add=["IPC_LOCK"]))
    container = k8s.V1Container(
        name=container_name,
        image=pod.image,
        image_pull_policy=pod.pull_policy,
        command=command,
        env=container_env(job),
        ports=ports,
        resources=resources(job),
        volume_mounts=mounts,
        security_context=security,
    )
    pod_security = None
    if pod.fs_group is not None:
        # OnRootMismatch: a recursive chown of a large FSx volume hangs pod start-up.
        pod_security = k8s.V1PodSecurityContext(fs_group=pod.fs_group,
                                                fs_group_change_policy="OnRootMismatch")
    return k8s.V1PodSpec(
        containers=[container],
        volumes=vols,
        node_selector=dict(pod.node_selector) or None,
        tolerations=[dict(t) for t in pod.tolerations] or None,
        affinity=pod.affinity,
        priority_class_name=pod.pod_priority_class or None,
        scheduler_name=pod.scheduler_name or None,
        service_account_name=pod.service_account or None,
        security_context=pod_security,
        # ft_launcher's --term-timeout plus its own shutdown: one decision, in launch_command.py.
        termination_grace_period_seconds=pod_grace_period_s(job.config.resilience),
    )
