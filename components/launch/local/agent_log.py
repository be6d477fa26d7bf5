"""What the local launcher does with each line an agent prints: its log file and a full disk.

The full log (``<run_dir>/logs/node<i>.log``) usually lives on the disk that a checkpoint has just
filled. A failed write there must neither kill the thread that drains the agent's output (the
agent would block on a full pipe, and the thread died with a traceback) nor repeat: it is said
once and the stream goes on. A full disk is said in one line (:mod:`kfp_nvrx.components.core.disk`)
instead of torch's ``inline_container.cc ... unexpected pos`` and NVRx's relays of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

from kfp_nvrx.components.core.disk import disk_full, disk_full_line


class AgentLog:
    """An agent's log file that stops, saying so once, at the first failed open or write."""

    def __init__(self, path: Path, prefix: str, log: Callable[[str], None]) -> None:
        self.path, self.prefix, self.log = path, prefix, log
        self.fh: IO[str] | None = None
        self.broken = False
        try:  # O_NOFOLLOW: a node log that is a link (out of the run dir) is never written
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            self.fh = os.fdopen(fd, "a", buffering=1)
        except OSError as err:
            self._give_up(err)

    def _give_up(self, err: OSError) -> None:
        self.broken = True
        if self.fh is not None:
            try:
                self.fh.close()
            except OSError:
                pass  # the buffered tail could not be written either
            self.fh = None
        self.log(f"{self.prefix} cannot write {self.path} ({err.strerror or err}); its further "
                 "lines are not kept there")

    def write(self, line: str) -> None:
        """Appends one line (newline added); after a failure, nothing."""
        if self.fh is None:
            return
        try:
            self.fh.write(line + "\n")
        except OSError as err:
            self._give_up(err)

    def close(self) -> None:
        """Closes the file (a failure to flush is reported like a failed write)."""
        if self.fh is not None:
            try:
                self.fh.close()
            except OSError as err:
                self.fh = None
                self._give_up(err)
            self.fh = None


class DiskFullNotice:
    """Turns the many lines a full disk causes into one clear line per incarnation."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.line: str | None = None  # the last notice given (the launcher's failure reason)
        self._said = False

    def check(self, line: str) -> str | None:
        """The notice to print for ``line`` ('' when already said), or None: not about space."""
        if "[trainer] start:" in line:  # a new incarnation: a new full disk is news again
            self._said = False
            return None
        if not disk_full(line, self.where):
            return None
        if self._said:
            return ""
        self._said = True
        self.line = disk_full_line(self.where)
        return self.line

    def clean(self, lines: list[str]) -> list[str]:
        """``lines`` without the ones the notice stands for (torch's torn-write relays)."""
        if self.line is None:
            return lines
        return [ln for ln in lines if "disk full: " in ln or not disk_full(ln, self.where)]
