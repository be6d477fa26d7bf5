"""``/proc/<pid>/stat``, read one way for every side (standard library only).

The fields after the command name, which may itself hold spaces and parentheses (hence the split
at the last ``)``): ``[0]`` the state (``Z`` a zombie), ``[1]`` the parent pid, ``[2]`` the process
group, ``[19]`` the start time in clock ticks since boot.
"""

from __future__ import annotations

#: A stat line is a few hundred bytes; never read more.
STAT_LIMIT = 4096
STATE, PPID, PGRP, STARTTIME = 0, 1, 2, 19


def stat_fields(pid: int | str = "self") -> list[str] | None:
    """The stat fields of ``pid`` after its command name; None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read(STAT_LIMIT).decode("ascii", "replace")
    except OSError:
        return None
    head, sep, tail = text.rpartition(")")
    fields = tail.split() if sep else []
    return fields if len(fields) > STARTTIME else None
