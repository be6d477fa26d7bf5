"""Following a job Kueue holds (issue 31.3), on a scripted job and clock: the lines, the queued
time, the deadline that does not count it, and a preemption followed to its resumption.

The same on the real controllers: tests/cluster/test_kueue.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from kfp_nvrx.components.launch.jobspec.queue import Queue
from kfp_nvrx.components.launch.kube import follow as k8s_follow
from kfp_nvrx.components.launch.kube import queue_follow
from kfp_nvrx.components.launch.kube.http import StopSignals
from kfp_nvrx.components.launch.kube.kueue import Reading, read_workload
from kfp_nvrx.components.launch.kube.queue_follow import QueueWatch
from kfp_nvrx.components.launch.options import FollowOptions

WAIT = "couldn't assign flavors to pod set node: insufficient unused quota for cpu"


class Clock:
    """time.time and time.monotonic of the modules under test: 10 s per job read."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    monotonic = time


@dataclass
class Reads:
    """A KueueReads stand-in: what the Workload says at each moment of the script."""

    clock: Clock
    script: list[tuple[float, Reading]]
    queue: Queue = field(default_factory=lambda: Queue("q", "low"))
    cluster_queue: str = "cq"

    @property
    def where(self) -> str:
        return f"LocalQueue {self.queue.name} (ClusterQueue {self.cluster_queue})"

    def workload(self, uid: str) -> Reading:
        return [r for t, r in self.script if t <= self.clock.now][-1]


class Jobs:
    """A JobAPI stand-in: ``suspended`` and ``done`` as functions of the clock."""

    kind, name, namespace, where = "TrainJob", "tj", "ns", "TrainJob ns/tj"
    controller = "the Trainer"
    #: The resolved job it follows: its run dir (no events there) and no active deadline.
    job = SimpleNamespace(run_dir="/nonexistent/run",
                          worker=lambda: SimpleNamespace(active_deadline_s=None))

    def __init__(self, clock: Clock, suspended, done=lambda t: False) -> None:
        self.clock, self._suspended, self._done = clock, suspended, done

    def get(self) -> dict:
        self.clock.now += 10.0
        return {"t": self.clock.now}

    def created_at(self, job) -> float:
        return 1000.0

    def suspended(self, job) -> bool:
        return self._suspended(job["t"])

    def uid(self, job) -> str:
        return "uid-1"

    def state(self, job) -> str:
        return "Suspended" if self.suspended(job) else "Running"

    def outcome(self, job):
        from kfp_nvrx.components.launch.kube.followed import Outcome

        return Outcome("Succeeded", "", job["t"]) if self._done(job["t"]) else None

    def blocked(self, job):
        return None

    def creation_warnings(self) -> list[str]:
        return []

    def has_status(self, job) -> bool:
        return True


class Follower:
    """The pod side: no pods; a step and the trainer's start lines as the script says."""

    def __init__(self, clock: Clock, steps=lambda t: 0, starts=lambda t: (0, ""),
                 stops=lambda t: None) -> None:
        self.clock, self._steps, self._starts, self._stops = clock, steps, starts, stops
        self.pods: dict = {}
        self.exited = threading.Event()  # no pod here ever exits
        self.set_asides = 0
        self.progress = self

    @property
    def step(self) -> int:
        return self._steps(self.clock.now)

    def summary(self, restarts=None) -> str:
        return f"step {self.step}" + ("" if restarts is None else f", restarts {restarts}")

    def last_start(self) -> tuple[int, str]:
        return self._starts(self.clock.now)

    @property
    def stopped_at(self) -> int | None:
        return self._stops(self.clock.now)

    def missing(self) -> list[str]:
        return []

    def pod_restarts(self) -> int:
        return 0

    def set_aside(self) -> None:
        self.set_asides += 1


@pytest.fixture()
def clock(monkeypatch) -> Clock:
    c = Clock()
    for module in (k8s_follow, queue_follow):
        monkeypatch.setattr(module.time, "time", c.time)
        monkeypatch.setattr(module.time, "monotonic", c.monotonic)
    return c


def _follow(clock, jobs, reads, follower, deadline_s=None):
    lines: list[str] = []
    watch = QueueWatch(reads, jobs.where, 1000.0, lines.append, step=lambda: follower.step,
                       on_preempted=follower.set_aside, started=follower.last_start,
                       stopped=lambda: follower.stopped_at)
    opts = FollowOptions(deadline_s=deadline_s, poll_s=0.0, progress_s=1e9)
    follow = k8s_follow.Follow(jobs, jobs.get(), opts, lines.append, follower, watch)
    with StopSignals(False) as signals:
        return follow.run(signals), lines


def test_queued_once_admitted_and_the_deadline_does_not_count_the_wait(clock) -> None:
    waiting = Reading(exists=True, waiting=WAIT)
    reads = Reads(clock, [(0, Reading()), (1015, waiting),
                          (1040, Reading(exists=True, admitted=True, cluster_queue="cq",
                                         admitted_at=1035.0))])
    jobs = Jobs(clock, suspended=lambda t: t < 1040)
    result, lines = _follow(clock, jobs, reads, Follower(clock), deadline_s=25)
    said = [line for line in lines if line.startswith("queued: ")]
    assert said == [f"queued: TrainJob ns/tj waits in LocalQueue q (ClusterQueue cq): {WAIT}"]
    assert "admitted by ClusterQueue cq after 35 s queued" in lines
    assert "TrainJob tj: Suspended" not in lines  # a queued job's own lines say it
    # 35 s queued (1000 -> 1035, the Workload's Admitted time), then 25 s of deadline: 1060 is
    # not past it, 1070 is; queued for longer than the deadline, it still ran.
    assert result.state == "DeadlineExceeded" and result.finished_at == 1070.0
    assert "not counting 35s queued" in result.reason
    assert result.queued_s == 35.0 and result.preemptions == 0
    assert result.extra["queue"]["waits"][0]["after"] == "creation"


def test_no_workload_for_a_minute_is_said_once(clock) -> None:
    reads = Reads(clock, [(0, Reading())])
    jobs = Jobs(clock, suspended=lambda t: True, done=lambda t: t >= 1100)
    result, lines = _follow(clock, jobs, reads, Follower(clock))
    said = [line for line in lines if line.startswith("queued: ")]
    assert len(said) == 1 and "no Workload" in said[0] and "WorkloadPriorityClass low" in said[0]
    assert result.queued_s == 100.0  # still held when it ended


def test_a_preemption_is_followed_to_the_resumed_step(clock) -> None:
    admitted = Reading(exists=True, admitted=True, cluster_queue="cq", admitted_at=1010.0)
    evicted = Reading(exists=True, evicted="Preempted: to accommodate a workload",
                      evicted_at=1045.0, admitted_at=1010.0)
    again = Reading(exists=True, admitted=True, cluster_queue="cq", admitted_at=1075.0)
    reads = Reads(clock, [(0, admitted), (1050, evicted), (1080, again)])
    jobs = Jobs(clock, suspended=lambda t: 1050 <= t < 1080, done=lambda t: t >= 1120)
    follower = Follower(clock, steps=lambda t: 40 if t >= 1030 else 0,
                        starts=lambda t: (2, "41") if t >= 1100 else (1, "None"))
    result, lines = _follow(clock, jobs, reads, follower)
    assert lines.count("admitted by ClusterQueue cq after 10 s queued") == 1
    assert ("preempted at step 40 (Preempted: to accommodate a workload): queued again in "
            "LocalQueue q (ClusterQueue cq)") in lines
    assert "re-admitted by ClusterQueue cq after 30 s queued (preempted at step 40)" in lines
    assert "preempted at step 40, resumed from step 41 after 30 s queued" in lines
    assert follower.set_asides == 1
    assert result.state == "Succeeded" and result.preemptions == 1
    assert result.queued_s == 40.0  # 1000 -> 1010, then 1045 -> 1075
    queue = result.extra["queue"]
    assert [w["after"] for w in queue["waits"]] == ["creation", "preemption"]
    assert queue["preemptions"][0] == {"at": 1045.0, "step": 40,
                                       "reason": "Preempted: to accommodate a workload",
                                       "resumed_from": "41"}


def test_a_workload_reads_as_kueue_writes_it() -> None:
    reading = read_workload({"status": {
        "admission": {"clusterQueue": "cq"},
        "conditions": [
            {"type": "QuotaReserved", "status": "False", "reason": "Pending",
             "message": "couldn't assign\n flavors", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "by x",
             "lastTransitionTime": "2026-01-01T00:00:05Z"},
            {"type": "Admitted", "status": "False", "lastTransitionTime": "2026-01-01T00:00:05Z"},
        ]}})
    assert reading.exists and not reading.admitted and reading.cluster_queue == "cq"
    assert reading.waiting == "couldn't assign flavors"
    assert reading.evicted == "Preempted: by x" and reading.evicted_at > 0
    assert read_workload(None) == Reading()


@pytest.mark.parametrize("stop_line_at", [1055.0, 1046.0])
def test_a_preempted_job_is_said_to_have_stopped_where_its_trainer_stopped(
        clock, stop_line_at: float) -> None:
    """Issue 38 item 8: "preempted at step 50, resumed from step 58": 50 was the last logged
    step when the eviction was seen; the pods then trained to 58, saved it and said so. Every
    line says 58, the first too (it waits for the trainer's stop line). At 1046 the stop line
    comes before the launcher's read sees the eviction (a stop save of 0.1 s): still 58."""
    admitted = Reading(exists=True, admitted=True, cluster_queue="cq", admitted_at=1010.0)
    evicted = Reading(exists=True, evicted="Preempted: to accommodate a workload",
                      evicted_at=1045.0, admitted_at=1010.0)
    again = Reading(exists=True, admitted=True, cluster_queue="cq", admitted_at=1075.0)
    reads = Reads(clock, [(0, admitted), (1050, evicted), (1080, again)])
    jobs = Jobs(clock, suspended=lambda t: 1050 <= t < 1080, done=lambda t: t >= 1120)
    follower = Follower(clock, steps=lambda t: 50 if t >= 1030 else 0,
                        starts=lambda t: (2, "58") if t >= 1100 else (1, "None"),
                        stops=lambda t: 58 if t >= stop_line_at else None)
    result, lines = _follow(clock, jobs, reads, follower)
    said = [line for line in lines if line.startswith("preempted at step ")]
    assert said[0] == ("preempted at step 58 (Preempted: to accommodate a workload): queued "
                       "again in LocalQueue q (ClusterQueue cq)"), lines
    assert "re-admitted by ClusterQueue cq after 30 s queued (preempted at step 58)" in lines
    assert "preempted at step 58, resumed from step 58 after 30 s queued" in lines
    assert result.extra["queue"]["preemptions"][0]["step"] == 58


def test_the_launcher_records_the_waits_where_goodput_reads_and_counts_no_restart(
        clock, tmp_path) -> None:
    """Issue 38 item 6: a launcher that sees the run dir writes each wait into its events once
    the trainer began them; goodput of that run dir then counts the re-admission as a
    preemption, not a pod restart, and neither does the launcher's progress line."""
    from types import SimpleNamespace

    from kfp_nvrx.components.core.events import EventLog, Queued, parse_events, read_events
    from kfp_nvrx.components.core.goodput import summarize

    admitted = Reading(exists=True, admitted=True, cluster_queue="cq", admitted_at=1010.0)
    evicted = Reading(exists=True, evicted="Preempted: to accommodate a workload",
                      evicted_at=1045.0, admitted_at=1010.0)
    again = Reading(exists=True, admitted=True, cluster_queue="cq", admitted_at=1075.0)
    reads = Reads(clock, [(0, admitted), (1050, evicted), (1080, again)])
    jobs = Jobs(clock, suspended=lambda t: 1050 <= t < 1080, done=lambda t: t >= 1120)
    jobs.job = SimpleNamespace(run_dir=str(tmp_path),
                               worker=lambda: SimpleNamespace(active_deadline_s=None))
    log = EventLog(tmp_path)
    ran = [{"type": "join", "time": 1011.0, "agent": "b/1/13/1", "node": 0, "nodes": 1,
            "rank": 0, "pid": 20, "run_id": "tj"},
           {"type": "start", "time": 1011.5, "pid": 20, "run_id": "tj", "agent": "b/1/13/1",
            "resumed_from": None},
           *({"type": "step", "time": 1013.0 + s, "step": s, "start": 1012.0 + s,
              "end": 1013.0 + s} for s in range(1, 30)),
           {"type": "end", "time": 1043.0, "step": 29, "status": "stopped"},
           {"type": "join", "time": 1081.0, "agent": "b/2/13/1", "node": 0, "nodes": 1,
            "rank": 0, "pid": 20, "run_id": "tj"},
           {"type": "start", "time": 1081.5, "incarnation": 1, "pid": 20, "run_id": "tj",
            "agent": "b/2/13/1", "resumed_from": 29, "layer": "pod"},
           {"type": "restart", "time": 1082.0, "kind": "pod", "incarnation": 1},
           *({"type": "step", "time": 1054.0 + s, "step": s, "start": 1053.0 + s,
              "end": 1054.0 + s, "incarnation": 1} for s in range(30, 40))]
    for event in parse_events(ran):
        log.emit(event)
    follower = Follower(clock, steps=lambda t: 29 if t >= 1030 else 0,
                        starts=lambda t: (2, "29") if t >= 1100 else (1, "None"),
                        stops=lambda t: 29 if t >= 1055 else None)
    lines: list[str] = []
    watch = QueueWatch(reads, jobs.where, 1000.0, lines.append, step=lambda: follower.step,
                       on_preempted=follower.set_aside, started=follower.last_start,
                       stopped=lambda: follower.stopped_at)
    opts = FollowOptions(poll_s=0.0, progress_s=0.0)
    with StopSignals(False) as signals:
        result = k8s_follow.Follow(jobs, jobs.get(), opts, lines.append, follower, watch).run(
            signals)
    assert result.extra["queue"]["recorded"] is True
    queued = [(e.start, e.end, e.after) for e in read_events(tmp_path) if isinstance(e, Queued)]
    assert queued == [(1000.0, 1010.0, "creation"), (1045.0, 1075.0, "preemption")]
    rep = summarize(tmp_path)
    assert rep.restarts == {} and rep.preemptions == 1 and rep.recovery_s == []
    progress = [line for line in lines if line.startswith("progress: ")]
    assert progress and progress[-1].startswith("progress: step 29, restarts 0"), progress
