"""Writing events: one line per event, appended with one ``write`` to a regular file."""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, TypeVar

from kfp_nvrx.components.core.events.schema import Event
from kfp_nvrx.components.core.rundir import EVENTS_FILE

_E = TypeVar("_E", bound=Event)


class EventLog:
    """Appends events; each line is written with one ``write`` call on an O_APPEND file.

    The file is opened with ``O_NOFOLLOW``: an ``events.jsonl`` that is a symbolic link (out of
    the run dir) is never written through. Numbers that are not finite (a diverged loss) are
    written as ``null``: ``NaN`` is no JSON, and every reader after us would choke on it.
    """

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.enabled = enabled

    def emit(self, event: _E) -> _E:
        """Writes one event (when enabled) and returns it."""
        if self.enabled:
            line = (json.dumps(_finite(event.to_dict()), separators=(",", ":")) + "\n").encode()
            # O_NONBLOCK: a FIFO without a reader in its place fails the open (ENXIO) instead of
            # blocking the rank forever; a FIFO with one, a device or a socket is refused below.
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(self.path, flags, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EEXIST, "not a regular file; events go only to a file",
                                  str(self.path))
                os.write(fd, line)
            finally:
                os.close(fd)
        return event


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (nested dicts and lists too)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
