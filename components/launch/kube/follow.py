"""The polling loop of one followed Kubernetes job (:meth:`.job_run.JobRun.run` calls it).

Each pass reads the job once and decides, in this order: a stop signal cancels; a job deleted by
someone else fails; a final condition ends the follow; the launcher's deadline passes; an object
the pods need stays missing; otherwise it explains why there are no pods yet and prints progress.
A job Kueue holds (:mod:`.queue_follow`) is queued, not pending: its waits are said once each and
do not count against the deadline. Reads that fail are retried until the API server has failed
:data:`MAX_READ_ERRORS` times over at least :data:`MIN_OUTAGE_S`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from kfp_nvrx.components.launch.kube.calls import ClusterError
from kfp_nvrx.components.launch.kube.followed import FollowedJob
from kfp_nvrx.components.launch.kube.http import StopSignals
from kfp_nvrx.components.launch.kube.logs import PodLogFollower
from kfp_nvrx.components.launch.kube.missing import MissingWatch
from kfp_nvrx.components.launch.kube.queue_follow import QueueWatch
from kfp_nvrx.components.launch.kube.queue_record import QueueRecord
from kfp_nvrx.components.launch.options import FollowOptions
from kfp_nvrx.components.launch.result import LaunchResult, RestartsSoFar

#: Extra time past ``activeDeadlineSeconds`` before the launcher itself gives up, so the
#: operator's own deadline (with its reason) normally ends the job first.
DEADLINE_MARGIN_S = 600.0
#: Consecutive failed status reads before the launcher stops retrying, and the least time they
#: must span: an API server restart (tens of seconds) must not end a run polled every 0.5 s.
MAX_READ_ERRORS = 10
MIN_OUTAGE_S = 120.0
#: Least seconds between two reads of the events that say why no pod could be created.
EVENTS_EVERY_S = 10.0
#: The state a job Kueue holds is reported in (its own lines say the rest).
QUEUED = "Queued"
#: After a pod's exit the job's controllers decide its end within seconds (a final exit fails
#: the job, another restarts it): read every :data:`SOON_S` for :data:`SOON_FOR_S`, not every
#: poll interval (issue 38 item 7: up to 5 s of a give-up's end were the launcher's poll).
SOON_S, SOON_FOR_S = 1.0, 20.0


class Follow:
    """One follow of one job, from its first read to its end.

    Args:
        jobs: The API calls on the job (its resolved job: the run directory, whose restarts so
            far the progress line shows, and its active deadline).
        job: The job as last read.
        opts: How to follow.
        say: Sink for lines.
        follower: The pods' log streams.
        watch: Kueue's hold on the job (None: not queued).
    """

    def __init__(self, jobs: FollowedJob, job: dict[str, Any], opts: FollowOptions,
                 say: Callable[[str], None], follower: PodLogFollower,
                 watch: QueueWatch | None) -> None:
        run_dir = jobs.job.run_dir
        self.jobs, self.job, self.opts, self.say = jobs, job, opts, say
        self.follower, self.watch = follower, watch
        self.created = jobs.created_at(job) or time.time()
        self.result = LaunchResult(name=jobs.name, backend="kubernetes", state="Running",
                                   run_dir=run_dir, started_at=self.created)
        self.restarts = RestartsSoFar(run_dir)
        self.record = QueueRecord(run_dir, say)  # the waits, where `kfp-nvrx goodput` reads
        self.missing = MissingWatch(jobs.namespace, opts.missing_s, say)
        self.last_state, self.last_summary, self.last_progress = "", "", 0.0
        self.errors, self.failing_since, self.last_error = 0, 0.0, ""
        self.next_events, self.warned = time.monotonic() + 1.0, set[str]()
        self.soon_until = 0.0  # reads come every SOON_S until then (a pod exited)

    def deadline_s(self, active_deadline_s: float | None) -> float | None:
        """The launcher's deadline: given, or the job's active deadline plus a margin."""
        if self.opts.deadline_s is None and active_deadline_s:
            return active_deadline_s + DEADLINE_MARGIN_S
        return self.opts.deadline_s

    def run(self, signals: StopSignals) -> LaunchResult:
        """Poll the job until it ends, the deadline passes or a signal arrives."""
        deadline_s = self.deadline_s(self.jobs.job.worker().active_deadline_s)
        result = self.result
        while not self._stopped(signals):
            current = self._read()
            if current is None:
                result.state = "Failed"
                result.reason = f"the {self.jobs.kind} was deleted by someone else"
                break
            self.job = current
            if self.watch is not None:
                self.watch.observe(self.jobs.suspended(current), self.jobs.uid(current))
                self.record.write((p.start, p.end, p.after, p.reason) for p in self.watch.periods)
            self._report_state()
            if self._ended(deadline_s):
                break
            self._explain()
            self._pause(signals)
        result.finished_at = result.finished_at or time.time()
        if self.watch is not None:
            self.watch.say_preempted(now=True)  # the end came before the trainer's stop line
            result.queued_s = round(self.watch.queued_s(result.finished_at), 1)
            result.preemptions = len(self.watch.preemptions)
            queue = result.extra["queue"] = self.watch.summary(result.finished_at)
            # FT: a wait still going on at the end is written as ending now (a relaunch of the
            # run counts it as far as this launcher saw it)
            queue["recorded"] = self.record.write(
                (w["start"], w["end"], w["after"], w["reason"]) for w in queue["waits"])
        return result

    def _pause(self, signals: StopSignals) -> None:
        """Until the next read: the poll interval, less while a pod's exit is recent.

        A stop signal ends it at once; so does a pod's exit seen meanwhile.
        """
        now = time.monotonic()
        if self.follower.exited.is_set():
            self.follower.exited.clear()
            self.soon_until = now + SOON_FOR_S
        wait = min(self.opts.poll_s, SOON_S) if now < self.soon_until else self.opts.poll_s
        end = now + wait
        while not signals.event.wait(max(0.0, min(SOON_S, end - time.monotonic()))):
            if time.monotonic() >= end or self.follower.exited.is_set():
                return

    def _stopped(self, signals: StopSignals) -> bool:
        if not signals.event.is_set():
            return False
        name = signal.Signals(signals.signum).name if signals.signum else "signal"
        self.say(f"{name} received: deleting {self.jobs.where}")
        self.result.state, self.result.reason = "Cancelled", f"launcher received {name}"
        self.result.extra["signal"] = signals.signum
        return True

    def _read(self) -> dict[str, Any] | None:
        """The job now; the last reading while the API server fails (until it fails too long)."""
        try:
            current = self.jobs.get()
            if self.errors:
                self.say(f"{self.jobs.where}: the API server answers again")
            self.errors, self.last_error = 0, ""
            return current
        except ClusterError as err:
            self.errors += 1
            self.failing_since = self.failing_since if self.errors > 1 else time.monotonic()
            if (self.errors >= MAX_READ_ERRORS
                    and time.monotonic() - self.failing_since >= MIN_OUTAGE_S):
                raise
            if str(err) != self.last_error:  # once per distinct error, not every poll
                self.say(f"warning: {err} (retrying)")
                self.last_error = str(err)
            return self.job

    def _report_state(self) -> None:
        held = self.watch is not None and self.watch.holding
        state = QUEUED if held else self.jobs.state(self.job)
        if state != self.last_state:
            if state != QUEUED:  # a queued job's own lines say where and why
                self.say(f"{self.jobs.kind} {self.jobs.name}: {state}")
            self.last_state = state
            if state == "Running" and "time_to_running_s" not in self.result.extra:
                self.result.extra["time_to_running_s"] = round(time.time() - self.created, 1)

    def _ended(self, deadline_s: float | None) -> bool:
        """A final condition, the deadline (queued time not counted) or a missing object."""
        result = self.result
        outcome = self.jobs.outcome(self.job) or self.jobs.blocked(self.job)
        if outcome is not None:
            result.state, result.reason = outcome.state, outcome.reason
            result.finished_at = outcome.finished_at or time.time()
            return True
        queued = self.watch.queued_s() if self.watch is not None else 0.0
        if deadline_s is not None and time.time() - self.created - queued > deadline_s:
            result.state = "DeadlineExceeded"
            result.reason = (f"launcher deadline of {deadline_s:g}s after job creation passed"
                             + (f" (not counting {queued:.0f}s queued)" if queued else ""))
            return True
        blocker = self.missing.check(self.follower.missing(), time.monotonic())
        if blocker is not None:
            result.state, result.reason = "Failed", f"the pods need {blocker}, which is missing"
            result.extra["missing"] = blocker
            return True
        return False

    def _explain(self) -> None:
        """Why no pod (every :data:`EVENTS_EVERY_S`, not while queued), and the progress line."""
        now, opts = time.monotonic(), self.opts
        held = self.watch is not None and self.watch.holding
        if not self.follower.pods and not held and now >= self.next_events:
            self.next_events = now + EVENTS_EVERY_S
            for line in self._why_no_pods():
                if line not in self.warned:
                    self.warned.add(line)
                    self.say(line)
        if now - self.last_progress >= opts.progress_s:
            summary = self.follower.progress.summary(so_far := self._restarts_so_far())
            if (self.follower.progress.step or so_far) and summary != self.last_summary:
                self.say(f"progress: {summary}, pod restarts {self.follower.pod_restarts()}")
                self.last_summary, self.last_progress = summary, now

    def _restarts_so_far(self) -> int | None:
        """The events' restarts so far, less each re-admission's, as goodput counts them.

        A preemption is no restart, but the re-admitted pods' trainer writes a ``restart``.
        """
        so_far = self.restarts.count()
        if so_far is None or self.watch is None:
            return so_far
        resumed = sum(1 for p in self.watch.preemptions if "resumed_from" in p)
        return max(0, so_far - resumed)

    def _why_no_pods(self) -> list[str]:
        """Why the job has no pod: a controller's refused pods (quota, admission), or no status.

        Warnings, not failures: quota frees up, a controller may yet start.
        """
        jobs = self.jobs
        try:
            lines = [f"warning: pods cannot be created: {m}" for m in jobs.creation_warnings()]
        except ClusterError:
            lines = []  # only an explanation: the status reads report the API's trouble
        if not jobs.has_status(self.job) and time.time() - self.created > self.opts.no_controller_s:
            lines.append(f"warning: {jobs.where} has no status {self.opts.no_controller_s:g}s "
                         f"after its creation: is {jobs.controller} running?")
        return lines
