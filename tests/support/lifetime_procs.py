"""Processes of a lifetime test: found by an environment marker, waited for, locks tried.

Every process a lifetime test starts carries ``TAG=<token>`` in its environment, so the test can
list (through ``/proc``, independently of the library's psutil scan) exactly what is left of it.
"""

from __future__ import annotations

import time
from pathlib import Path

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.local.lifetime import RunDirLock

TAG = "KFP_NVRX_LIFETIME_TEST"


def alive(token: str) -> list[int]:
    """Pids of the processes whose environment holds ``TAG=token`` (a plain read of /proc)."""
    needle = f"{TAG}={token}".encode()
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def wait_until(cond, timeout: float, what: str) -> None:
    """Poll ``cond`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def gone(token: str, timeout: float = 90) -> None:
    """Wait until no process marked with ``token`` is left."""
    wait_until(lambda: not alive(token), timeout, "every process of the run to exit")


def gone_and_unlocked(token: str, run_dir: Path, timeout: float = 90) -> None:
    """Wait until no process marked with ``token`` is left, then until ``run_dir``'s lock is free.

    The lock may outlast the marked processes by a moment: the fresh-clone CI of 275a4a7 found it
    held right after they were gone, once. Likely a SIGKILLed process whose /proc environ reads
    empty once its memory is torn down while its files (the lock) close later; a watchdog that
    releases the lock last does the same.
    """
    gone(token, timeout)
    wait_until(lambda: try_lock(run_dir), 30, "the run dir lock once every process exited")


def lock_free_only_once_all_are_gone(run_dir: Path, token: str, timeout: float) -> None:
    """Wait until no process of the run is left; never may the lock be free before that.

    The lock is tried *before* the processes are listed: a free lock means every holder was
    already dead, so a process still listed afterwards outlived the lock (no births here).
    """
    end = time.monotonic() + timeout
    while True:
        free = try_lock(run_dir)
        left = alive(token)
        assert not (free and left), f"run dir free while {left} still run"
        if not left:
            return
        assert time.monotonic() < end, f"{left} outlived the launcher"
        time.sleep(0.1)


def try_lock(path: Path) -> bool:
    """Whether the run dir lock of ``path`` is free (taken and released at once)."""
    try:
        RunDirLock(path).acquire().release()
        return True
    except UserError:
        return False


def dead(pid: int) -> bool:
    """Gone, or a zombie (its locks and files are released before it becomes one)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
