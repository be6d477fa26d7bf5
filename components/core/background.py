"""Background work yields the CPU to the training loop on a GPU host.

The checkpoint's background work (pinning the staging banks, sealing snapshots, the durable
write in NVRx's writer process, the copies to peer nodes, the commit's file work) runs beside a
loop whose one thread launches the GPU's work: a step slows when that thread waits for a core.
A lower CPU priority makes the background work wait instead, and changes nothing while cores are
free. On CPU training the loop's own compute takes every core, and a lowered writer would only
starve, so there nothing changes. Torch-free: the writer process and the trainer's threads both
call it.
"""

from __future__ import annotations

import os
import sys
import threading

#: The nice value background threads take on a GPU host (the loop's stays as it was started).
BACKGROUND_NICE = 10
#: Set by the trainer on a GPU host and inherited by NVRx's writer process: the nice value
#: :func:`yield_to_loop` gives the calling thread. Unset: nothing is lowered.
NICE_ENV = "KFP_NVRX_BACKGROUND_NICE"


def lower_background_work(nice: int = BACKGROUND_NICE) -> None:
    """From now on, this process's background threads (and processes it starts) yield to the loop."""
    os.environ[NICE_ENV] = str(nice)


def yield_to_loop() -> None:
    """Lowers the calling thread's CPU priority to the :data:`NICE_ENV` value (never raises it).

    On Linux a nice value belongs to one thread, and threads it starts inherit it. Elsewhere it
    would lower the whole process, the loop included, so nothing is changed there.
    """
    try:
        nice = int(os.environ.get(NICE_ENV, "0"))
    except ValueError:
        return
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:  # a sandbox that forbids it: the work runs at the loop's priority
        pass
