"""A full disk, said in one line: the trainer, the launcher's log stream and its failure reason.

A checkpoint write that runs out of space rarely says so: torch's archive writer reports
``[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`` (the errno is lost on
the way), NVRx's writer relays that, and the launcher's own log file then fails with ENOSPC too.
:func:`disk_full` recognises an exception or a log line as "the disk is full" (an ENOSPC/EDQUOT
errno anywhere in the chain, the kernel's message, or torch's torn-write message while the file
system is in fact out of space) and :func:`disk_full_line` says it the same way everywhere.
Imports no torch.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

#: The kernel's words for ENOSPC; the fault drills also look for them in the log.
NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_SAID = re.compile(r"No space left on device|Disk quota exceeded|\[Errno (28|122)\]")
#: What torch's stream writer says when a write came up short (the errno is not kept).
_TORN_WRITE = re.compile(r"unexpected pos \d+ vs \d+|PytorchStreamWriter failed writing")
#: Bytes free below which a torn write is taken for a full disk.
LOW_SPACE = 16 << 20


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes free for us on the file system of ``path`` (its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _says_full(text: str, where: str | os.PathLike[str] | None) -> bool:
    if _SAID.search(text):
        return True
    if where is not None and _TORN_WRITE.search(text):
        free = free_bytes(where)
        return free is not None and free < LOW_SPACE
    return False


def disk_full(err: BaseException | str, where: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``err`` (an exception, its causes, or a log line) means the disk is full.

    ``where`` is the folder being written (checkpoints): a torn write counts only when its file
    system is nearly out of space, so a torn write of another cause is not misreported.
    """
    if isinstance(err, str):
        return _says_full(err, where)
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _SPACE_ERRNOS:
            return True
        if _says_full(str(cur), where):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _size(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} bytes"


def disk_full_line(where: str | os.PathLike[str]) -> str:
    """The one line that reports a full disk at ``where`` and what to do."""
    free = free_bytes(where)
    left = f", {_size(free)} free" if free is not None else ""
    return (f"disk full: {NO_SPACE} writing {where}{left}; free space there (or lower "
            "checkpoint.keep): the run resumes from its newest committed checkpoint once there "
            "is room")
