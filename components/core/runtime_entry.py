"""The ``kfp-nvrx-ft`` runtime's own command, for a TrainJob that brings none.

``kfp-nvrx launch`` and the pipelines render the whole ft_launcher line into ``trainer.command``
(:mod:`..launch.trainjob.render`), which replaces this one. A TrainJob made another way — the
Kubeflow SDK's ``TrainerClient().train(runtime="kfp-nvrx-ft",
trainer=CustomTrainerContainer(image=..., num_nodes=N, env={...}))`` sets image, node count,
resources and env only — runs ``python -m kfp_nvrx.components.core.runtime_entry [ARGS]``, which
reads the run from the environment and from ``ARGS`` (the SDK's ``TrainerArgs`` option), checks
it, and then runs the very ft_launcher line the launcher would have rendered, through
:mod:`.pod_entry` (exit codes, stop requests, the run-dir claim), in this pod:

=====================  =================================================================
``KFP_NVRX_CONFIG``    preset (``tiny``, ``125m``, ``1b``, ``8b``) or a YAML file in the pod;
                       or ``--config`` (required, one of the two)
``KFP_NVRX_SET``       ``section.key=value`` overrides, separated by spaces (shell quoting);
                       then ``--set`` ones (a key set twice keeps the last)
``KFP_NVRX_FAULTS``    drill faults, ``KIND@STEP[/RANK][:NAME=VALUE]``, separated by spaces;
                       and ``--fault`` ones
``KFP_NVRX_RUN_DIR``   the run dir on the shared volume, or ``--run-dir``; default
                       ``/fsx/runs/<TrainJob name>`` (a new TrainJob name: a new run)
``KFP_NVRX_NIC_MONITOR``  ``true``: NVRx watches the NICs' ``link_downed`` counters (not EFA's)
=====================  =================================================================

What the launcher takes from the job, this reads from the pod: the rendezvous endpoint from the
torch plugin's ``PET_MASTER_ADDR``/``PET_MASTER_PORT``, the rendezvous id and the run-dir claim's
holder from the TrainJob's name (the JobSet's, which is the same: the runtime passes it as
``KFP_NVRX_TRAINJOB`` from the pod's label), ``--local-addr`` from ``POD_IP``, the GPU env
defaults when the pod has GPUs. Bad input is one line naming the setting, exit 2 (the runtime's
pod failure policy fails the TrainJob at once, no restart).
"""

from __future__ import annotations

import argparse
import glob
import os
import posixpath
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from kfp_nvrx.components.core import pod_entry
from kfp_nvrx.components.core.config import Config, load_config
from kfp_nvrx.components.core.faults import check_faults
from kfp_nvrx.components.core.launch_command import Rendezvous, TrainerArgs, ft_launcher_argv
from kfp_nvrx.components.core.pod_env import default_env
from kfp_nvrx.components.core.run_claim import HOLDER_ENV, RUN_DIR_ENV, kube_holder
from kfp_nvrx.components.core.trainer_flags import add_trainer_flags
from kfp_nvrx.components.errors import UserError

CONFIG_ENV = "KFP_NVRX_CONFIG"
SET_ENV = "KFP_NVRX_SET"
FAULTS_ENV = "KFP_NVRX_FAULTS"
NIC_MONITOR_ENV = "KFP_NVRX_NIC_MONITOR"
#: The TrainJob's name, from the pod's JobSet label (the runtime's downward-API env).
JOB_ENV = "KFP_NVRX_TRAINJOB"
#: Where the runtime mounts the shared volume (``kfp-nvrx-shared``).
MOUNT = "/fsx"
#: The devices a pod with NVIDIA GPUs sees (the device plugin adds them to the container).
GPU_DEVICES = "/dev/nvidia[0-9]*"
_PREFIX = "kfp-nvrx runtime"


class _Args(argparse.ArgumentParser):
    """The trainer's flags as ``TrainerArgs`` passes them; an error is a UserError, not exit."""

    def error(self, message: str) -> NoReturn:
        raise UserError("args", f"{message} (TrainerArgs take --config, --set, --fault, "
                        "--run-dir)")


def _parser() -> _Args:
    p = _Args(prog="runtime_entry", add_help=False, allow_abbrev=False)
    add_trainer_flags(p)
    return p


def _split(env: Mapping[str, str], name: str) -> list[str]:
    try:
        return shlex.split(env.get(name, ""))
    except ValueError as err:
        raise UserError(name, f"cannot be split into words: {err}") from None


def _once(env: Mapping[str, str], name: str, flag: str, given: str | None) -> str:
    value = env.get(name, "").strip()
    if value and given is not None and given != value:
        raise UserError(name, f"{value!r} and TrainerArgs {flag} {given!r} disagree; set it once")
    return given if given is not None else value


def _env(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise UserError(name, "is not set in the pod: the TrainJob must refer to the kfp-nvrx-ft "
                        "runtime of images/deploy, whose pods (and Trainer v2's torch plugin) "
                        "set it")
    return value


def _nic_monitor(env: Mapping[str, str]) -> bool:
    value = env.get(NIC_MONITOR_ENV, "false").strip().lower()
    if value not in ("true", "false"):
        raise UserError(NIC_MONITOR_ENV, f"must be true or false, got {value!r}")
    return value == "true"


def _world(env: Mapping[str, str]) -> int | None:
    """Workers of the job when the torch plugin says (``auto`` on GPUs: not known here)."""
    nodes, procs = env.get("PET_NNODES", ""), env.get("PET_NPROC_PER_NODE", "")
    return int(nodes) * int(procs) if nodes.isdigit() and procs.isdigit() else None


@dataclass(frozen=True)
class RuntimeRun:
    """One pod's run, read from its env and args once; everything after uses these values.

    Attributes:
        job: The TrainJob's name (rendezvous id, run-dir claim).
        namespace: Its namespace.
        config: The loaded, validated trainer config.
        trainer: The trainer's own flags (config reference, run dir, overrides, faults).
        rdzv: node 0's c10d endpoint and the rendezvous id.
        local_addr: This pod's IP (``--local-addr``).
        nic_monitor: ``--ft-enable-nic-monitor``.
        gpu: Whether the pod has NVIDIA GPUs (NCCL env defaults).
    """

    job: str
    namespace: str
    config: Config
    trainer: TrainerArgs
    rdzv: Rendezvous
    local_addr: str
    nic_monitor: bool = False
    gpu: bool = False

    def argv(self) -> list[str]:
        """The ft_launcher line, from the one builder the launcher renders its pods with."""
        # FT: the same ft_launcher flags (timeouts, restarts, stop save) as a rendered TrainJob.
        return ft_launcher_argv(self.config.resilience, self.trainer, local_addr=self.local_addr,
                                nic_monitor=self.nic_monitor, rdzv=self.rdzv)

    def env(self, have: Mapping[str, str]) -> dict[str, str]:
        """What this pod's env gets before ft_launcher starts.

        The run dir and its claim, then our defaults for the names ``have`` does not set (the
        user's env wins, as in a rendered pod).
        """
        out = {RUN_DIR_ENV: self.trainer.run_dir,
               HOLDER_ENV: kube_holder(self.namespace, self.job)}
        defaults = default_env(self.gpu, self.config.resilience, self.trainer.run_dir)
        out.update({k: v for k, v in defaults.items() if k not in have})
        return out

    def describe(self) -> str:
        """One line for the pod's log: what runs where."""
        text = " ".join([self.trainer.config, *(f"--set {o}" for o in self.trainer.overrides),
                         *(f"--fault {f}" for f in self.trainer.faults)])
        return f"TrainJob {self.namespace}/{self.job}: {text}; run dir {self.trainer.run_dir}"


def read_run(env: Mapping[str, str], args: list[str], gpu: bool = False) -> RuntimeRun:
    """Read and check one pod's run from its ``env`` and container ``args``.

    Raises:
        UserError: A setting is missing or wrong, naming it (the env name or ``args``).
    """
    flags = _parser().parse_args(args)
    config = _once(env, CONFIG_ENV, "--config", flags.config)
    if not config:
        raise UserError(CONFIG_ENV, "is not set: name a preset (tiny, 125m, 1b, 8b) or a YAML "
                        "file in the pod, in the trainer's env or as TrainerArgs --config")
    overrides = [*_split(env, SET_ENV), *flags.overrides]
    faults = [*_split(env, FAULTS_ENV), *flags.faults]
    job, namespace = _env(env, JOB_ENV), _env(env, "POD_NAMESPACE")
    run_dir = _once(env, RUN_DIR_ENV, "--run-dir", flags.run_dir) or posixpath.join(
        MOUNT, "runs", job)
    if not posixpath.isabs(run_dir):
        raise UserError(RUN_DIR_ENV, f"{run_dir!r} must be an absolute path on the shared volume "
                        f"(the runtime mounts it at {MOUNT})")
    cfg = load_config(config, overrides)
    check_faults(faults, cfg.train.steps, cfg.checkpoint.interval, _world(env))
    endpoint = f"{_env(env, 'PET_MASTER_ADDR')}:{_env(env, 'PET_MASTER_PORT')}"
    trainer = TrainerArgs(config, run_dir, overrides, [f.strip() for f in faults],
                          store=cfg.checkpoint.store)
    return RuntimeRun(job=job, namespace=namespace, config=cfg, trainer=trainer,
                      rdzv=Rendezvous(endpoint, job), local_addr=_env(env, "POD_IP"),
                      nic_monitor=_nic_monitor(env), gpu=gpu)


def has_gpus() -> bool:
    """Whether this container sees NVIDIA GPU devices."""
    return bool(glob.glob(GPU_DEVICES))


def main(argv: list[str] | None = None) -> int:
    """Read the run, then hand its ft_launcher line to :func:`.pod_entry.main`; 2 on bad input."""
    args = sys.argv[1:] if argv is None else argv
    try:
        run = read_run(os.environ, args, gpu=has_gpus())
    except UserError as err:
        print(f"{_PREFIX}: {err.one_line()}", file=sys.stderr, flush=True)
        return 2
    print(f"{_PREFIX}: {run.describe()}", file=sys.stderr, flush=True)
    os.environ.update(run.env(os.environ))
    return pod_entry.main(run.argv())


if __name__ == "__main__":
    sys.exit(main())
