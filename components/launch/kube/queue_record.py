"""The launcher's record of a job's waits in a queue, written where ``kfp-nvrx goodput`` reads.

The pods cannot see Kueue: from their events a preemption and its re-admission read like a pod
delete (a stop, then new pods), and the time queued like recovery. The launcher sees the waits
(:mod:`.queue_follow`), so it appends each one that has ended to the run's ``events.jsonl`` as a
``queued`` line (:class:`~kfp_nvrx.components.core.events.Queued`; what goodput makes of them:
:mod:`kfp_nvrx.components.core.queue_waits`). It does so only where the run dir is on its
machine (the KFP task mounts the volume) and once the trainer has begun the file: a launcher
never creates a run's files. Where it cannot, its own summary is the record, and the line that
sends the user to ``kfp-nvrx goodput`` carries the waits (``--queued``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from kfp_nvrx.components.core.events import EventLog, Queued
from kfp_nvrx.components.core.rundir import EVENTS_FILE

#: Characters of Kueue's reason kept in a line (its messages can be long).
REASON_CHARS = 200


class QueueRecord:
    """Writes each ended wait of one followed job into its run dir, once.

    Args:
        run_dir: The run directory as the launcher sees it (the pods' path).
        say: Sink for the one warning when the file cannot be written.
    """

    def __init__(self, run_dir: str | os.PathLike[str], say: Callable[[str], None]) -> None:
        self.run_dir = Path(run_dir)
        self.say = say
        self.written: set[tuple[float, float]] = set()
        self.failed = False

    def _events_begun(self) -> bool:
        """Whether the run's events file is here, a regular file (never followed if a link)."""
        try:
            return stat.S_ISREG(os.lstat(self.run_dir / EVENTS_FILE).st_mode)
        except OSError:
            return False

    def write(self, waits: Iterable[tuple[float, float, str, str]]) -> bool:
        """Appends every wait ``(start, end, after, reason)`` with an end not yet written.

        Returns:
            Whether every ended wait given is in the run dir now.
        """
        todo = [w for w in waits if w[1] > 0 and (w[0], w[1]) not in self.written]
        if not todo:
            return True
        if self.failed or not self._events_begun():
            return False
        log = EventLog(self.run_dir)
        for start, end, after, reason in todo:
            try:
                log.emit(Queued(start=start, end=end, after=after, reason=reason[:REASON_CHARS]))
            except OSError as err:
                self.failed = True
                self.say(f"warning: the job's waits in the queue cannot be recorded in "
                         f"{self.run_dir / EVENTS_FILE} ({err.strerror or err}); this "
                         "launcher's summary is their record")
                return False
            self.written.add((start, end))
        return True
