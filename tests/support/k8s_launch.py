"""Helpers of the launcher tests against the API test double, for PyTorchJob and TrainJob alike.

A test plays the operator and kubelet in a thread (:func:`playing`) while the launcher under test
follows the job in the test's own thread (SIGTERM handlers can only be installed there).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.events import EventLog, Restart, Start
from kfp_nvrx.components.launch.backends import launch
from kfp_nvrx.components.launch.jobspec.resolve import resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.kube.cluster import Cluster
from kfp_nvrx.components.launch.options import FollowOptions, KubernetesOptions
from kfp_nvrx.components.launch.result import LaunchResult
from support.k8s_double import K8sDouble

RUN_ID = "run-0001"
SPEC = dict(image="img:1", pvc="fsx", instance_type="cpu", nodes="2", run_id=RUN_ID,
            task="train", overrides=["train.steps=6"])
#: A scenario: ``script(double, job_name)`` plays the cluster's side of one job.
Script = Callable[[K8sDouble, str], None]


def fast_opts(**kw: Any) -> FollowOptions:
    """Options that poll quickly and install no signal handlers unless asked to."""
    base = dict(poll_s=0.05, progress_s=0, watch_timeout_s=2, handle_signals=False, drain_s=0.5)
    return FollowOptions(**{**base, **kw})


def on_double(double: K8sDouble, job_api: str = "pytorchjob", namespace: str = "default",
              **follow: Any) -> KubernetesOptions:
    """Options that launch ``job_api`` on the double (``namespace``: a job's that names none)."""
    return KubernetesOptions(job_api=job_api, cluster=Cluster(double.configuration(), namespace),
                             follow=fast_opts(**follow))


def launch_on(double: K8sDouble, spec: JobSpec, job_api: str = "pytorchjob",
              log: Callable[[str], None] = print, **follow: Any) -> LaunchResult:
    """``spec`` resolved and launched on the double as ``job_api`` (``follow``: fast_opts')."""
    return launch(resolve(spec), on_double(double, job_api, **follow), log=log)


@contextmanager
def playing(double: K8sDouble, spec: JobSpec, script: Script) -> Iterator[None]:
    """Run ``script`` in a thread once the job of ``spec`` exists; join it when the block ends."""
    name = resolve(spec).name

    def play() -> None:
        double.wait_for_job(name)
        script(double, name)

    t = threading.Thread(target=play, daemon=True)
    t.start()
    try:
        yield
    finally:
        t.join(5)


def trainer_started(run_dir: Path | None, incarnation: int) -> None:
    """Write the events the trainer writes when an incarnation starts (a restart's when > 0).

    The double plays the pods; this plays the trainer's side on the shared volume, which the
    launcher reads for the restarts (None: a run dir the launcher cannot see, nothing written).
    """
    if run_dir is None:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    events = EventLog(run_dir)
    if incarnation:
        events.emit(Restart(kind="in-job", incarnation=incarnation))
    events.emit(Start(incarnation=incarnation, world_size=2, layer="in-job" if incarnation
                      else None))


def finish_later(pod: str, condition: str, after_s: float) -> Script:
    """A scenario: after ``after_s`` the pod logs its last step, exits 0, the job ends so."""

    def finish(d: K8sDouble, name: str) -> None:
        time.sleep(after_s)
        d.log(pod, "[trainer] done: step 6/6")
        d.terminate(pod, 0)
        d.set_condition(name, condition)

    return finish


def assert_untouched(double: K8sDouble) -> None:
    """The launcher neither created nor deleted a job."""
    assert not double.calls("POST") and not double.calls("DELETE")


def assert_reattached(result: LaunchResult, double: K8sDouble) -> None:
    """The launcher followed the existing job to success, creating and deleting nothing."""
    assert result.succeeded and result.extra["attached"] is True
    assert_untouched(double)


def assert_deleted_foreground(double: K8sDouble, policy: str = "Foreground") -> dict[str, Any]:
    """The launcher deleted the job once (pods first, unless ``policy`` says otherwise).

    Returns:
        The DELETE request.
    """
    deletes = double.calls("DELETE")
    assert len(deletes) == 1 and deletes[0]["body"]["propagationPolicy"] == policy
    return deletes[0]
