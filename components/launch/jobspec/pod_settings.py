"""The worker pod of a Kubernetes job, resolved: the profile's values with the user's, checked.

:func:`.resolve.resolve` calls :func:`resolve_pod` for a Kubernetes job (a local one has no pod);
the renderers (:mod:`.pod`) read the :class:`Pod` it returns and check nothing again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kfp_nvrx.components.core.config import PRESETS_DIR, Config
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.env import default_env
from kfp_nvrx.components.launch.jobspec.profiles import INSTANCE_TYPE_LABEL, InstanceProfile
from kfp_nvrx.components.launch.jobspec.spec import (
    JobSpec,
    check_abs_path,
    check_env_name,
    check_image,
    check_quantity,
    check_resource_name,
    check_seconds,
    parse_extra_pvc,
    parse_secret_env,
    quantity,
)

PULL_POLICIES = ("Always", "IfNotPresent", "Never")


@dataclass(frozen=True)
class Volume:
    """An extra PVC mount of the worker pods."""

    claim: str
    path: str
    read_only: bool


@dataclass(frozen=True)
class SecretEnv:
    """An env var of the trainer container read from a Secret."""

    name: str
    secret: str
    key: str


@dataclass(frozen=True)
class Pod:
    """The worker pod of a Kubernetes job, every value checked (profile defaults applied).

    Attributes:
        profile: The instance profile the pod runs on.
        image: Trainer image reference.
        pull_policy: ``imagePullPolicy`` of the trainer container.
        pvc: Claim of the shared volume, mounted at ``mount``.
        mount: Normalised mount path of the shared volume.
        shm_size: Size limit of the memory-backed ``/dev/shm``.
        volumes: Extra PVC mounts.
        cpu, memory: Requests of the trainer container.
        gpus: GPU request and limit (0 on CPU profiles).
        efa: EFA interfaces (0 = none).
        hugepages: ``hugepages-2Mi`` request and limit ('' = none).
        env: The container's env values (defaults, then user values) in order.
        secret_env: Env from Secrets.
        node_selector: The user's terms and the instance-type label.
        tolerations: The profile's and the user's.
        affinity: Pod affinity (Kubernetes field names) or None.
        pod_priority_class, scheduler_name, service_account: '' = not set.
        fs_group: Pod ``fsGroup`` or None.
        active_deadline_s: Cluster-side time limit (None = none).
        ttl_after_finished_s: PyTorchJob TTL (None = keep).
        backoff_limit: PyTorchJob ``runPolicy.backoffLimit``.
    """

    profile: InstanceProfile
    image: str
    pull_policy: str
    pvc: str
    mount: str
    shm_size: str
    volumes: tuple[Volume, ...]
    cpu: str
    memory: str
    gpus: int
    efa: int
    hugepages: str
    env: tuple[tuple[str, str], ...]
    secret_env: tuple[SecretEnv, ...]
    node_selector: tuple[tuple[str, str], ...]
    tolerations: tuple[dict[str, Any], ...]
    affinity: dict[str, Any] | None
    pod_priority_class: str
    scheduler_name: str
    service_account: str
    fs_group: int | None
    active_deadline_s: int | None
    ttl_after_finished_s: int | None
    backoff_limit: int

    @property
    def roots(self) -> tuple[str, ...]:
        """Folders the pods see on a volume: the shared one first, then the extra PVCs."""
        return (self.mount, *(v.path for v in self.volumes))


def is_preset(config: str) -> bool:
    """Tell whether ``config`` names a bundled preset (present in the image too)."""
    return "/" not in config and (PRESETS_DIR / f"{config}.yaml").is_file()


def resolve_pod(spec: JobSpec, cfg: Config, profile: InstanceProfile, procs: int,
                run_dir: str) -> Pod:
    """The worker pod of ``spec`` (its config loaded, ``procs`` workers, ``run_dir`` inside it).

    Raises:
        UserError: On any bad value, naming its field.
    """
    volumes = _volumes(spec)
    _check_pod_paths(spec, cfg, profile, (check_abs_path("mount", spec.mount),
                                          *(v.path for v in volumes)))
    check_seconds("active_deadline_s", spec.active_deadline_s, 1)
    check_seconds("ttl_after_finished_s", spec.ttl_after_finished_s, 0)
    check_seconds("backoff_limit", spec.backoff_limit, 0)
    return _pod(spec, cfg, profile, procs, run_dir, volumes)


def _volumes(spec: JobSpec) -> tuple[Volume, ...]:
    """The extra PVCs, each on a mount path of its own."""
    taken = {check_abs_path("mount", spec.mount), "/dev/shm"}
    out = []
    for item in spec.extra_pvcs:
        claim, path, read_only = parse_extra_pvc(item)
        if path in taken:
            raise UserError("extra_pvcs", f"mount path {path} is already used")
        taken.add(path)
        out.append(Volume(claim, path, read_only))
    return tuple(out)


def _check_pod_paths(spec: JobSpec, cfg: Config, profile: InstanceProfile,
                     roots: tuple[str, ...]) -> None:
    """What the trainer reads and uses must exist inside the pods (volumes, a GPU for cuda)."""
    if cfg.train.device == "cuda" and not profile.is_gpu:
        raise UserError("train.device", f"is cuda but instance type {profile.name} has no "
                        "GPU; use `overrides=train.device=cpu` (or auto) or a GPU `instance_type`")

    def mounted(path: str) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    if not is_preset(spec.config) and not mounted(spec.config):
        raise UserError("config", f"{spec.config!r} is read by the pods at the same path: use a "
                        f"preset or a file on the shared volume ({', '.join(roots)})")
    for key, value in (("data.path", cfg.data.path),
                       ("checkpoint.init_from", cfg.checkpoint.init_from)):
        if value and not value.startswith("/"):  # the pods would resolve it in their own cwd
            raise UserError(key, f"{value!r} is a relative path: each pod would look for it in "
                            "its own working directory, not yours; give the absolute path on "
                            f"the shared volume ({', '.join(roots)})")
        if value.startswith("/") and not mounted(value):
            raise UserError(key, f"{value!r} is not on a volume the pods mount "
                            f"({', '.join(roots)})")


def _pod(spec: JobSpec, cfg: Config, profile: InstanceProfile, procs: int, run_dir: str,
         volumes: tuple[Volume, ...]) -> Pod:
    """The worker pod's settings: the profile's values with the user's overrides, checked."""
    pvc = check_resource_name("pvc", spec.pvc) if spec.pvc else ""
    if not pvc:
        raise UserError("pvc", "the shared volume's PersistentVolumeClaim is required "
                        "(FSx for Lustre: data, run dir and checkpoints live there)")
    shm = check_quantity("shm_size", spec.shm_size or profile.shm_size)
    efa = profile.efa if spec.efa is None else spec.efa
    if isinstance(efa, bool) or not isinstance(efa, int) or efa < 0:
        raise UserError("efa", f"must be an integer >= 0, got {efa!r}")
    if efa and not profile.is_gpu:
        raise UserError("efa", f"EFA interfaces need a GPU instance type, not {profile.name!r}")
    if spec.image_pull_policy not in PULL_POLICIES:
        raise UserError("image_pull_policy", f"must be {', '.join(PULL_POLICIES[:-1])} or "
                        f"{PULL_POLICIES[-1]}, got {spec.image_pull_policy!r}")
    image = check_image(spec.image)
    env = _env(spec, cfg, profile, run_dir)
    secret_env = _secret_env(spec, {name for name, _ in env})
    cpu = check_quantity("cpu", spec.cpu or profile.cpu)
    memory = check_quantity("memory", spec.memory or profile.memory)
    hugepages = spec.hugepages or profile.hugepages
    # "0", "0Mi" and "0Gi" all mean no hugepages (an amount, not a text).
    if hugepages and quantity(check_quantity("hugepages", hugepages)) == 0:
        hugepages = ""
    selector = dict(spec.node_selector)
    if profile.instance_type:
        selector[INSTANCE_TYPE_LABEL] = profile.instance_type
    return Pod(profile=profile, image=image, pull_policy=spec.image_pull_policy, pvc=pvc,
               mount=check_abs_path("mount", spec.mount), shm_size=shm, volumes=volumes,
               cpu=cpu, memory=memory, gpus=procs if profile.is_gpu else 0, efa=efa,
               hugepages=hugepages, env=env, secret_env=secret_env,
               node_selector=tuple(selector.items()),
               tolerations=tuple(dict(t) for t in (*profile.tolerations, *spec.tolerations)),
               affinity=spec.affinity or None, pod_priority_class=spec.pod_priority_class,
               scheduler_name=spec.scheduler_name, service_account=spec.service_account,
               fs_group=spec.fs_group, active_deadline_s=spec.active_deadline_s,
               ttl_after_finished_s=spec.ttl_after_finished_s, backoff_limit=spec.backoff_limit)


def _env(spec: JobSpec, cfg: Config, profile: InstanceProfile,
         run_dir: str) -> tuple[tuple[str, str], ...]:
    """Our defaults, then the user's env (a user value replaces a default of the same name)."""
    for name in spec.env:
        check_env_name("env", name)
    merged = {**default_env(profile.is_gpu, cfg.resilience, run_dir),
              **{k: str(v) for k, v in spec.env.items()}}
    return tuple(merged.items())


def _secret_env(spec: JobSpec, seen: set[str]) -> tuple[SecretEnv, ...]:
    out = []
    for item in spec.secret_env:
        ref = SecretEnv(*parse_secret_env(item))
        if ref.name in seen:
            raise UserError("secret_env",
                            f"{ref.name} is also set by `env` or a default; set it once")
        seen = seen | {ref.name}
        out.append(ref)
    return tuple(out)
