"""Environment of the ``pytorch`` container: downward API, NCCL/EFA, NVRx requirements, user env.

What is *not* here on purpose: ``FI_PROVIDER``, ``NCCL_PROTO``, ``FI_EFA_FORK_SAFE``, ``RDMAV_*``,
``NCCL_BUFFSIZE``. aws-ofi-nccl >= 1.7 sets the p4d/p5 tunables itself and these old settings
override its per-platform choices (see docs/eks.md). ``PET_*``, ``MASTER_ADDR``/``MASTER_PORT``
and ``PYTHONUNBUFFERED`` come from the Training Operator.
"""

from __future__ import annotations

import posixpath

from kubernetes import client as k8s

from kfp_nvrx.components.core.config import ResilienceConfig
from kfp_nvrx.components.core.launch_command import in_process_env
from kfp_nvrx.components.core.rundir import NCCL_TRACE_DIR
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.spec import (
    JobSpec,
    check_env_name,
    parse_secret_env,
)


def _field_ref(path: str) -> k8s.V1EnvVarSource:
    return k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path=path))


def gpu_env(run_dir: str) -> dict[str, str]:
    """NCCL settings for GPU profiles (EFA through aws-ofi-nccl)."""
    return {
        # Keep NCCL's bootstrap/socket traffic off loopback and container bridges; data goes over
        # EFA through the aws-ofi-nccl plugin.
        "NCCL_SOCKET_IFNAME": "^lo,docker,veth",
        "NCCL_DEBUG": "WARN",
        # torch's default (3): on a collective error or timeout the watchdog tears the process
        # down without ncclCommAbort (which can itself hang on a dead peer); ft_launcher then
        # restarts the worker group. Set explicitly: ft_launcher injects 1 when it is unset.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        # Flight recorder: on a timeout each rank dumps its last collectives to the shared volume.
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": posixpath.join(run_dir, NCCL_TRACE_DIR, "rank_"),
    }


def container_env(spec: JobSpec, res: ResilienceConfig, run_dir: str) -> list[k8s.V1EnvVar]:
    """Build the full env list of the trainer container, in a stable order.

    Args:
        spec: The job.
        res: The trainer config's resilience section (in-process restart on/off).
        run_dir: Run directory as the pod sees it.

    Returns:
        Downward-API vars first (``POD_IP`` feeds ``--local-addr=$(POD_IP)``), then NCCL/NVRx
        defaults, then user env (a user value replaces a default of the same name), then env from
        Secrets.

    """
    profile = spec.profile
    defaults: dict[str, str] = {}
    if profile.is_gpu:
        defaults.update(gpu_env(run_dir))
    if res.in_process:
        defaults.update(in_process_env(gpu=profile.is_gpu))
    for name in spec.env:
        check_env_name("--env", name)
    merged = {**defaults, **{k: str(v) for k, v in spec.env.items()}}

    env = [
        k8s.V1EnvVar(name="POD_IP", value_from=_field_ref("status.podIP")),
        k8s.V1EnvVar(name="POD_NAME", value_from=_field_ref("metadata.name")),
    ]
    env += [k8s.V1EnvVar(name=k, value=v) for k, v in merged.items()]
    seen = set(merged)
    for item in spec.secret_env:
        name, secret, key = parse_secret_env(item)
        if name in seen:
            raise UserError("--secret-env",
                            f"{name} is also set by --env or a default; set it once")
        seen.add(name)
        env.append(k8s.V1EnvVar(
            name=name,
            value_from=k8s.V1EnvVarSource(
                secret_key_ref=k8s.V1SecretKeySelector(name=secret, key=key)
            ),
        ))
    return env

