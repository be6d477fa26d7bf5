"""Following a job Kueue holds: waiting is not failing.

Kueue keeps a queued job suspended (``spec.suspend`` of a TrainJob, ``runPolicy.suspend`` of a
PyTorchJob) until its ClusterQueue has quota, then admits it; a higher-priority workload (or a
stopped queue) can evict it again, which suspends it again and deletes its pods, and it waits for
quota once more. :class:`QueueWatch` turns those transitions into one line each:

* ``queued: TrainJob ns/x waits in LocalQueue q (ClusterQueue cq): <why, from the Workload>``,
  once per wait, once the Workload says why (or after :data:`NO_WORKLOAD_S` without one);
* ``admitted by ClusterQueue cq after 12 s queued``;
* ``preempted at step 40 (Preempted: ...): queued again in LocalQueue q (ClusterQueue cq)``;
* ``re-admitted by ClusterQueue cq after 30 s queued (preempted at step 40)``.

It keeps every wait as a period (server times where the Workload has them: the job's creation,
the ``Admitted`` and ``Evicted`` conditions' transitions; the launcher's clock otherwise), so the
result counts queued time apart from running time (``LaunchResult.queued_s``,
``extra["queue"]``), and the launcher's deadline counts only the time the job was not held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kfp_nvrx.components.launch.kube.kueue import KueueReads, Reading

#: Seconds a queued job may have no Workload before the launcher says so (Kueue not running,
#: a WorkloadPriorityClass the launcher could not check).
NO_WORKLOAD_S = 60.0
#: Seconds a preemption's line waits for the trainer's stop line (the step it saved: the stop
#: save gets resilience.stop_save_timeout, 60 s by default); said with the last logged step then.
STOP_LINE_WAIT_S = 90.0


@dataclass
class Period:
    """One wait: from ``start`` to ``end`` (0.0 while it lasts); ``after`` says what began it."""

    start: float
    end: float = 0.0
    after: str = "creation"  # or "preemption"
    reason: str = ""

    def seconds(self, now: float) -> float:
        """Its length so far."""
        return max(0.0, (self.end or now) - self.start)


@dataclass
class QueueWatch:
    """Kueue's hold on one job, observed once per status read.

    Args:
        reads: The job's Kueue reads (its LocalQueue is known once checked).
        where: ``TrainJob ns/name``.
        created: Server time of the job's creation (the first wait starts there).
        say: Sink for the lines.
        step: The trainer's step as the logs last showed it (0: none yet).
        on_preempted: Called when the job is evicted after it ran (the pods go).
        started: (start lines the trainer printed, the step the last resumed from): a
            re-admitted job is said to resume once a new one shows.
        stopped: The step the trainer last said it stopped at (None: none said): where a
            preempted job stopped, which its last logged step (``step``) is not.
    """

    reads: KueueReads
    where: str
    created: float
    say: Callable[[str], None]
    step: Callable[[], int] = lambda: 0
    on_preempted: Callable[[], None] = lambda: None
    started: Callable[[], tuple[int, str]] = lambda: (0, "")
    stopped: Callable[[], int | None] = lambda: None
    periods: list[Period] = field(default_factory=list)
    preemptions: list[dict[str, Any]] = field(default_factory=list)
    holding: bool = False
    admitted_once: bool = False
    _said: bool = False
    _since: float = 0.0
    _resuming: int | None = None  # start lines seen at the re-admission, until one more shows
    # The trainer's last stop line when the job was last admitted: a later one is this
    # preemption's, even when it came before the eviction was seen (a quick stop save).
    _stops_seen: int | None = None
    _unsaid: tuple[str, float] | None = None  # a preemption's (why, monotonic time) not yet said

    def queued_s(self, now: float | None = None) -> float:
        """Seconds the job has waited for quota so far, all waits together."""
        now = time.time() if now is None else now
        return sum(p.seconds(now) for p in self.periods)

    def observe(self, suspended: bool, uid: str) -> None:
        """One status read of the job: ``suspended`` as its spec says now."""
        now = time.time()
        self._resumed()
        self.say_preempted()
        if suspended and not self.holding:
            self._hold(uid, now)
        elif suspended and not self._said:
            self._say_why(uid, now)
        elif not suspended and (self.holding or not self.admitted_once):
            self._admitted(uid, now)

    def _hold(self, uid: str, now: float) -> None:
        """The job is (again) held: its first wait, or a preemption of a job that ran."""
        self.holding, self._said, self._since = True, False, time.monotonic()
        if not self.admitted_once:
            self.periods.append(Period(self.created or now))
            self._say_why(uid, now)
            return
        reading = self.reads.workload(uid) or Reading()
        step = self.step()
        start = reading.evicted_at if reading.evicted_at and reading.evicted_at <= now else now
        self.periods.append(Period(start, after="preemption", reason=reading.evicted))
        self.preemptions.append({"at": start, "step": step, "reason": reading.evicted})
        self.on_preempted()
        # Said once the trainer said where it stopped: the eviction is seen as the pods are told
        # to stop, before they train and save their last step (issue 38 item 8).
        self._unsaid = (f" ({reading.evicted})" if reading.evicted else "", time.monotonic())
        self._said = True

    def say_preempted(self, now: bool = False) -> None:
        """Says the last preemption once the trainer's stop line came (``now``: at once).

        ``preempted at step 58 (Preempted: ...): queued again in LocalQueue q``: the step its
        trainer stopped at, or the last logged one when no stop line came within
        :data:`STOP_LINE_WAIT_S` (a stop that saves nothing says none).
        """
        if self._unsaid is None:
            return
        why, since = self._unsaid
        stopped = self.stopped()
        if not now and (stopped is None or stopped == self._stops_seen) \
                and time.monotonic() - since < STOP_LINE_WAIT_S:
            return
        self._unsaid = None
        self.say(f"preempted at step {self._stopped_at()}{why}: queued again in "
                 f"{self.reads.where}")

    def _say_why(self, uid: str, now: float) -> None:
        """Say once why the job waits, as soon as its Workload says it."""
        reading = self.reads.workload(uid)
        if reading is None:
            return  # not readable now: the next read tries again (the error was said)
        long = time.monotonic() - self._since > NO_WORKLOAD_S
        if reading.waiting or (long and reading.exists and not reading.admitted):
            why = reading.waiting or "Kueue has not admitted it yet"
            self.periods[-1].reason = self.periods[-1].reason or why
            self.say(f"queued: {self.where} waits in {self.reads.where}: {why}")
            self._said = True
        elif long and not reading.exists:
            self.say(f"queued: {self.where} is held, and Kueue has made no Workload for it in "
                     f"{NO_WORKLOAD_S:g} s: is Kueue running, does "
                     f"{self._priority() or 'its LocalQueue'} exist?")
            self._said = True

    def _priority(self) -> str:
        pc = self.reads.queue.priority_class
        return f"WorkloadPriorityClass {pc}" if pc else ""

    def _admitted(self, uid: str, now: float) -> None:
        """Kueue let the job run: the wait ends (the Workload's Admitted time when it has one)."""
        if not self.periods:  # admitted before the first read saw it held
            self.periods.append(Period(self.created or now))
        reading = self.reads.workload(uid) or Reading()
        period = self.periods[-1]
        admitted_at = reading.admitted_at
        period.end = admitted_at if period.start <= admitted_at <= now else now
        self.holding, again = False, self.admitted_once
        self.admitted_once = True
        where = f"ClusterQueue {self.reads.cluster_queue}" if self.reads.cluster_queue else "Kueue"
        waited = f"after {period.seconds(now):.0f} s queued"
        if again:
            self.say_preempted(now=True)
            at = self._stopped_at()
            self.say(f"re-admitted by {where} {waited} (preempted at step {at})")
            self._resuming = self.started()[0]
        else:
            self.say(f"admitted by {where} {waited}")
        self._stops_seen = self.stopped()

    def _resumed(self) -> None:
        """After a re-admission: the trainer's first start line says where it resumed."""
        if self._resuming is None or not self.preemptions:
            return
        starts, resumed_from = self.started()
        if starts > self._resuming:
            self._resuming = None
            last = self.preemptions[-1]
            last["resumed_from"] = resumed_from
            self.say(f"preempted at step {self._stopped_at()}, resumed from step {resumed_from} "
                     f"after {self.periods[-1].seconds(time.time()):.0f} s queued")

    def _stopped_at(self) -> int:
        """Where the last preemption stopped the job: the trainer's stop line since, if any.

        The eviction is seen when the pods are told to stop, before they have trained and saved
        their last step: the last logged step is behind it ("preempted at step 50, resumed from
        step 58"); the step is updated in the preemption's record too.
        """
        if not self.preemptions:
            return 0
        last = self.preemptions[-1]
        now = self.stopped()
        if now is not None and now != self._stops_seen:
            last["step"] = now
        return int(last["step"])

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """What ``result.extra["queue"]`` holds: the queue, every wait, every preemption."""
        now = time.time() if now is None else now
        q = self.reads.queue
        return {"local_queue": q.name, "cluster_queue": self.reads.cluster_queue,
                "priority_class": q.priority_class,
                "queued_s": round(self.queued_s(now), 1),
                "waits": [{"start": p.start, "end": p.end or now, "after": p.after,
                           "reason": p.reason, "seconds": round(p.seconds(now), 1)}
                          for p in self.periods],
                "preemptions": list(self.preemptions)}
