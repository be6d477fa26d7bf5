"""The one builder of the ``ft_launcher`` command line, for pods and for ``launch-local``.

Node count, processes per node, rendezvous endpoint and id, and max restarts reach ft_launcher
through the ``PET_*`` environment that the Training Operator injects into a PyTorchJob with an
``elasticPolicy`` (``launch-local`` sets the same variables), so the argv below is identical on a
laptop and in a pod except for ``--local-addr`` and flags only newer NVRx versions accept, which
are added only where the launcher's version is known (see :func:`launcher_nvrx_version`).
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kfp_nvrx.components.core.ckpt_store import open_store
from kfp_nvrx.components.core.config import ResilienceConfig
from kfp_nvrx.components.core.store_kinds import DEFAULT_KIND
from kfp_nvrx.components.core.trainer_flags import CONFIG_FLAG, FAULT_FLAG, RUN_DIR_FLAG, SET_FLAG
from kfp_nvrx.components.errors import UserError

#: The module ft_launcher runs in every worker process.
TRAINER_MODULE = "kfp_nvrx.components.training.trainer"
#: The agent every node runs: NVRx's ft_launcher without the fixed 1 s waits of NVRx 0.7's restart
#: path (``kfp_nvrx.components.training.ft_agent``; its flags and behaviour are ft_launcher's).
FT_LAUNCHER = "kfp-nvrx-ft-launcher"
#: Rendezvous backend: ft_launcher requires c10d.
RDZV_BACKEND = "c10d"
#: First NVRx release known to accept ``--ft-gpu-memory-poll-interval`` (0.4.1 rejects it).
GPU_MEMORY_POLL_SINCE = (0, 7)
#: First NVRx release known to read ``--ft-checkpoint-iteration-file`` (its progress tracker;
#: 0.4.1 has neither and rejects the flag).
ITERATION_FILE_SINCE = (0, 7)


@dataclass
class TrainerArgs:
    """Arguments passed through to the trainer unchanged."""

    config: str
    run_dir: str
    overrides: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    # The resolved checkpoint.store: not a flag (the trainer resolves its own config), but the
    # launcher's side of the store, ft_launcher's progress file, is that store's.
    store: str = DEFAULT_KIND

    def argv(self) -> list[str]:
        """The trainer's own flags."""
        out = [CONFIG_FLAG, self.config, RUN_DIR_FLAG, self.run_dir]
        for item in self.overrides:
            out += [SET_FLAG, item]
        for item in self.faults:
            out += [FAULT_FLAG, item]
        return out


#: First NVRx release whose ft_launcher accepts only ``any-failed`` (``--ft-restart-policy`` is
#: deprecated there).
ANY_FAILED_ONLY_SINCE = (0, 6)
#: Seconds a pod keeps running after SIGTERM beyond ft_launcher's own stop timeout: the launcher
#: and its rendezvous shut down after the workers are gone.
POD_STOP_MARGIN_S = 30


def restart_policy(res: ResilienceConfig) -> str:
    """ft_launcher restart policy; ``auto`` is ``any-failed``.

    NVRx >= 0.6 (the images ship 0.7.0) accepts only ``any-failed``. In-process restart works
    with it: an exception handled in-process never reaches the launcher. ``min-healthy``
    (NVRx <= 0.5 only) is passed through when set explicitly.
    """
    return "any-failed" if res.restart_policy == "auto" else res.restart_policy


def restart_policy_flags(res: ResilienceConfig, nvrx_version: str | None) -> list[str]:
    """``--ft-restart-policy`` only when it is not ``any-failed``, the default of every NVRx.

    NVRx 0.7 deprecates the flag, so the default is never written out. ``min-healthy`` exists only
    up to NVRx 0.5; a pod's version is unknown here and the trainer image ships 0.7, so it is
    refused unless the launcher is known to be older.

    Raises:
        UserError: ``min-healthy`` for an NVRx that has no such policy.
    """
    policy = restart_policy(res)
    if policy == "any-failed":
        return []
    version = _version_tuple(nvrx_version)
    if not version or version >= ANY_FAILED_ONLY_SINCE:
        raise UserError("resilience.restart_policy",
                        f"{policy} needs NVRx <= 0.5, but ft_launcher here is "
                        f"{nvrx_version or 'the trainer image (NVRx 0.7)'}; use auto")
    return [f"--ft-restart-policy={policy}"]


def stop_timeout_s(res: ResilienceConfig) -> float:
    """How long ft_launcher waits for its workers to exit before SIGKILL when it restarts them.

    ``--workers-stop-timeout``: a peer failed; the workers exit at once on SIGTERM.
    """
    return float(res.workers_stop_timeout)


def term_timeout_s(res: ResilienceConfig) -> float:
    """``--term-timeout``: how long a stopped node's workers have before SIGKILL.

    They first save (up to ``resilience.stop_save_timeout``, :mod:`.stop_request`), then exit.
    NVRx's default is 1800 s, far past any pod's grace period, so the kubelet would SIGKILL
    everything first.
    """
    return stop_timeout_s(res) + float(res.stop_save_timeout)


def pod_grace_period_s(res: ResilienceConfig) -> int:
    """``terminationGracePeriodSeconds``: ft_launcher's term timeout plus its own shutdown."""
    return math.ceil(term_timeout_s(res)) + POD_STOP_MARGIN_S


def _version_tuple(version: str | None) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version or "")[:3])


def launcher_nvrx_version(executable: str) -> str | None:
    """NVRx version of ``executable`` when it is this environment's ft_launcher, else None.

    ``launch-local`` runs the ft_launcher next to ``sys.executable``, whose version is the one
    installed here. A pod runs the image's ft_launcher, whose version this machine cannot know.
    """
    if Path(executable).parent != Path(sys.executable).parent:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-resiliency-ext")
    except PackageNotFoundError:
        return None


def ft_flags(res: ResilienceConfig, *, nic_monitor: bool = False,
             nvrx_version: str | None = None) -> list[str]:
    """Every ``--ft-*`` value set explicitly (NVRx 0.5+ changed several defaults).

    In ``sections`` mode the trainer opens ``setup``/``step``/``checkpoint`` sections and also sends
    one heartbeat per step, so both sets of timeouts are live. In ``heartbeats`` mode no section is
    ever opened, and the section flags are left out (their default, ``None``, disables them).

    With ``nvrx_version`` >= 0.7 the GPU-memory poll after stopping failed workers runs every
    ``resilience.launcher_poll_interval`` seconds instead of NVRx's 2 s: ft_launcher waits for the
    failed workers' GPU memory to be released before it starts new ones, and the 2 s period alone
    could add up to 2 s to every in-job restart. Older versions have no such wait and reject the
    flag, so it is left out when the version is unknown.
    """
    # FT: timeouts the rank monitors start with; learned values replace them at run time.
    flags = [
        f"--ft-initial-rank-heartbeat-timeout={res.initial_heartbeat_timeout:g}",
        f"--ft-rank-heartbeat-timeout={res.heartbeat_timeout:g}",
        f"--ft-workload-check-interval={res.workload_check_interval:g}",
        f"--ft-safety-factor={res.safety_factor:g}",
        *restart_policy_flags(res, nvrx_version),
        f"--ft-enable-nic-monitor={'True' if nic_monitor else 'False'}",
    ]
    if res.monitor == "sections":
        flags += [
            "--ft-rank-section-timeouts="
            f"setup:{res.setup_timeout:g},step:{res.step_timeout:g},"
            f"checkpoint:{res.checkpoint_timeout:g}",
            f"--ft-rank-out-of-section-timeout={res.out_of_section_timeout:g}",
        ]
    if _version_tuple(nvrx_version) >= GPU_MEMORY_POLL_SINCE:
        # FT: how often ft_launcher checks that the failed workers' GPU memory is free again.
        flags.append(f"--ft-gpu-memory-poll-interval={res.launcher_poll_interval:g}")
    return flags


@dataclass(frozen=True)
class FtLauncher:
    """Which ft_launcher runs an agent.

    Attributes:
        executable: The launcher binary (an absolute path for local runs): :data:`FT_LAUNCHER`,
            or NVRx's own ``ft_launcher``.
        nvrx_version: NVRx version of that launcher, enabling flags only newer versions accept;
            None: the installed one when ``executable`` is this environment's ft_launcher
            (``launch-local``), else none (pods: the image's version is not known here).
    """

    executable: str = FT_LAUNCHER
    nvrx_version: str | None = None


@dataclass(frozen=True)
class Rendezvous:
    """Where an agent meets its peers, when its command line says so rather than ``PET_*``.

    Attributes:
        endpoint: c10d endpoint ('' = from ``PET_RDZV_ENDPOINT``, which a PyTorchJob and
            ``launch-local`` set; a TrainJob sets none).
        id: Rendezvous id ('' = from ``PET_RDZV_ID``).
    """

    endpoint: str = ""
    id: str = ""


def ft_launcher_argv(
    res: ResilienceConfig,
    trainer: TrainerArgs,
    *,
    local_addr: str,
    nic_monitor: bool = False,
    launcher: FtLauncher = FtLauncher(),
    rdzv: Rendezvous = Rendezvous(),
) -> list[str]:
    """The full ``ft_launcher`` command line.

    Args:
        res: The trainer config's ``resilience`` section (timeouts, restarts, policy).
        trainer: Flags passed through to the trainer.
        local_addr: This agent's address; becomes MASTER_ADDR when the agent is group rank 0.
            In a pod this is ``$(POD_IP)`` (expanded by Kubernetes from the downward API).
        nic_monitor: Whether NVRx watches the NICs' ``link_downed`` counters (the instance
            profile decides: EFA has no such counter).
        launcher: The ft_launcher binary and its NVRx version.
        rdzv: The rendezvous endpoint and id given on the command line.

    Returns:
        argv, ready for ``subprocess`` or a container ``command``.
    """
    executable, nvrx_version = launcher.executable, launcher.nvrx_version
    if nvrx_version is None:
        nvrx_version = launcher_nvrx_version(executable)
    progress = []
    if _version_tuple(nvrx_version) >= ITERATION_FILE_SINCE:
        # FT: ft_launcher's progress tracking reads the newest committed step the trainer writes
        # (without it NVRx 0.7 warns that no iterations are reported and tracks nothing).
        # The file is the store's (a rendered job's run dir is a path in the pod: nothing is read).
        progress_file = open_store(trainer.run_dir, trainer.store).progress_file
        progress = [f"--ft-checkpoint-iteration-file={progress_file}"]
    rdzv_flags = [f"--rdzv-endpoint={rdzv.endpoint}"] if rdzv.endpoint else []
    rdzv_flags += [f"--rdzv-id={rdzv.id}"] if rdzv.id else []
    return [
        executable,
        f"--rdzv-backend={RDZV_BACKEND}",
        *rdzv_flags,
        f"--local-addr={local_addr}",
        f"--max-restarts={agent_max_restarts(res.max_restarts)}",
        # FT: restarts stop workers at once; a stopped pod's workers save first (term_timeout_s).
        f"--workers-stop-timeout={stop_timeout_s(res):g}",
        f"--term-timeout={term_timeout_s(res):g}",
        # FT: how often the agent checks its workers (and, in NVRx 0.7, whether a peer opened a
        # restart round): the failure-detection latency of an in-job restart (torchrun: 0.1 s).
        f"--monitor-interval={res.launcher_poll_interval:g}",
        *ft_flags(res, nic_monitor=nic_monitor, nvrx_version=nvrx_version),
        *progress,
        "-m",
        TRAINER_MODULE,
        *trainer.argv(),
    ]


#: Set in an agent's environment when it keeps a warm process for its workers' starts
#: (``resilience.warm_start``; ``kfp_nvrx.components.training.ft_agent``).
WARM_START_ENV = "KFP_NVRX_WARM_START"


def agent_env(res: ResilienceConfig) -> dict[str, str]:
    """What the agent itself reads from its environment (pods and ``launch-local`` alike)."""
    return {WARM_START_ENV: "1"} if res.warm_start else {}


def in_process_env(gpu: bool) -> dict[str, str]:
    """What NVRx in-process restart requires of a worker's environment before torch is imported.

    Shared by the pod spec and the local launcher, so what the drills verify is what pods get.
    """
    env = {"TORCH_CPP_LOG_LEVEL": "error"}
    if gpu:
        env.update({
            # CUDA errors seen by the NCCL watchdog must reach the Wrapper, not kill the process.
            "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
            # NVLink SHARP / multicast objects do not survive an in-process communicator rebuild.
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
        })
    return env


def agent_max_restarts(max_restarts: int) -> int:
    """ft_launcher's own restart count (``--max-restarts``, ``PET_MAX_RESTARTS``): one over the job's.

    ``resilience.max_restarts`` is the job's budget, judged by rank 0 when a restart starts
    (:mod:`.rounds`). An agent's count is only a backstop, and it may reach the job's: a fault on
    one node can fail every node's workers (their collectives with it break), and each agent
    counts that as a failure of its own. Given the job's number, every agent could give up at the
    restart that spends the budget, before rank 0 says why (a 2-node run failed with "ft_launcher
    exited 1" and no verdict); one more lets that restart start and rank 0 judge it.
    """
    return max_restarts + 1


def pet_env(
    *, nnodes: str, nproc_per_node: int, rdzv_endpoint: str, rdzv_id: str, max_restarts: int
) -> dict[str, str]:
    """The environment a PyTorchJob with ``elasticPolicy`` gives each pod (for local agents)."""
    return {
        "PET_NNODES": nnodes,
        "PET_NPROC_PER_NODE": str(nproc_per_node),
        "PET_RDZV_ENDPOINT": rdzv_endpoint,
        "PET_RDZV_ID": rdzv_id,
        "PET_RDZV_BACKEND": RDZV_BACKEND,
        "PET_MAX_RESTARTS": str(agent_max_restarts(max_restarts)),
    }
