"""``kfp-nvrx launch``: run a training job on a backend (``local`` or ``kubernetes``) and wait.

Kubernetes: creates the PyTorchJob or TrainJob (``--job-api``), or re-attaches to this run's
existing one, streams the worker logs with a replica prefix, prints progress, and on
SIGTERM/SIGINT deletes the job. Exit code 0 on Succeeded, 1 on Failed/DeadlineExceeded or a
cluster error, 130/143 when cancelled by a signal.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import TYPE_CHECKING

from kfp_nvrx.components.cli.commands.render_job import add_job_arguments, spec_from_args, write_atomic
from kfp_nvrx.components.core import argtypes
from kfp_nvrx.components.core.atomic import check_output
from kfp_nvrx.components.launch import job_apis
from kfp_nvrx.components.launch.kube.missing import MISSING_S
from kfp_nvrx.components.launch.options import DEFAULT_JOB_API

if TYPE_CHECKING:
    from kfp_nvrx.components.launch.options import Options
    from kfp_nvrx.components.launch.result import LaunchResult


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``launch`` subcommand."""
    p = sub.add_parser("launch", help="run a training job (local, PyTorchJob or TrainJob) and follow it",
                       description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("local", "kubernetes"), default="local",
                   help="local (default: ft_launcher agents on this machine) or kubernetes")
    add_job_arguments(p)
    p.add_argument("--job-api", choices=job_apis.choices(), default=DEFAULT_JOB_API,
                   help="kubernetes: pytorchjob (Training Operator v1), trainjob (Kubeflow "
                   "Trainer v2) or auto (ask the cluster; TrainJob when it serves both); "
                   f"default {DEFAULT_JOB_API}")
    f = p.add_argument_group("follow")
    f.add_argument("--deadline", type=argtypes.seconds, default=None,
                   help="give up after SECONDS (kubernetes: from job creation, not counting "
                   "time queued by Kueue; default: active deadline + 10 min)")
    f.add_argument("--delete-after", choices=("always", "on_success", "never"),
                   default="on_success", help="delete the PyTorchJob/TrainJob when it ends")
    f.add_argument("--poll-interval", type=float, default=5.0, help="seconds between reads")
    f.add_argument("--missing-grace", type=argtypes.seconds, default=MISSING_S,
                   metavar="SECONDS", help="kubernetes: a PVC or Secret the pods need may be "
                   "missing this long (it may be created meanwhile) before the job is deleted "
                   f"and the launch fails; default {MISSING_S:g}")
    f.add_argument("--kubeconfig", default="", help="kubeconfig file (default: $KUBECONFIG, "
                   "~/.kube/config, or in-cluster)")
    f.add_argument("--context", default="", help="kubeconfig context")
    f.add_argument("--result", default="", metavar="FILE", help="write the result as JSON")
    p.set_defaults(handler=_run)


def _options(args: argparse.Namespace) -> Options:
    """The backend's typed launch options from the flags (credentials come later)."""
    from kfp_nvrx.components.launch.options import FollowOptions, KubernetesOptions, LocalOptions

    if args.backend == "local":
        return LocalOptions(deadline_s=args.deadline)
    return KubernetesOptions(job_api=args.job_api, runtime=args.runtime,
                             runtime_kind=args.runtime_kind,
                             follow=FollowOptions(deadline_s=args.deadline,
                                                  delete_after=args.delete_after,
                                                  poll_s=args.poll_interval,
                                                  missing_s=args.missing_grace))


def _run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kfp_nvrx.components.launch.backends import check, launch
    from kfp_nvrx.components.launch.kube.calls import ClusterError
    from kfp_nvrx.components.launch.options import KubernetesOptions

    _check_flags(args)
    opts = _options(args)
    job = check(spec_from_args(args), opts)  # bad input is reported before credentials

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        if isinstance(opts, KubernetesOptions):  # --backend kubernetes
            from kfp_nvrx.components.launch.kube.cluster import load_cluster
            from kfp_nvrx.components.launch.kube.kubeconfig import exec_plugins_stopped

            # no kubeconfig exec plugin outlives the launcher, however it ends (a SIGTERM too)
            with exec_plugins_stopped():
                cluster = load_cluster(args.kubeconfig, args.context, "--kubeconfig")
                result = launch(job, replace(opts, cluster=cluster), log=log)
        else:
            result = launch(job, opts, log=log)
    except ClusterError as err:
        sys.stderr.write(f"kfp-nvrx launch: cluster error: {err}\n")
        return 1
    if args.result:  # reasons and log lines came from the cluster: redacted like the terminal
        from kfp_nvrx.components.redaction import redact

        write_atomic(args.result, redact(json.dumps(result.to_dict(), indent=2)) + "\n")
    return _report(result)


def _check_flags(args: argparse.Namespace) -> None:
    """The flags the launch options do not check themselves; ``--result`` can be written."""
    from kfp_nvrx.components.errors import UserError

    if args.deadline is not None and args.deadline <= 0:
        raise UserError("--deadline", f"must be > 0 seconds, got {args.deadline:g}")
    if args.poll_interval <= 0:
        raise UserError("--poll-interval", f"must be > 0 seconds, got {args.poll_interval:g}")
    if args.result:  # checked now: found unwritable after a whole training run, it cost the run
        check_output(args.result, "--result")


def _report(result: LaunchResult) -> int:
    """Prints the launch's summary line (and why it failed); returns the exit code."""
    queued = (f" ({result.queued_s:.0f}s of it queued by Kueue, preempted "
              f"{result.preemptions}x)" if "queue" in result.extra else "")
    # A re-attached launcher knows a PyTorchJob's pod recreations only from then on (a
    # TrainJob's JobSet keeps its own count, on its pods).
    since = (" since re-attaching" if result.extra.get("attached")
             and not result.extra.get("pod_restarts_whole") else "")
    print(f"{result.state}: {result.name} ({result.backend}) in {result.duration_s:.0f}s"
          f"{queued}, restarts {result.restarts_text()}, pod restarts {result.pod_restarts}"
          f"{since}, run dir {result.run_dir}", flush=True)
    if hint := result.restarts_hint():
        print(hint, flush=True)
    if result.succeeded:
        return 0
    sys.stderr.write(f"kfp-nvrx launch: {result.state}: {result.reason}\n")
    if result.last_log_lines:
        sys.stderr.write(f"last lines of {result.extra.get('failed_replica', 'the job')}:\n")
        for line in result.last_log_lines:
            sys.stderr.write(f"  {line}\n")
    if result.state == "Cancelled":
        return 128 + int(result.extra.get("signal", signal.SIGTERM))
    return 1
