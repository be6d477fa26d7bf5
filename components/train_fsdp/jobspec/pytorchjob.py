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
from kubeflow.training.api_client import ApiClient
from kubeflow.training.constants import constants
from kubernetes import client as k8s

from kfp_nvrx.components import __version__
from kfp_nvrx.components.core.config import PRESETS_DIR, Config, load_config
from kfp_nvrx.components.core.launch_command import (
    TrainerArgs,
    ft_launcher_argv,
    pod_grace_period_s,
)
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.train_fsdp.jobspec import naming
from kfp_nvrx.components.train_fsdp.jobspec.cluster_fields import (
    check_cluster_fields,
    escape_expansion,
)
from kfp_nvrx.components.train_fsdp.jobspec.env import container_env
from kfp_nvrx.components.train_fsdp.jobspec.profiles import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    HUGEPAGES_RESOURCE,
    INSTANCE_TYPE_LABEL,
)
from kfp_nvrx.components.train_fsdp.jobspec.spec import (
    JobSpec,
    check_abs_path,
    check_image,
    check_quantity,
    check_resource_name,
    parse_extra_pvc,
)

CONTAINER_NAME = "pytorch"  # the operator (and its webhook) require this name
REPLICA_TYPE = "Worker"
RESTART_POLICY = "ExitCode"
CLEAN_POD_POLICY = "Running"
RDZV_PORT = 23456  # the operator's default port; PET_RDZV_ENDPOINT points at worker-0 on it
SHM_VOLUME = "dshm"
DATA_VOLUME = "shared"


def is_preset(config: str) -> bool:
    """Tell whether ``config`` names a bundled preset (present in the image too)."""
    return "/" not in config and (PRESETS_DIR / f"{config}.yaml").is_file()


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


def to_dict(job: models.KubeflowOrgV1PyTorchJob) -> dict[str, Any]:
    """Serialise an SDK model the way the API client sends it."""
    return ApiClient().sanitize_for_serialization(job)


def _resources(spec: JobSpec, procs: int) -> k8s.V1ResourceRequirements:
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
    if hugepages and hugepages != "0":
        # Hugepages must have limit == request (and a cpu/memory request, set above).
        requests[HUGEPAGES_RESOURCE] = limits[HUGEPAGES_RESOURCE] = check_quantity(
            "--hugepages", hugepages
        )
    # No cpu/memory limit: the pod owns its node; a memory limit would also count /dev/shm
    # (memory-backed) against the container and OOM-kill it under DataLoader load.
    return k8s.V1ResourceRequirements(requests=requests, limits=limits or None)


def _volumes(spec: JobSpec) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
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


def _check_pod_paths(spec: JobSpec, cfg: Config) -> None:
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


def _labels(spec: JobSpec) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "kfp-nvrx",
        naming.MANAGED_BY: "kfp-nvrx",
        naming.VERSION_KEY: naming.label_value(__version__),
        naming.TASK_KEY: naming.label_value(spec.task),
    }
    if spec.run_id:
        labels[naming.RUN_ID_KEY] = naming.label_value(spec.run_id)
    return labels


def _annotations(spec: JobSpec, run_dir: str) -> dict[str, str]:
    config = " ".join([spec.config, *(f"--set {o}" for o in spec.overrides)])
    return {
        naming.RUN_ID_KEY: spec.run_id,
        naming.TASK_KEY: spec.task,
        naming.VERSION_KEY: __version__,
        naming.CONFIG_KEY: config,
        naming.RUN_DIR_KEY: run_dir,
    }


def _pod_spec(spec: JobSpec, cfg: Config, run_dir: str, procs: int) -> k8s.V1PodSpec:
    prof = spec.profile
    res = cfg.resilience
    # The kubelet expands $(VAR) in a command (secret env values included): user text is escaped.
    trainer = TrainerArgs(config=escape_expansion(spec.config), run_dir=escape_expansion(run_dir),
                          overrides=[escape_expansion(o) for o in spec.overrides],
                          faults=[escape_expansion(f) for f in spec.checked_faults(
                              cfg, spec.node_range()[1] * procs)])
    # One builder for pods and launch-local; $(POD_IP) is expanded by the kubelet from the env.
    command = ft_launcher_argv(res, trainer, local_addr="$(POD_IP)", nic_monitor=prof.nic_monitor)
    volumes, mounts = _volumes(spec)
    security = None
    if (prof.efa if spec.efa is None else spec.efa):
        # libfabric pins (mlocks) buffers for RDMA.
        security = k8s.V1SecurityContext(capabilities=k8s.V1Capabilities(add=["IPC_LOCK"]))
    pull = spec.image_pull_policy
    if pull not in ("Always", "IfNotPresent", "Never"):
        raise UserError("--image-pull-policy",
                        f"must be Always, IfNotPresent or Never, got {pull!r}")
    container = k8s.V1Container(
        name=CONTAINER_NAME,
        image=check_image(spec.image),
        image_pull_policy=pull,
        command=command,
        env=container_env(spec, res, run_dir),
        ports=[k8s.V1ContainerPort(name="pytorchjob-port", container_port=RDZV_PORT)],
        resources=_resources(spec, procs),
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
        volumes=volumes,
        node_selector=node_selector or None,
        tolerations=tolerations or None,
        affinity=spec.affinity or None,
        priority_class_name=spec.priority_class or None,
        scheduler_name=spec.scheduler_name or None,
        service_account_name=spec.service_account or None,
        security_context=pod_security,
        # ft_launcher's --term-timeout plus its own shutdown: one decision, in command.py.
        termination_grace_period_seconds=pod_grace_period_s(res),
    )


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
    _check_pod_paths(spec, cfg)
    labels = _labels(spec)
    for key, value in (("--active-deadline", spec.active_deadline_s),
                       ("--ttl-after-finished", spec.ttl_after_finished_s),
                       ("--backoff-limit", spec.backoff_limit)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < (1 if key == "--active-deadline" else 0)):
            raise UserError(key, f"must be a whole number of seconds >= "
                            f"{1 if key == '--active-deadline' else 0}, got {value!r}")
    template = k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(
            labels=labels,
            # Kubeflow profile namespaces often inject Istio sidecars: they intercept the c10d
            # rendezvous/NCCL bootstrap ports and keep finished pods from completing.
            annotations={"sidecar.istio.io/inject": "false"},
        ),
        spec=_pod_spec(spec, cfg, run_dir, procs),
    )
    job = models.KubeflowOrgV1PyTorchJob(
        api_version=constants.API_VERSION,
        kind=constants.PYTORCHJOB_KIND,
        metadata=k8s.V1ObjectMeta(
            name=name,
            namespace=spec.namespace or None,
            labels=labels,
            annotations=_annotations(spec, run_dir),
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
    from kfp_nvrx.components.train_fsdp.jobspec.validate import validate_job

    rendered = build_pytorchjob(spec)
    validate_job(rendered.to_dict())
    return rendered
