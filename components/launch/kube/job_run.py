"""One launcher run of a Kubernetes training job, whatever its job API.

What the launcher does with a job is the same on every job API and lives here: create it or
re-attach to this run's job, follow it (:mod:`.follow`) to ``Succeeded``/``Failed``, the
launcher's deadline or a stop signal while :class:`~.logs.PodLogFollower` streams the pods, name
the failing replica, and delete the job when ``delete_after`` says so. A job API supplies the
calls on its job object and the readings of it (a :class:`~.followed.FollowedJob`).
"""

from __future__ import annotations

import posixpath
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kubernetes import client as k8s

from kfp_nvrx.components.core.exits import GAVE_UP, exit_meaning
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.kube.calls import ClusterError
from kfp_nvrx.components.launch.kube.follow import Follow
from kfp_nvrx.components.launch.kube.followed import FollowedJob, Resource
from kfp_nvrx.components.launch.kube.http import STOP_BUDGET_S, StopSignals, stop_left
from kfp_nvrx.components.launch.kube.kueue import KueueReads
from kfp_nvrx.components.launch.kube.logs import PodLogFollower
from kfp_nvrx.components.launch.kube.missing import missing_error
from kfp_nvrx.components.launch.kube.queue_follow import QueueWatch
from kfp_nvrx.components.launch.kube.run_dir_claim import LauncherClaim
from kfp_nvrx.components.launch.kube.run_dir_claim import claim as claim_run_dir
from kfp_nvrx.components.launch.options import FollowOptions
from kfp_nvrx.components.launch.result import LaunchResult, account_run_dir

if TYPE_CHECKING:
    from kfp_nvrx.components.launch.job_api import Rendered

#: Seconds the launcher waits for a deleted job and its pods to be gone (after a stop signal,
#: at most what is left of :data:`.http.STOP_BUDGET_S`, below KFP's 30 s termination grace).
DELETE_WAIT_S = 20.0
#: Attempts at the delete call itself (a job must not be left behind by one dropped connection).
DELETE_ATTEMPTS = 3


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
    if pod.exit_code is None:  # its verdict came first; its pod is still stopping its agent
        result.reason += f" ({pod.replica}: {pod.verdict.split(GAVE_UP, 1)[1].strip()})"
        result.last_log_lines = follower.last_lines(pod, lines)
        return
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
        job_kinds: The custom resources of every job API (:func:`.job_apis.resources`), where
            the job holding a claim on the run dir is looked for (:mod:`.run_dir_claim`).

    Raises:
        UserError: ``delete_after`` is not one of :data:`.options.DELETE_AFTER`.

    """

    def __init__(self, opts: FollowOptions | None, log: Callable[[str], None],
                 job_kinds: Callable[[], list[Resource]]) -> None:
        self.opts = (opts or FollowOptions()).checked()
        self.job_kinds = job_kinds
        self._log = log
        self._lock = threading.Lock()
        self.claim: LauncherClaim | None = None  # this launcher's claim on the run dir

    def say(self, line: str) -> None:
        """Log one line (called from the log streams' threads too)."""
        with self._lock:
            self._log(line)

    def run(self, jobs: FollowedJob, rendered: Rendered, client: Any) -> LaunchResult:
        """Create or re-attach to the job, follow it to its end, clean up.

        Args:
            jobs: The calls on the job and the readings of it.
            rendered: The job to create when none exists (its resolved job: run id, run dir,
                PVC and mount, queue, deadline).
            client: The bounded ``ApiClient`` (pods, logs and Kueue's objects are read with it).

        Returns:
            The result: ``Succeeded``, ``Failed``, ``DeadlineExceeded`` or ``Cancelled``.

        """
        job = rendered.resolved
        follower = PodLogFollower(k8s.CoreV1Api(client), job.namespace, jobs.pods, emit=self.say,
                                  watch_timeout_s=self.opts.watch_timeout_s)
        # A queued job's LocalQueue and priority class are checked before it is created.
        queue = None if job.queue is None else KueueReads(client, job.namespace, job.queue,
                                                          self.say)
        with StopSignals(self.opts.handle_signals) as signals:
            try:
                found, attached = self._attach_or_create(jobs, rendered, queue, client)
            except BaseException:
                self._end_claim("not created")
                raise
            follower.start()
            try:
                result = Follow(jobs, found, self.opts, self.say, follower,
                                self._queue_watch(queue, jobs, found, follower)).run(signals)
            except BaseException:
                self._end_claim("")
                raise
            finally:
                follower.stop(drain_s=0.0 if signals.event.is_set() else self.opts.drain_s)
            self._end_claim(result.state)
        if "missing" in result.extra:  # bad input: the job we made can never start
            self._delete(jobs)
            raise missing_error(result.extra["missing"], jobs.namespace, job, self.opts.missing_s)
        self._account(result, jobs, follower, attached)
        if should_delete(result.state, self.opts.delete_after):
            unfinished = self._delete(jobs)
            if unfinished:  # FT: exit 143 still comes within the stop's budget, saying what
                result.reason += (f"; not finished within the {STOP_BUDGET_S:g} s a stopped "
                                  f"launcher has: {unfinished}")
        return result

    def _end_claim(self, state: str) -> None:
        """Stops renewing this launcher's run-dir claim; released once the job has ended.

        A stopped or still running job keeps it: its pods hold it (and release it at their
        final exit); a job that was never created holds nothing.
        """
        if self.claim is not None:
            self.claim.end(job_ended=state in ("Succeeded", "Failed", "not created"))

    def _queue_watch(self, queue: KueueReads | None, jobs: FollowedJob, found: dict[str, Any],
                     follower: PodLogFollower) -> QueueWatch | None:
        """Kueue's hold on the job while it is followed (None: it names no queue)."""
        if queue is None:
            return None
        return QueueWatch(queue, jobs.where, jobs.created_at(found), self.say,
                          step=lambda: follower.progress.step, on_preempted=follower.set_aside,
                          started=follower.progress.last_start,
                          stopped=lambda: follower.progress.stopped_at)

    def _account(self, result: LaunchResult, jobs: FollowedJob, follower: PodLogFollower,
                 attached: bool) -> None:
        """The failing replica, pod restarts, the run's own accounting and where it lies."""
        job, pod = jobs.job, jobs.job.worker()
        fill_failure(result, follower, self.opts.tail_lines)
        result.pod_restarts = follower.pod_restarts()
        result.extra["pod_restarts_whole"] = follower.pod_restarts_whole()
        # FT: restarts by layer, goodput, recovery: the trainer's events (when the volume is here)
        account_run_dir(result, job.run_dir, lambda msg: self.say(f"warning: {msg}"))
        result.extra.update(attached=attached, namespace=jobs.namespace, pvc=pod.pvc,
                            run_dir_uri=f"pvc://{pod.pvc}/"
                            f"{posixpath.relpath(job.run_dir, pod.mount)}",
                            progress=follower.progress.summary())

    def _delete(self, jobs: FollowedJob) -> str | None:
        """Delete the job (retrying a failed call) and wait a while for it to be gone.

        After a stop signal all of it, retries and wait included, ends within what is left of
        :data:`.http.STOP_BUDGET_S` (its calls are cut there too, :mod:`.http`).

        Returns:
            After a stop signal, what did not finish in time (None: the job is gone).

        Raises:
            ClusterError: Without a stop signal, when every delete call failed.
        """
        for attempt in range(DELETE_ATTEMPTS):
            try:
                jobs.delete()
                break
            except ClusterError as err:
                left = stop_left()
                if left is not None and (attempt + 1 == DELETE_ATTEMPTS or left < 1.0 + attempt):
                    return f"deleting {jobs.where}: {err}"
                if attempt + 1 == DELETE_ATTEMPTS:
                    raise
                self.say(f"warning: {err} (retrying)")
                time.sleep(1.0 + attempt)
        left = stop_left()
        deadline = time.monotonic() + (DELETE_WAIT_S if left is None else min(DELETE_WAIT_S, left))
        while True:
            try:
                gone = jobs.gone()
            except ClusterError:
                gone = False
            if gone:
                self.say(f"deleted {jobs.where} and its pods "
                         f"(propagationPolicy={jobs.propagation})")
                return None
            if time.monotonic() > deadline:
                self.say(f"deleting {jobs.where} (propagationPolicy={jobs.propagation}): "
                         "still in progress, its pods are stopping")
                return None if left is None else f"the wait for {jobs.where} to be gone " \
                    "(the delete was sent; its pods were still stopping)"
            time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))

    def _attach_or_create(self, jobs: FollowedJob, rendered: Rendered,
                          queue: KueueReads | None, client: Any) -> tuple[dict[str, Any], bool]:
        """Return (job, attached): the existing job of this run, or a newly created one.

        A job to create that names a queue has its LocalQueue and priority class checked first;
        its run dir is claimed for it where this launcher sees the volume (:mod:`.run_dir_claim`:
        a run dir another job writes is refused before anything is created).
        """
        run_id = rendered.resolved.run_id
        for _ in range(3):
            existing = self._existing(jobs)
            if existing is not None:
                owner = jobs.run_owner(existing)
                if run_id and owner == run_id:
                    self.say(f"re-attaching to {jobs.where} (run {owner})")
                    return existing, True
                raise naming.name_taken(jobs.where, owner, run_id)
            if queue is not None:
                queue.check()
            if self.claim is None:
                self.claim = claim_run_dir(rendered.run_dir, jobs.namespace, jobs.name, client,
                                           self.say, self.job_kinds)
            if jobs.create(rendered.to_dict()):
                self.say(f"created {jobs.where}: {rendered.describe()}")
                created = self._read_created(jobs)
                if created is not None:
                    if self.claim is not None:
                        self.claim.keep()
                    return created, False
        raise ClusterError(f"{jobs.where} could not be created or read")

    def _existing(self, jobs: FollowedJob) -> dict[str, Any] | None:
        """The job of that name, once it is not being deleted (None: there is none)."""
        existing = jobs.get()
        if existing is None or not jobs.being_deleted(existing):
            return existing
        self.say(f"{jobs.where} is being deleted; waiting for it to go")
        for _ in range(120):
            time.sleep(1.0)
            if jobs.get() is None:
                break
        return jobs.get()

    def _read_created(self, jobs: FollowedJob) -> dict[str, Any] | None:
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
