"""``JobSpec`` (what the user said) -> ``ResolvedJob`` (what the job is), checked in one place.

:func:`resolve` is the only producer of a :class:`ResolvedJob`: every value a launcher or a
renderer needs is derived and checked here once: the node range, processes per node, the job
name, the run directory, the loaded trainer ``Config``, the faults (checked against that config and
the largest world) and, for Kubernetes, the worker pod (:mod:`.pod_settings`) and the Kueue queue.
The renderers (one folder per job API), the Kubernetes launcher and the local launcher read only a
``ResolvedJob``; what one job API cannot express is refused by that API after these checks, so
``job_api=auto`` reports bad input before the cluster is asked which API it serves.

What only the cluster knows is added to a resolved job when it is launched, by the two methods
that copy it: its namespace when the spec named none (:meth:`ResolvedJob.in_namespace`) and
Kueue's default LocalQueue (:meth:`ResolvedJob.in_queue`). The job's namespace has one holder:
:attr:`ResolvedJob.namespace`.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from kfp_nvrx.components.core.config import Config, load_config
from kfp_nvrx.components.core.faults import check_faults
from kfp_nvrx.components.core.launch_command import TrainerArgs
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec.cluster_fields import check_cluster_fields
from kfp_nvrx.components.launch.jobspec.pod_settings import Pod, resolve_pod
from kfp_nvrx.components.launch.jobspec.profiles import get_profile
from kfp_nvrx.components.launch.jobspec.queue import Queue, refuse_local, resolve_queue
from kfp_nvrx.components.launch.jobspec.spec import (
    JobSpec,
    check_abs_path,
    check_procs,
    parse_nodes,
)

#: The backends a job is resolved for: N ft_launcher agents here, or a job on a cluster.
LOCAL, KUBERNETES = "local", "kubernetes"
BACKENDS = (LOCAL, KUBERNETES)


@dataclass(frozen=True)
class ResolvedJob:
    """One training job as the launchers and renderers use it; made only by :func:`resolve`.

    Attributes:
        name: Job name (also the rendezvous id of a TrainJob and the run dir's default name).
        min_nodes, max_nodes: Node range (equal unless elastic).
        procs_per_node: Workers per node.
        run_dir: Run directory (inside the pods for Kubernetes; local path for ``local``).
        config: The loaded trainer config (``--config`` with ``--set`` applied).
        config_ref: The preset name or YAML path the trainer is given.
        overrides: The trainer's ``--set`` items as given.
        faults: Fault drills, checked against ``config`` and the largest world.
        run_id, task: KFP run id and task (labels, re-attach).
        namespace: The job's namespace: as the spec said, or once launched the cluster
            connection's ('' only before then: a rendered manifest then names none).
        pod: The worker pod (None for a local job: :meth:`worker` says so).
        user_env: The user's extra env (local agents take it as it is).
        queue: The Kueue LocalQueue and priority class (None: not queued; never for ``local``).
    """

    name: str
    min_nodes: int
    max_nodes: int
    procs_per_node: int
    run_dir: str
    config: Config
    config_ref: str
    overrides: tuple[str, ...]
    faults: tuple[str, ...]
    run_id: str
    task: str
    namespace: str
    pod: Pod | None = None
    user_env: tuple[tuple[str, str], ...] = ()
    queue: Queue | None = None

    @property
    def elastic(self) -> bool:
        """Whether the node count may vary between ``min_nodes`` and ``max_nodes``."""
        return self.min_nodes != self.max_nodes

    def worker(self) -> Pod:
        """The worker pod of a Kubernetes job.

        Raises:
            ValueError: The job was resolved for the local backend, which runs no pod (a
                caller's mistake: resolve it for ``kubernetes`` to render or follow it).
        """
        if self.pod is None:
            raise ValueError(f"job {self.name} was resolved for the {LOCAL} backend: it has no "
                             f"pod to render or follow (resolve it for {KUBERNETES})")
        return self.pod

    def trainer_args(self, run_dir: str | None = None) -> TrainerArgs:
        """The trainer's own flags (``run_dir`` overrides the job's, e.g. once made absolute)."""
        return TrainerArgs(self.config_ref, run_dir or self.run_dir, list(self.overrides),
                           list(self.faults), store=self.config.checkpoint.store)

    def in_namespace(self, namespace: str) -> ResolvedJob:
        """This job in ``namespace``, the cluster connection's, when the spec named none."""
        return self if self.namespace else dataclasses.replace(self, namespace=namespace)

    def in_queue(self, queue: Queue) -> ResolvedJob:
        """This job queued in ``queue`` (Kueue's default LocalQueue of its namespace)."""
        return dataclasses.replace(self, queue=queue)


def resolve(spec: JobSpec, backend: str = KUBERNETES) -> ResolvedJob:
    """Resolve ``spec`` for ``backend``: ``kubernetes`` or ``local``.

    ``kubernetes``: for any job API (each then refuses what it cannot express); ``local``: the
    trainer part, for N ft_launcher agents on this machine.

    Raises:
        UserError: On any bad value, naming its field.
    """
    if backend == LOCAL:
        return _resolve_local(spec)
    if backend == KUBERNETES:
        return _resolve_cluster(spec)
    raise UserError("backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")


def _resolve_local(spec: JobSpec) -> ResolvedJob:
    """The trainer part of ``spec`` for N ft_launcher agents on this machine.

    The instance profile does not describe this machine: one process per node unless told, and
    image, volumes and pod settings are not used.
    """
    refuse_local(spec)
    lo, hi = parse_nodes(spec.nodes)
    procs = check_procs(1 if spec.nproc_per_node is None else spec.nproc_per_node)
    cfg = load_config(spec.config, list(spec.overrides))
    run_dir = spec.run_dir or posixpath.join(spec.runs_dir or "runs", _checked_name(spec, hi))
    # The name is also the rendezvous id; outside KFP it follows the run directory's name.
    name = (_checked_name(spec, hi) if spec.name or spec.run_id
            else re.sub(r"[^a-z0-9-]", "-", Path(run_dir).resolve().name.lower()) or "run")
    return ResolvedJob(name=name, min_nodes=lo, max_nodes=hi, procs_per_node=procs,
                       run_dir=run_dir, config=cfg, config_ref=spec.config,
                       overrides=tuple(spec.overrides), faults=_faults(spec, cfg, hi * procs),
                       run_id=spec.run_id, task=spec.task, namespace=spec.namespace,
                       user_env=_user_env(spec))


def _resolve_cluster(spec: JobSpec) -> ResolvedJob:
    """``spec`` for a Kubernetes job: the trainer part, its worker pod and its queue."""
    check_cluster_fields(spec)
    queue = resolve_queue(spec)
    lo, hi = parse_nodes(spec.nodes)
    profile = get_profile(spec.instance_type)
    procs = _procs_on(spec, profile.default_procs, profile.gpus if profile.is_gpu else None,
                      profile.name)
    # The name's own limits depend on the job API (its Services, its JobSet's pods): checked there.
    name = spec.name or naming.derive_name(spec.run_id, spec.task)
    run_dir = _run_dir_on_volume(spec, name)
    cfg = load_config(spec.config, list(spec.overrides))  # validates --config / --set
    pod = resolve_pod(spec, cfg, profile, procs, run_dir)
    return ResolvedJob(name=name, min_nodes=lo, max_nodes=hi, procs_per_node=procs,
                       run_dir=run_dir, config=cfg, config_ref=spec.config,
                       overrides=tuple(spec.overrides), faults=_faults(spec, cfg, hi * procs),
                       run_id=spec.run_id, task=spec.task, namespace=spec.namespace, pod=pod,
                       user_env=_user_env(spec), queue=queue)


def _checked_name(spec: JobSpec, max_nodes: int) -> str:
    """The explicit name, or one derived from the run id and task; checked."""
    name = spec.name or naming.derive_name(spec.run_id, spec.task)
    naming.check_name(name, max_nodes)
    return name


def _procs_on(spec: JobSpec, default: int, gpus: int | None, profile: str) -> int:
    """Processes per pod (``gpus``: a GPU profile's GPUs per node, one process each at most)."""
    n = check_procs(default if spec.nproc_per_node is None else spec.nproc_per_node)
    if gpus is not None and n > gpus:
        raise UserError("nproc_per_node",
                        f"{n} processes need {n} GPUs but {profile} has {gpus} per node")
    return n


def _run_dir_on_volume(spec: JobSpec, name: str) -> str:
    """The run directory as the pods see it: on the shared volume, or lost with the pod."""
    mount = check_abs_path("mount", spec.mount)
    if not spec.run_dir and not spec.runs_dir:
        return posixpath.join(mount, "runs", name)
    run_dir = check_abs_path("run_dir", spec.run_dir or posixpath.join(spec.runs_dir, name))
    if run_dir != mount and not run_dir.startswith(mount.rstrip("/") + "/"):
        raise UserError(
            "run_dir",
            f"{run_dir!r} is not under the shared volume {mount!r}: checkpoints written "
            "elsewhere are lost when a pod restarts and are invisible to the other pods",
        )
    return run_dir


def _faults(spec: JobSpec, cfg: Config, world: int) -> tuple[str, ...]:
    """``faults`` after the trainer's own checks, so typos and faults that never fire fail first.

    Each must fall within ``train.steps`` and aim at a rank below ``world``.
    """
    check_faults(list(spec.faults), cfg.train.steps, cfg.checkpoint.interval, world)
    return tuple(f.strip() for f in spec.faults)


def _user_env(spec: JobSpec) -> tuple[tuple[str, str], ...]:
    return tuple((k, str(v)) for k, v in spec.env.items())
