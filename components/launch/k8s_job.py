"""One launcher run of a Kubernetes training job, whatever its API (PyTorchJob or TrainJob).

The two job backends (:mod:`.kubernetes`, :mod:`.trainjob`) differ in how they call the API server
and read a job object; what they do with a job is the same and lives here: create it or re-attach
to this run's job, follow it to ``Succeeded``/``Failed``, the launcher's deadline or a stop signal
while :class:`~.logs.PodLogFollower` streams the pods, name the failing replica, and delete the job
when ``delete_after`` says so. A backend supplies a :class:`JobAPI` for one named job.
"""

from __future__ import annotations

import posixpath
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from kfp_nvrx.components.core.pod_entry import exit_meaning
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
from kfp_nvrx.components.launch.jobspec.spec import DELETE_AFTER
from kfp_nvrx.components.launch.k8s_api import ClusterError, hints
from kfp_nvrx.components.launch.k8s_follow import DEADLINE_MARGIN_S, Follow
from kfp_nvrx.components.launch.k8s_http import StopSignals
from kfp_nvrx.components.launch.kueue import KueueReads
from kfp_nvrx.components.launch.logs import PodLogFollower
from kfp_nvrx.components.launch.missing import MISSING_S, missing_error
from kfp_nvrx.components.launch.queue_follow import QueueWatch
from kfp_nvrx.components.launch.result import LaunchResult, account_run_dir

#: Seconds the launcher waits for a deleted job and its pods to be gone;
#: below KFP's 30 s termination grace, so a cancelled step still exits on its own.
DELETE_WAIT_S = 20.0
#: Attempts at the delete call itself (a job must not be left behind by one dropped connection).
DELETE_ATTEMPTS = 3

__all__ = ["DEADLINE_MARGIN_S", "ClusterError", "JobAPI", "JobRun", "K8sOptions", "Outcome",
           "StopSignals", "hints"]


@dataclass
class K8sOptions:
    """How to follow a job.

    Attributes:
        namespace: Namespace of the job ('' = the client's default namespace).
        deadline_s: Seconds after the job's creation before the launcher gives up (None:
            ``activeDeadlineSeconds`` + :data:`DEADLINE_MARGIN_S`, or no limit).
        delete_after: ``always`` | ``on_success`` | ``never``: delete the job when it ends.
        poll_s: Seconds between job status reads.
        progress_s: Seconds between progress lines (0: on every change).
        tail_lines: Log lines of the failing replica kept in the result.
        watch_timeout_s: Length of one pod watch request.
        handle_signals: Install SIGTERM/SIGINT handlers (main thread only) that delete the job.
        drain_s: Seconds open log streams may run on after the end (last lines of the pods).
        no_controller_s: Seconds without any job status before the launcher asks whether the
            job's controller runs (a CRD installed without its controller).
        missing_s: Seconds the pods may wait for a PVC or Secret that does not exist before
            the launch fails (:mod:`.missing`).

    """

    namespace: str = ""
    deadline_s: float | None = None
    delete_after: str = "on_success"
    poll_s: float = 5.0
    progress_s: float = 30.0
    tail_lines: int = 40
    watch_timeout_s: int = 30
    handle_signals: bool = True
    drain_s: float = 5.0
    no_controller_s: float = 120.0
    missing_s: float = MISSING_S


class Outcome(NamedTuple):
    """A job's final condition: ``Succeeded``/``Failed``, the reason, when (0.0: unknown)."""

    state: str
    reason: str
    finished_at: float


def failure_reason(reason: str | None, message: str | None) -> str:
    """``<reason>: <message>`` of a Failed condition, without empty parts."""
    return f"{reason or 'Failed'}: {message or ''}".strip(": ")


class JobAPI(Protocol):
    """The API calls on one named job and the readings of the job object its API returns."""

    kind: str
    name: str
    namespace: str
    where: str

    def get(self) -> Any | None:
        """Read the job; None when it does not exist. Raises :class:`ClusterError`."""

    def create(self, body: Any) -> bool:
        """Create the job; False when one with this name appeared meanwhile (HTTP 409)."""

    #: The deletion's ``propagationPolicy``.
    propagation: str

    def delete(self) -> None:
        """Delete the job and, through the garbage collector, what its controller made."""

    def gone(self) -> bool:
        """True once the job and the pods of it are gone."""

    def created_at(self, job: Any) -> float:
        """Unix time of the job's creation (0.0: unknown)."""

    def being_deleted(self, job: Any) -> bool:
        """True when the job has a deletion timestamp."""

    def run_owner(self, job: Any) -> str:
        """The KFP run id the job was created for ('' when none)."""

    def state(self, job: Any) -> str:
        """The state to report while following (``Pending``, ``Running``, ...)."""

    def outcome(self, job: Any) -> Outcome | None:
        """The final condition, None while the job runs."""

    def blocked(self, job: Any) -> Outcome | None:
        """A failure the controller only reports in Events (the job never gets a condition)."""

    def creation_warnings(self) -> list[str]:
        """Why the job's pods could not be created (quota, admission), from Warning Events."""

    #: Who should have set the job's status ("the Training Operator").
    controller: str

    def has_status(self, job: Any) -> bool:
        """Whether a controller has written the job's status."""

    def suspended(self, job: Any) -> bool:
        """Whether the job's spec suspends it (Kueue holds a job it has not admitted so)."""

    def uid(self, job: Any) -> str:
        """The job's uid (its Kueue Workload carries it as a label)."""


def should_delete(state: str, delete_after: str) -> bool:
    """Apply ``delete_after``; a cancelled run always deletes (it must not leave GPUs busy)."""
    if state == "Cancelled":
        return True
    if delete_after == "never":
        return False
    # on_success also deletes a job the launcher stopped following at its deadline: nobody would
    # be watching it any more. A Failed job is kept for inspection (until its TTL).
    return delete_after == "always" or state in ("Succeeded", "DeadlineExceeded")


def fill_failure(result: LaunchResult, follower: PodLogFollower, lines: int) -> None:
    """Name the replica whose exit decided the failure and attach that pod's last lines."""
    if result.succeeded or result.state == "Cancelled":
        return
    pod = follower.failed_pod()
    if pod is None:
        return
    result.extra["failed_replica"] = pod.replica
    meaning = exit_meaning(pod.exit_code)
    result.reason += f" ({pod.replica} exited with code {pod.exit_code}" + (
        f", {pod.exit_reason}" if pod.exit_reason else "") + (
        f": {meaning})" if meaning else ")")
    # That instance's own lines: a PyTorchJob pod recreated under its name has lines of its own.
    result.last_log_lines = follower.last_lines(pod, lines)


class JobRun:
    """One launcher run of one job: options checked, log lines serialised across threads.

    Args:
        opts: How to follow the job (None: defaults).
        log: Sink for log lines and progress; :attr:`say` calls it one line at a time.

    Raises:
        UserError: ``delete_after`` is not one of :data:`DELETE_AFTER`.

    """

    def __init__(self, opts: K8sOptions | None, log: Callable[[str], None]) -> None:
        self.opts = opts or K8sOptions()
        if self.opts.delete_after not in DELETE_AFTER:
            raise UserError("delete_after", f"must be one of {', '.join(DELETE_AFTER)}, "
                            f"got {self.opts.delete_after!r}")
        self._log = log
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        """Log one line (called from the log streams' threads too)."""
        with self._lock:
            self._log(line)

    def run(self, jobs: JobAPI, body: Any, job: ResolvedJob, follower: PodLogFollower, *,
            describe: str, active_deadline_s: float | None,
            extra: dict[str, Any] | None = None,
            queue: KueueReads | None = None) -> LaunchResult:
        """Create or re-attach to the job, follow it to its end, clean up.

        Args:
            jobs: The API calls on the job.
            body: The rendered job to create when none exists.
            job: The resolved job (run id, run directory, PVC and mount).
            follower: The pods' log streams (not started yet); its ``emit`` should be :meth:`say`.
            describe: What was created, for the log line (nodes, processes, run dir).
            active_deadline_s: The job's ``activeDeadlineSeconds`` (None: no deadline).
            extra: Backend-specific entries for ``result.extra``.
            queue: The reads of the job's Kueue objects (None: the job names no queue); its
                LocalQueue and priority class are checked before the job is created.

        Returns:
            The result: ``Succeeded``, ``Failed``, ``DeadlineExceeded`` or ``Cancelled``.

        """
        with StopSignals(self.opts.handle_signals) as signals:
            found, attached = self._attach_or_create(jobs, body, job.run_id, describe, queue)
            follower.start()
            watch = None if queue is None else QueueWatch(
                queue, jobs.where, jobs.created_at(found), self.say,
                step=lambda: follower.progress.step, on_preempted=follower.set_aside,
                started=follower.progress.last_start)
            try:
                result = Follow(jobs, found, job.run_dir, self.opts, self.say, follower,
                                watch).run(active_deadline_s, signals)
            finally:
                follower.stop(drain_s=0.0 if signals.event.is_set() else self.opts.drain_s)
        if "missing" in result.extra:  # bad input: the job we made can never start
            self._delete(jobs)
            raise missing_error(result.extra["missing"], jobs.namespace, job, self.opts.missing_s)
        fill_failure(result, follower, self.opts.tail_lines)
        result.pod_restarts = follower.pod_restarts()
        # FT: restarts by layer, goodput, recovery: the trainer's events (when the volume is here)
        account_run_dir(result, job.run_dir, lambda msg: self.say(f"warning: {msg}"))
        result.extra.update(attached=attached, namespace=jobs.namespace, pvc=job.pod.pvc,
                            **(extra or {}),
                            run_dir_uri=f"pvc://{job.pod.pvc}/"
                            f"{posixpath.relpath(job.run_dir, job.pod.mount)}",
                            progress=follower.progress.summary())
        if should_delete(result.state, self.opts.delete_after):
            self._delete(jobs)
        return result

    def _delete(self, jobs: JobAPI) -> None:
        """Delete the job (retrying a failed call) and wait a while for it to be gone."""
        for attempt in range(DELETE_ATTEMPTS):
            try:
                jobs.delete()
                break
            except ClusterError as err:
                if attempt + 1 == DELETE_ATTEMPTS:
                    raise
                self.say(f"warning: {err} (retrying)")
                time.sleep(1.0 + attempt)
        deadline = time.monotonic() + DELETE_WAIT_S
        while True:
            try:
                gone = jobs.gone()
            except ClusterError:
                gone = False
            if gone:
                self.say(f"deleted {jobs.where} and its pods "
                         f"(propagationPolicy={jobs.propagation})")
                return
            if time.monotonic() > deadline:
                self.say(f"deleting {jobs.where} (propagationPolicy={jobs.propagation}): "
                         "still in progress, its pods are stopping")
                return
            time.sleep(1.0)

    def _attach_or_create(self, jobs: JobAPI, body: Any, run_id: str, describe: str,
                          queue: KueueReads | None = None) -> tuple[Any, bool]:
        """Return (job, attached): the existing job of this run, or a newly created one.

        A job to create that names a queue has its LocalQueue and priority class checked first.
        """
        for _ in range(3):
            existing = jobs.get()
            if existing is not None and jobs.being_deleted(existing):
                self.say(f"{jobs.where} is being deleted; waiting for it to go")
                for _ in range(120):
                    time.sleep(1.0)
                    if jobs.get() is None:
                        break
                existing = jobs.get()
            if existing is not None:
                owner = jobs.run_owner(existing)
                if run_id and owner == run_id:
                    self.say(f"re-attaching to {jobs.where} (run {owner})")
                    return existing, True
                raise naming.name_taken(jobs.where, owner, run_id)
            if queue is not None:
                queue.check()
            if jobs.create(body):
                self.say(f"created {jobs.where}: {describe}")
                created = self._read_created(jobs)
                if created is not None:
                    return created, False
        raise ClusterError(f"{jobs.where} could not be created or read")

    def _read_created(self, jobs: JobAPI) -> Any | None:
        """The job just created; a launcher that cannot read it deletes it before it exits."""
        try:
            return jobs.get()
        except ClusterError as err:
            self.say(f"warning: {err}; deleting {jobs.where}, which this launcher created")
            try:
                self._delete(jobs)
            except ClusterError as also:
                self.say(f"warning: {also}")
            raise
