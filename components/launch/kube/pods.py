"""What the pod-log follower knows about each pod: its instances, how they ended, their lines.

:class:`PodState` is one pod name across its instances (a PyTorchJob pod the operator recreates
keeps its name; each instance has its own uid). :class:`Ended` is one instance: its exit and its
own last lines, so a failure report shows the lines of the pod that failed, not those of the pod
recreated in its place. :class:`Progress` is the step a progress line shows.
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s

from kfp_nvrx.components.core.exits import GAVE_UP


class Progress:
    """The step a live progress line shows, parsed from log lines (thread-safe).

    The trainer prints ``[trainer] step 120/1000 loss ...``: the total is in no event, and the
    line reaches a launcher that cannot read the run directory too. Only for the display.
    """

    STEP = re.compile(r"\bstep (\d+)/(\d+)\b")
    #: The trainer's line as an incarnation starts (``resumed_from=None`` on a fresh run).
    START = re.compile(r"\bstart: world_size=\d+ incarnation=\S+ resumed_from=(\w+)")
    #: The trainer's line when its node is stopped (a preemption): the step it stopped at.
    STOPPING = re.compile(r"\[trainer\] stopping at step (\d+)")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step = 0
        self.total = 0
        #: Start lines seen, and the step the last one resumed from ('None': from scratch).
        self.starts = 0
        self.resumed_from = ""
        #: The step the trainer last said it stopped at (None: no stop said yet).
        self.stopped_at: int | None = None

    def feed(self, line: str) -> bool:
        """Parse one line; return True when the step changed."""
        with self._lock:
            before = self.step
            if m := self.STEP.search(line):
                self.step, self.total = int(m[1]), int(m[2])
            elif m := self.START.search(line):
                self.starts, self.resumed_from = self.starts + 1, m[1]
            elif m := self.STOPPING.search(line):
                self.stopped_at = int(m[1])
            return self.step != before

    def last_start(self) -> tuple[int, str]:
        """(start lines seen, the step the last resumed from)."""
        with self._lock:
            return self.starts, self.resumed_from

    def summary(self, restarts: int | None = None) -> str:
        """Return e.g. ``step 120/1000 (12%), restarts 1`` (``restarts``: from the events)."""
        with self._lock:
            done = "no step yet"
            if self.total:
                done = f"step {self.step}/{self.total} ({100 * self.step // self.total}%)"
        return done + ("" if restarts is None else f", restarts {restarts}")


#: Log lines kept per pod instance for a failure report.
TAIL_KEPT = 200


@dataclass
class Ended:
    """How one pod instance (one uid) ended, and its own last lines."""

    name: str
    uid: str
    replica: str
    exit_code: int | None = None
    exit_reason: str = ""
    finished_at: float = 0.0
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_KEPT))

    @property
    def verdict(self) -> str:
        """The trainer's own final verdict among its lines (the job's budget spent...), or ''."""
        return next((line for line in reversed(self.tail) if GAVE_UP in line), "")

    @property
    def final(self) -> bool:
        """An exit no failure policy retries (1..127: ft_launcher gave up, bad input).

        Unlike a signal, a stop or a lost peer (>= 128), which the job's controller recreates.
        """
        return self.exit_code is not None and 0 < self.exit_code < 128


@dataclass
class PodState:
    """What the follower knows about one pod name (across its incarnations)."""

    name: str
    replica: str
    uids: list[str] = field(default_factory=list)
    phase: str = ""
    restart_count: int = 0
    exit_code: int | None = None
    exit_reason: str = ""
    finished_at: float = 0.0
    note: str = ""
    #: Each instance (uid) of the pod: its exit and its own lines (a recreated pod's are not
    #: the failed one's).
    instances: dict[str, Ended] = field(default_factory=dict)
    #: What it waits for that does not exist (``PersistentVolumeClaim fsx``): see missing_objects.
    waiting_on: list[str] = field(default_factory=list)

    @property
    def recreations(self) -> int:
        """How often the operator replaced this pod (new uid, same name)."""
        return max(0, len(self.uids) - 1)

    def instance(self, uid: str) -> Ended:
        """The record of instance ``uid`` (named as its log lines are prefixed)."""
        if uid not in self.instances:
            nth = self.uids.index(uid) if uid in self.uids else 0
            self.instances[uid] = Ended(self.name, uid, self.replica + (f"/p{nth}" if nth else ""))
        return self.instances[uid]


def pod_restarts(pods: Iterable[PodState], admission_of: Mapping[str, int],
                 restart_of: Mapping[str, int | None]) -> int:
    """Container restarts plus restarts of the job's pods: what goodput counts as ``pod``.

    A JobSet restart recreates every pod under new names (``node-0/a1``): one restart, as its
    rounds say in goodput, however many replicas (issue 38 item 8: two were counted), and its
    count is the job's own (``restart_of``: the pods' restart-attempt label), so a re-attached
    launcher knows the ones before it. Any other pod recreated in its replica's place (a
    PyTorchJob pod the operator recreates under its name) is one restart each, counted while
    followed. A replica's first pod of each Kueue admission (``admission_of``) is no recreation.
    """
    uids: dict[tuple[str, int | None], set[str]] = {}
    restarts = 0
    for p in pods:
        for u in p.uids:
            uids.setdefault((p.replica.split("/")[0], restart_of.get(u)), set()).add(u)
        restarts += p.restart_count
    jobwide = max((a for a in restart_of.values() if a is not None), default=0)
    return restarts + jobwide + sum(len(us) - len({admission_of.get(u, 0) for u in us})
                                    for us in uids.values())


def prefix(state: PodState, restart: int) -> str:
    """Return ``worker-1``, ``worker-1/r2`` (2nd container restart), ``worker-1/p1/r2`` (pod #2)."""
    pod = f"/p{len(state.uids) - 1}" if len(state.uids) > 1 else ""
    return state.replica + pod + (f"/r{restart}" if restart else "")


def container_status(pod: k8s.V1Pod, container: str) -> Any:
    """The status of ``container`` in ``pod`` (None before it has one)."""
    for status in (pod.status and pod.status.container_statuses) or []:
        if status.name == container:
            return status
    return None


#: What a pod waits for that only its user can create, as the scheduler and the kubelet say it:
#: (pattern, kind); the pattern's last group is the object's name.
_MISSING = (
    (re.compile(r'persistentvolumeclaim "([^"]+)" not found'), "PersistentVolumeClaim"),
    (re.compile(r'secret "([^"]+)" not found'), "Secret"),
    (re.compile(r"couldn't find key \S+ in Secret [^/\s]+/(\S+)"), "Secret"),
)


def missing_objects(pod: k8s.V1Pod, container: str) -> list[str]:
    """``Kind name`` of each object ``pod`` waits for and the cluster does not have.

    Read from the scheduler's ``PodScheduled`` condition (a claim that does not exist) and the
    container's waiting state (``CreateContainerConfigError``: a Secret or one of its keys).
    """
    texts = [c.message or "" for c in (pod.status and pod.status.conditions) or []
             if c.type == "PodScheduled" and c.status == "False"]
    status = container_status(pod, container)
    waiting = status is not None and status.state is not None and status.state.waiting
    if waiting and waiting.reason == "CreateContainerConfigError":
        texts.append(waiting.message or "")
    return sorted({f"{kind} {m.group(m.lastindex or 1)}" for text in texts
                   for pattern, kind in _MISSING for m in pattern.finditer(text)})
