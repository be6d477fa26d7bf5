"""Our env defaults of the trainer container: NCCL/EFA settings and NVRx requirements.

Both doors to a pod read them here: the launcher's pod spec (:mod:`..launch.jobspec.pod` puts the
downward-API vars first, then these defaults, then the user's env, a user value replacing a
default of the same name, then env from Secrets) and the ``kfp-nvrx-ft`` runtime's own command
(:mod:`.runtime_entry`, for a TrainJob that brings no command: it adds the defaults the pod's env
does not set already).

What is *not* here on purpose: ``FI_PROVIDER``, ``NCCL_PROTO``, ``FI_EFA_FORK_SAFE``, ``RDMAV_*``,
``NCCL_BUFFSIZE``. aws-ofi-nccl >= 1.7 sets the p4d/p5 tunables itself and these old settings
override its per-platform choices (see docs/eks.md). ``PET_*``, ``MASTER_ADDR``/``MASTER_PORT``
and ``PYTHONUNBUFFERED`` come from the Training Operator.
"""

from __future__ import annotations

import posixpath

from kfp_nvrx.components.core.config import ResilienceConfig
from kfp_nvrx.components.core.launch_command import agent_env, in_process_env
from kfp_nvrx.components.core.rundir import NCCL_TRACE_DIR


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


def default_env(gpu: bool, res: ResilienceConfig, run_dir: str) -> dict[str, str]:
    """Our env defaults of the trainer container: the agent's, NCCL's, NVRx's for in-process.

    The agent's own settings always, NCCL on GPU profiles, NVRx's requirements for in-process.

    Args:
        gpu: Whether the instance profile has GPUs.
        res: The trainer config's ``resilience`` section.
        run_dir: Run directory as the pod sees it.
    """
    defaults: dict[str, str] = agent_env(res)
    if gpu:
        defaults.update(gpu_env(run_dir))
    if res.in_process:  # FT: the in-process restarter's requirements, as launch-local sets them
        defaults.update(in_process_env(gpu=gpu))
    return defaults
