"""``kfp-nvrx render-job``: print the validated PyTorchJob or TrainJob YAML (``kubectl apply -f``).

The job flags are shared with ``kfp-nvrx launch`` (:func:`add_job_arguments`,
:func:`spec_from_args`); trainer flags (``--config``, ``--set``, ``--fault``, ``--run-dir``) pass
through to the trainer unchanged.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kfp_nvrx.components.core import argtypes
from kfp_nvrx.components.core.atomic import check_output
from kfp_nvrx.components.core.atomic import write_atomic as core_write_atomic
from kfp_nvrx.components.core.trainer_flags import add_trainer_flags
from kfp_nvrx.components.launch import job_apis


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """Add the JobSpec flags to a subcommand parser."""
    g = p.add_argument_group("job")
    g.add_argument("--runtime", default="kfp-nvrx-ft",
                   help="trainjob: the runtime the TrainJob refers to (default kfp-nvrx-ft)")
    g.add_argument("--runtime-kind", default="TrainingRuntime",
                   help="trainjob: TrainingRuntime (default; namespaced, shipped in "
                   "images/deploy) or ClusterTrainingRuntime (cluster-scoped)")
    g.add_argument("--name", default="", help="job name (default: derived from --run-id/--task)")
    g.add_argument("--run-id", default="", help="KFP run id (labels, stable name, re-attach)")
    g.add_argument("--task", default="train", help="KFP task name (default train)")
    g.add_argument("--namespace", default="", help="namespace (default: current context's)")
    g.add_argument("--nodes", default="1", help="worker pods: N or MIN:MAX (default 1)")
    g.add_argument("--instance-type", default="p5.48xlarge",
                   help="p5.48xlarge (default), p4d.24xlarge or cpu")
    g.add_argument("--nproc-per-node", "--gpus-per-node", dest="nproc_per_node", type=int,
                   default=None, help="processes per pod; one per GPU (default: all GPUs, cpu: 1)")
    g.add_argument("--image", default="", help="trainer image (required for Kubernetes)")
    g.add_argument("--pvc", default="", help="shared volume claim, e.g. FSx for Lustre (required)")
    g.add_argument("--mount", default="/fsx", help="mount path of --pvc (default /fsx)")
    t = p.add_argument_group("trainer (passed through)")
    add_trainer_flags(t, config="tiny", run_dir_type=argtypes.path,
                      run_dir_help="run directory (default <mount>/runs/<name>)")
    q = p.add_argument_group("queue (Kueue)")
    q.add_argument("--queue-name", default="",
                   help="Kueue LocalQueue the job waits in for quota (its namespace's)")
    q.add_argument("--priority-class", default="",
                   help="Kueue WorkloadPriorityClass of the job (needs --queue-name)")
    r = p.add_argument_group("pod")
    r.add_argument("--env", action="append", default=[], metavar="K=V", help="container env")
    r.add_argument("--secret-env", action="append", default=[], metavar="NAME=SECRET:KEY")
    r.add_argument("--extra-pvc", action="append", default=[], metavar="CLAIM:/PATH[:ro]")
    r.add_argument("--cpu", default="", help="cpu request (default: profile)")
    r.add_argument("--memory", default="", help="memory request (default: profile)")
    r.add_argument("--efa", type=int, default=None, help="EFA interfaces (default: profile)")
    r.add_argument("--hugepages", default="", help="hugepages-2Mi (default: profile; 0 = none)")
    r.add_argument("--shm-size", default="", help="/dev/shm size limit (default: profile)")
    r.add_argument("--node-selector", action="append", default=[], metavar="K=V")
    r.add_argument("--toleration", action="append", default=[], metavar="KEY[=VALUE]:EFFECT")
    r.add_argument("--affinity", default="", help="pod affinity as YAML/JSON, or @FILE")
    r.add_argument("--pod-priority-class", default="",
                   help="the pods' Kubernetes PriorityClass (priorityClassName)")
    r.add_argument("--scheduler-name", default="")
    r.add_argument("--service-account", default="")
    r.add_argument("--image-pull-policy", default="IfNotPresent")
    r.add_argument("--fs-group", type=int, default=None, help="pod fsGroup (OnRootMismatch)")
    r.add_argument("--active-deadline", type=int, default=7 * 24 * 3600,
                   help="runPolicy.activeDeadlineSeconds (default 7 days; 0 = none)")
    r.add_argument("--ttl-after-finished", type=int, default=24 * 3600,
                   help="runPolicy.ttlSecondsAfterFinished (default 1 day; -1 = keep)")
    r.add_argument("--backoff-limit", type=int, default=3, help="runPolicy.backoffLimit")


def _affinity(text: str) -> dict[str, Any] | None:
    from kfp_nvrx.components.core.bounded import CONFIG_LIMIT, read_text
    from kfp_nvrx.components.core.config_text import load_yaml
    from kfp_nvrx.components.errors import UserError

    if not text:
        return None
    where = "--affinity"
    if text.startswith("@"):  # a file: bounded, regular files only (no /dev/zero, no FIFO)
        where = text[1:]
        text = read_text(where, "--affinity", CONFIG_LIMIT, "affinity file")
    value = load_yaml(text, "--affinity", where)
    if not isinstance(value, dict):
        raise UserError("--affinity", "expected a YAML/JSON mapping (Kubernetes affinity fields)")
    return value


def spec_from_args(args: argparse.Namespace) -> Any:
    """Build a JobSpec from parsed flags (raises UserError naming the flag)."""
    from kfp_nvrx.components.errors import UserError
    from kfp_nvrx.components.launch.jobspec.spec import (
        JobSpec,
        parse_key_values,
        parse_toleration,
    )

    if args.active_deadline < 0:
        raise UserError("--active-deadline", f"must be >= 0 seconds, got {args.active_deadline}")
    if args.ttl_after_finished < -1:
        raise UserError("--ttl-after-finished", f"must be >= -1, got {args.ttl_after_finished}")
    return JobSpec(
        image=args.image, pvc=args.pvc, name=args.name, run_id=args.run_id, task=args.task,
        namespace=args.namespace, nodes=args.nodes, instance_type=args.instance_type,
        nproc_per_node=args.nproc_per_node, mount=args.mount, run_dir=args.run_dir or "",
        config=args.config, overrides=list(args.overrides), faults=list(args.faults),
        env=parse_key_values("--env", args.env), secret_env=list(args.secret_env),
        extra_pvcs=list(args.extra_pvc), cpu=args.cpu, memory=args.memory, efa=args.efa,
        hugepages=args.hugepages, shm_size=args.shm_size,
        node_selector=parse_key_values("--node-selector", args.node_selector),
        tolerations=[parse_toleration(t) for t in args.toleration],
        affinity=_affinity(args.affinity), queue_name=args.queue_name,
        priority_class=args.priority_class, pod_priority_class=args.pod_priority_class,
        scheduler_name=args.scheduler_name, service_account=args.service_account,
        image_pull_policy=args.image_pull_policy, fs_group=args.fs_group,
        active_deadline_s=args.active_deadline or None,
        ttl_after_finished_s=None if args.ttl_after_finished == -1 else args.ttl_after_finished,
        backoff_limit=args.backoff_limit,
    )


def write_atomic(path: str, text: str) -> None:
    """Writes ``text`` to ``path``, creating its directory (never a partial file, mode 0600)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    core_write_atomic(path, text, perms=0o600)  # 0600 as mkstemp made it: a job may hold secrets


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``render-job`` subcommand."""
    p = sub.add_parser("render-job", help="print the PyTorchJob or TrainJob YAML for a job",
                       description="Builds and validates (CRD schema, webhook rules, Pod "
                       "schema) the PyTorchJob or TrainJob that `kfp-nvrx launch --backend "
                       "kubernetes` would create, and prints it as YAML for `kubectl apply -f -`.")
    add_job_arguments(p)
    p.add_argument("--job-api", choices=job_apis.names(), default=job_apis.RENDER_JOB_API,
                   help=f"pytorchjob (Training Operator v1) or trainjob (Kubeflow Trainer v2); "
                   f"default {job_apis.RENDER_JOB_API}: render-job asks no cluster, so it cannot "
                   "answer auto")
    p.add_argument("--with-runtime", action="store_true",
                   help="trainjob: also print the runtime it refers to (first), e.g. to apply a "
                   "ClusterTrainingRuntime")
    p.add_argument("--out", default="", help="write the YAML to FILE instead of stdout")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from kfp_nvrx.components.errors import UserError

    if args.out and os.path.isdir(args.out):
        raise UserError("--out", f"{args.out} is a directory; give a file name such as "
                        f"{os.path.join(args.out, 'job.yaml')}")
    if args.out:
        check_output(args.out, "--out")
    if args.with_runtime and args.job_api != "trainjob":
        raise UserError("--with-runtime", "only a TrainJob refers to a runtime; add "
                        "--job-api trainjob")
    from kfp_nvrx.components.launch.backends import check
    from kfp_nvrx.components.launch.options import KubernetesOptions

    opts = KubernetesOptions(job_api=args.job_api, runtime=args.runtime,
                             runtime_kind=args.runtime_kind)
    rendered = job_apis.get(args.job_api).render(check(spec_from_args(args), opts), opts)
    text = rendered.to_yaml(with_runtime=args.with_runtime)
    if args.out:
        write_atomic(args.out, text)
        sys.stderr.write(f"wrote {args.out}\n")
    else:
        sys.stdout.write(text)
    return 0
