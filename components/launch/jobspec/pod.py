"""The worker pod of a training job, shared by the PyTorchJob and the TrainJob renderers.

One JobSpec means the same pod on both APIs: the same ft_launcher command (:func:`trainer_command`),
resources (GPUs, EFA, hugepages), volumes (the shared volume, a memory-backed /dev/shm, extra
PVCs), env, placement and security settings. :mod:`.pytorchjob` puts this pod in the worker replica
spec; :mod:`.trainjob` splits it into the TrainJob's ``trainer`` and ``runtimePatches``.
"""

from __future__ import annotations

from typing import Any

from kubeflow.training.api_client import ApiClient
from kubernetes import client as k8s

from kfp_nvrx.components import __version__
from kfp_nvrx.components.core.config import PRESETS_DIR, Config
from kfp_nvrx.components.core.launch_command import (
    TrainerArgs,
    ft_launcher_argv,
    pod_grace_period_s,
)
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec.cluster_fields import escape_expansion
from kfp_nvrx.components.launch.jobspec.env import container_env
from kfp_nvrx.components.launch.jobspec.profiles import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    HUGEPAGES_RESOURCE,
    INSTANCE_TYPE_LABEL,
)
from kfp_nvrx.components.launch.jobspec.spec import (
    JobSpec,
    check_abs_path,
    check_image,
    check_quantity,
    check_resource_name,
    parse_extra_pvc,
    quantity,
)

SHM_VOLUME = "dshm"
DATA_VOLUME = "shared"


def is_preset(config: str) -> bool:
    """Tell whether ``config`` names a bundled preset (present in the image too)."""
    return "/" not in config and (PRESETS_DIR / f"{config}.yaml").is_file()


def to_dict(model: Any) -> dict[str, Any]:
    """Serialise a client model (pod spec, SDK job) the way the API client sends it."""
    return ApiClient().sanitize_for_serialization(model)


def resources(spec: JobSpec, procs: int) -> k8s.V1ResourceRequirements:
    """Requests and limits of the worker container: cpu/memory, GPUs, EFA, hugepages."""
    prof = spec.profile
    requests: dict[str, str] = {
        "cpu": check_quantity("--cpu", spec.cpu or prof.cpu),
        "memory": check_quantity("--memory", spec.memory or prof.memory),
    }
    limits: dict[str, str] = {}
    if prof.is_gpu:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(procs)
    efa = prof.efa if spec.efa is None else spec.efa
    if isinstance(efa, bool) or not isinstance(efa, int) or efa < 0:
        raise UserError("--efa", f"must be an integer >= 0, got {efa!r}")
    if efa and not prof.is_gpu:
        raise UserError("--efa", f"EFA interfaces need a GPU instance type, not {prof.name!r}")
    if efa:
        requests[EFA_RESOURCE] = limits[EFA_RESOURCE] = str(efa)
    hugepages = spec.hugepages or prof.hugepages
    # "0", "0Mi" and "0Gi" all mean no hugepages (an amount, not a text).
    if hugepages and quantity(check_quantity("--hugepages", hugepages)) != 0:
        # Hugepages must have limit == request (and a cpu/memory request, set above).
        requests[HUGEPAGES_RESOURCE] = limits[HUGEPAGES_RESOURCE] = hugepages
    # No cpu/memory limit: the pod owns its node; a memory limit would also count /dev/shm
    # (memory-backed) against the container and OOM-kill it under DataLoader load.
    return k8s.V1ResourceRequirements(requests=requests, limits=limits or None)


def volumes(spec: JobSpec) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
    """The shared volume, a memory-backed /dev/shm and the extra PVCs, with their mounts."""
    prof = spec.profile
    pvc = check_resource_name("--pvc", spec.pvc) if spec.pvc else ""
    if not pvc:
        raise UserError("--pvc", "the shared volume's PersistentVolumeClaim is required "
                        "(FSx for Lustre: data, run dir and checkpoints live there)")
    shm = check_quantity("--shm-size", spec.shm_size or prof.shm_size)
    mount = check_abs_path("--mount", spec.mount)
    volumes = [
        k8s.V1Volume(
            name=DATA_VOLUME,
            persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=pvc),
        ),
        # NCCL and DataLoader workers use /dev/shm; the container runtime default is 64 MiB.
        k8s.V1Volume(name=SHM_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource(
            medium="Memory", size_limit=shm)),
    ]
    mounts = [
        k8s.V1VolumeMount(name=DATA_VOLUME, mount_path=mount),
        k8s.V1VolumeMount(name=SHM_VOLUME, mount_path="/dev/shm"),
    ]
    taken = {mount, "/dev/shm"}
    for i, item in enumerate(spec.extra_pvcs):
        claim, path, read_only = parse_extra_pvc(item)
        if path in taken:
            raise UserError("--extra-pvc", f"mount path {path} is already used")
        taken.add(path)
        vol = f"extra-{i}"
        volumes.append(k8s.V1Volume(
            name=vol,
            persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                claim_name=claim, read_only=read_only or None),
        ))
        mounts.append(k8s.V1VolumeMount(name=vol, mount_path=path, read_only=read_only or None))
    return volumes, mounts


def check_pod_paths(spec: JobSpec, cfg: Config) -> None:
    """What the trainer reads and uses must exist inside the pods.

    Paths on the shared volume or an extra PVC; a GPU when ``train.device`` is cuda.
    """
    if cfg.train.device == "cuda" and not spec.profile.is_gpu:
        raise UserError("train.device", f"is cuda but instance type {spec.profile.name} has no "
                        "GPU; use --set train.device=cpu (or auto) or a GPU --instance-type")
    roots = [check_abs_path("--mount", spec.mount)]
    roots += [parse_extra_pvc(item)[1] for item in spec.extra_pvcs]

    def mounted(path: str) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    if not is_preset(spec.config) and not mounted(spec.config):
        raise UserError("--config", f"{spec.config!r} is read by the pods at the same path: use a "
                        f"preset or a file on the shared volume ({', '.join(roots)})")
    for key, value in (("data.path", cfg.data.path),
                       ("checkpoint.init_from", cfg.checkpoint.init_from)):
        if value.startswith("/") and not mounted(value):
            raise UserError(key, f"{value!r} is not on a volume the pods mount "
                            f"({', '.join(roots)})")


def labels(spec: JobSpec) -> dict[str, str]:
    """Labels of the job and its pods (selectable values: run id and task are shortened)."""
    out = {
        "app.kubernetes.io/name": "kfp-nvrx",
        naming.MANAGED_BY: "kfp-nvrx",
        naming.VERSION_KEY: naming.label_value(__version__),
        naming.TASK_KEY: naming.label_value(spec.task),
    }
    if spec.run_id:
        out[naming.RUN_ID_KEY] = naming.label_value(spec.run_id)
    return out


def annotations(spec: JobSpec, run_dir: str) -> dict[str, str]:
    """Annotations of the job: the full run id, task, version, config and run dir (re-attach)."""
    config = " ".join([spec.config, *(f"--set {o}" for o in spec.overrides)])
    return {
        naming.RUN_ID_KEY: spec.run_id,
        naming.TASK_KEY: spec.task,
        naming.VERSION_KEY: __version__,
        naming.CONFIG_KEY: config,
        naming.RUN_DIR_KEY: run_dir,
    }


#: The container's entrypoint in front of ft_launcher: a pod stopped by SIGTERM (deleted, drained,
#: its JobSet recreated) exits 143 instead of ft_launcher's 1, which the failure policies read as
#: "gave up" (:mod:`kfp_nvrx.components.core.pod_entry`; the table in docs/eks.md).
POD_ENTRY = ["python", "-m", "kfp_nvrx.components.core.pod_entry"]


def trainer_command(spec: JobSpec, cfg: Config, run_dir: str, procs: int, *,
                    rdzv_endpoint: str = "", rdzv_id: str = "") -> list[str]:
    """The worker container's ft_launcher command, the same for a PyTorchJob and a TrainJob.

    Args:
        spec: The job.
        cfg: Its loaded trainer config.
        run_dir: The run directory inside the pods.
        procs: Workers per node (faults must aim at a rank of the largest world).
        rdzv_endpoint: c10d endpoint on the command line ('' = from ``PET_RDZV_ENDPOINT``).
        rdzv_id: Rendezvous id on the command line ('' = from ``PET_RDZV_ID``).

    """
    # The kubelet expands $(VAR) in a command (secret env values included): user text is escaped.
    trainer = TrainerArgs(config=escape_expansion(spec.config), run_dir=escape_expansion(run_dir),
                          overrides=[escape_expansion(o) for o in spec.overrides],
                          faults=[escape_expansion(f) for f in spec.checked_faults(
                              cfg, spec.node_range()[1] * procs)])
    # FT: one builder for pods and launch-local; $(POD_IP) is expanded by the kubelet from the env.
    return [*POD_ENTRY, *ft_launcher_argv(cfg.resilience, trainer, local_addr="$(POD_IP)",
                            nic_monitor=spec.profile.nic_monitor, rdzv_endpoint=rdzv_endpoint,
                            rdzv_id=rdzv_id)]


def pod_spec(spec: JobSpec, cfg: Config, run_dir: str, procs: int, *, container_name: str,
             command: list[str], ports: list[k8s.V1ContainerPort] | None = None) -> k8s.V1PodSpec:
    """The worker pod: one container running ``command``, its volumes, placement and security.

    Raises:
        UserError: On a bad value, naming the flag.

    """
    prof = spec.profile
    res = cfg.resilience
    vols, mounts = volumes(spec)
    security = None
    if (prof.efa if spec.efa is None else spec.efa):
        # libfabric pins (mlocks) buffers for RDMA.
        security = k8s.V1SecurityContext(capabilities=k8s.V1Capabilities(add=["IPC_LOCK"]))
    pull = spec.image_pull_policy
    if pull not in ("Always", "IfNotPresent", "Never"):
        raise UserError("--image-pull-policy",
                        f"must be Always, IfNotPresent or Never, got {pull!r}")
    container = k8s.V1Container(
        name=container_name,
        image=check_image(spec.image),
        image_pull_policy=pull,
        command=command,
        env=container_env(spec, res, run_dir),
        ports=ports,
        resources=resources(spec, procs),
        volume_mounts=mounts,
        security_context=security,
    )
    node_selector = dict(spec.node_selector)
    if prof.instance_type:
        node_selector[INSTANCE_TYPE_LABEL] = prof.instance_type
    tolerations = [dict(t) for t in prof.tolerations] + [dict(t) for t in spec.tolerations]
    pod_security = None
    if spec.fs_group is not None:
        # OnRootMismatch: a recursive chown of a large FSx volume hangs pod start-up.
        pod_security = k8s.V1PodSecurityContext(fs_group=spec.fs_group,
                                                fs_group_change_policy="OnRootMismatch")
    return k8s.V1PodSpec(
        containers=[container],
        volumes=vols,
        node_selector=node_selector or None,
        tolerations=tolerations or None,
        affinity=spec.affinity or None,
        priority_class_name=spec.priority_class or None,
        scheduler_name=spec.scheduler_name or None,
        service_account_name=spec.service_account or None,
        security_context=pod_security,
        # ft_launcher's --term-timeout plus its own shutdown: one decision, in launch_command.py.
        termination_grace_period_seconds=pod_grace_period_s(res),
    )
