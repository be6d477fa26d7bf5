"""The result every launcher backend returns (local, PyTorchJob and TrainJob alike).

What happened inside the job (restarts by layer, goodput, recovery) is read from the run's
events, never from log lines, by one function for every backend (:func:`account`): the trainer
writes those events to the run directory, and the launcher reads them where it can reach that
directory (a local run; the KFP task, which mounts the shared volume at the workers' path). A
launcher that cannot (``kfp-nvrx launch`` on a laptop) leaves those fields None: unknown, not 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.bounded import open_regular
from kfp_nvrx.components.core.events import (
    IN_JOB,
    IN_PROCESS,
    POD,
    Event,
    Restart,
    parse_event,
    read_events,
)
from kfp_nvrx.components.core.goodput import GoodputReport, restarts_in_words, summarize_events
from kfp_nvrx.components.core.rundir import EVENTS_FILE
from kfp_nvrx.components.errors import UserError


@dataclass
class LaunchResult:
    """What happened to one training job.

    Attributes:
        name: Job name (the PyTorchJob's or TrainJob's, or the local run's).
        backend: ``kubernetes`` or ``local``.
        state: Final state: ``Succeeded``, ``Failed``, ``Cancelled`` or ``DeadlineExceeded``.
        reason: Operator/launcher reason for a non-success state ('' on success).
        run_dir: Where the run directory lives (a path on the shared volume).
        restarts: Restarts of every layer, from the events (None: the events were not readable).
        restarts_in_process: The wrapper re-entered the training function (same processes).
        restarts_in_job: ft_launcher restarted the workers inside their pods.
        restarts_pod: The pods were recreated (a JobSet restart; a fresh ft_launcher).
        goodput: Time inside kept steps / wall time, from the events.
        recovery_s: Seconds from each fault (or failure) to the next incarnation's first step.
        pod_restarts: What Kubernetes counted: container restarts plus pod recreations (0 for
            local). A cluster fact, not an event: a pod restarted before the trainer began
            shows here and in no layer above.
        queued_s: Seconds Kubernetes jobs waited in a Kueue queue for quota (every wait: before
            the first admission and after each preemption); part of the wall time, not running.
        preemptions: Times Kueue evicted the job after it had been admitted (it waited again).
        started_at: Unix time the job was created/started.
        finished_at: Unix time it reached its final state.
        last_log_lines: Tail of the failing replica's log (empty on success).
        summary: The whole goodput report of the events (None: not readable).
        extra: Details of the launch, not of the training: ``signal`` (that cancelled it),
            ``failed_replica``, the job API, namespace, agents' exit codes, ...
    """

    name: str
    backend: str
    state: str
    run_dir: str
    reason: str = ""
    restarts: int | None = None
    restarts_in_process: int | None = None
    restarts_in_job: int | None = None
    restarts_pod: int | None = None
    goodput: float | None = None
    recovery_s: list[float] | None = None
    pod_restarts: int = 0
    queued_s: float = 0.0
    preemptions: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    last_log_lines: list[str] = field(default_factory=list)
    summary: GoodputReport | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def succeeded(self) -> bool:
        """True when the job reached ``Succeeded``."""
        return self.state == "Succeeded"

    @property
    def duration_s(self) -> float:
        """Wall time from start to the final state."""
        return max(0.0, self.finished_at - self.started_at)

    def restarts_text(self) -> str:
        """``3 (in-job 2, in-process 0, pod 1)``, or why it is unknown and how to know it.

        Restarts whose ranks took state from peer copies (a lost node) are said after it.
        """
        if self.restarts is None or self.summary is None:
            return f"unknown ({self._unreadable_why()})"
        text = restarts_in_words(self.restarts, self.summary.restarts)
        peers = self.summary.restores.get("peer", 0)
        if peers:  # a lost node's ranks took their state from copies other nodes held
            text += (f", {peers} restored from peer copies "
                     f"({self.summary.peer_restore_bytes / 1e9:.2f} GB over the network)")
        return text

    def _mount(self) -> str | None:
        """Where the pods mount the run dir's volume, when the run dir is on a PVC (else None)."""
        uri = str(self.extra.get("run_dir_uri", ""))
        rel = uri.split("/", 3)[3] if uri.startswith("pvc://") and uri.count("/") >= 3 else ""
        if not rel or not self.run_dir.endswith(rel):
            return None
        return self.run_dir[:-len(rel)].rstrip("/") or "/"

    def _unreadable_why(self) -> str:
        """Why the run's events were not read here, in a few words (the summary line's)."""
        if self._mount() is None:
            return "the run's events are not readable from here"
        return f"PVC {self.extra.get('pvc', '')!r} is not mounted here"

    def restarts_hint(self) -> str:
        """One line on how to get the restart counts when they are unknown here ('' otherwise).

        Kept out of the summary line, which it made ~300 characters long (issue 38 item 8).
        """
        if self.restarts is not None and self.summary is not None:
            return ""
        mount = self._mount()
        if mount is None:
            return ""
        return (f"restart counts: mount PVC {self.extra.get('pvc', '')!r} here at {mount}, or "
                f"run `kfp-nvrx goodput --run-dir {self.run_dir}{self._queued_flag()}` where "
                "it is mounted")

    def _queued_flag(self) -> str:
        """`` --queued START-END,...``: the waits after a preemption that the run dir lacks.

        Only this launcher saw them: without them goodput would count the re-admission as a pod
        restart and the time queued as its recovery. A wait before the first admission ends
        before the run's first event (goodput keeps it out either way): not repeated here.
        """
        queue = self.extra.get("queue") or {}
        if queue.get("recorded"):
            return ""
        waits = [f"{float(w['start']):.1f}-{float(w['end']):.1f}"
                 for w in queue.get("waits") or [] if w.get("after") == "preemption"]
        return f" --queued {','.join(waits)}" if waits else ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        out = dataclasses.asdict(self)
        out["duration_s"] = self.duration_s
        return out


def account(result: LaunchResult, events: list[Event]) -> GoodputReport:
    """Fills the fields of ``result`` that come from the run's events; returns their report."""
    report = summarize_events(events, queued_periods(result))
    result.summary = report
    result.restarts = sum(report.restarts.values())
    result.restarts_in_process = report.restarts_of(IN_PROCESS)
    result.restarts_in_job = report.restarts_of(IN_JOB)
    result.restarts_pod = report.restarts_of(POD)
    result.goodput = report.goodput
    result.recovery_s = list(report.recovery_s)
    return report


def queued_periods(result: LaunchResult) -> list[tuple[float, float]]:
    """``(start, end)`` of every wait in a Kueue queue the launcher followed (none elsewhere)."""
    waits = (result.extra.get("queue") or {}).get("waits") or []
    return [(float(w["start"]), float(w["end"])) for w in waits
            if isinstance(w, dict) and w.get("start") is not None and w.get("end") is not None]


def account_run_dir(result: LaunchResult, run_dir: str | os.PathLike,
                    warn: Callable[[str], None] | None = None) -> GoodputReport | None:
    """:func:`account` from ``<run_dir>/events.jsonl``; None when it cannot be read here.

    A run directory that exists without events (the job failed before the trainer began) is
    known: no restart, no step. One that cannot be read (permissions, too large) is said in one
    ``warn`` line: the job's own outcome stands.
    """
    if not Path(run_dir).is_dir():
        return None
    try:
        events = read_events(run_dir, warn)
    except UserError as err:
        if warn is not None:
            warn(f"the run's events are not readable: {err.message}")
        return None
    return account(result, events)


class RestartsSoFar:
    """The restarts a running job's events hold so far, for its progress line.

    Each call reads only the whole lines appended since the last one, at most ``chunk`` bytes:
    a long run's events are never read again every poll. Lines that are no usable event are
    passed over here (the final :func:`account_run_dir` reports them).
    """

    def __init__(self, run_dir: str | os.PathLike, chunk: int = 8 << 20) -> None:
        self.run_dir, self.chunk = Path(run_dir), chunk
        self.offset = self.restarts = 0

    def count(self) -> int | None:
        """Restarts so far; None while the run dir is not here (a volume this side lacks)."""
        if not self.run_dir.is_dir():
            return None
        try:
            with os.fdopen(open_regular(self.run_dir / EVENTS_FILE, "run_dir"), "rb") as fh:
                fh.seek(self.offset)
                data = fh.read(self.chunk)
        except UserError:  # no events yet (or unreadable): nothing counted, the end will say
            return self.restarts
        end = data.rfind(b"\n") + 1  # a line still being written is read once it is whole
        if end == 0 and len(data) == self.chunk:
            end = len(data)  # a line longer than a chunk is no event: step over it
        self.offset += end
        for line in data[:end].splitlines():
            try:
                self.restarts += isinstance(parse_event(json.loads(line)), Restart)
            except (ValueError, RecursionError):
                continue
        return self.restarts
