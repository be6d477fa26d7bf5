"""``kfp-nvrx-ft-launcher``: NVRx's ``ft_launcher`` without the fixed waits of its restart path.

Every in-job restart under NVRx 0.7's ft_launcher sleeps twice for a full second whatever happens
(``docs/benchmarks/NOTES.md``, issue 37: 2.05 s of a 9.17 s restart at 1b):

* ``_stop_workers`` -> ``terminate_mp_processes`` SIGTERMs the failed workers' process groups,
  sleeps 1.0 s, then SIGKILLs them, even when the groups emptied at once (a killed worker's
  group is usually empty already).
* The restarted node then waits for the next rendezvous round (``_wait_for_rendezvous_open``):
  its first pass finds the round it trained in closed, syncs to the round the failure opened, and
  sleeps 1.0 s before it looks at that round.

This entry point runs the very same launcher (``launcher.main``, every flag and behaviour) with
two narrow replacements, applied only where the installed NVRx has exactly these functions:
the groups are SIGKILLed when the grace ends *or* as soon as they are gone, and the round is
synced once before the first wait instead of after it. NVRx releases without them (0.4.1's
launcher polls already) run unchanged. Both keep NVRx's own semantics; upstream fixes would make
them no-ops.

Runs in the trainer image as the agent (it imports torch through NVRx); nothing on the launcher
side imports it.
"""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from kfp_nvrx.components.core.launch_command import WARM_START_ENV
from kfp_nvrx.components.core.procfs import PGRP, STATE, stat_fields
from kfp_nvrx.components.training.trainer.handoff import ZYGOTE_ENV

#: NVRx's grace between SIGTERM and SIGKILL of leftover worker process groups (0.7: 1.0 s).
GROUP_GRACE_S = 1.0
#: How often the leftover groups are checked during that grace.
GROUP_POLL_S = 0.02
#: Seconds the agent waits for its zygote's imports before it starts workers cold instead.
ZYGOTE_READY_S = 120.0
#: Seconds the agent gives its zygote to kill its workers' groups and exit before SIGKILL.
ZYGOTE_STOP_S = 5.0


def live_groups(pgids: Iterable[int]) -> set[int]:
    """Those of ``pgids`` that still have a member that is not a zombie (one look at /proc).

    A zombie has released its memory and descriptors; the worker's own zombies are reaped by the
    agent, but an orphaned grandchild's (NVRx's checkpoint writer) only when init gets to it.
    """
    candidates = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):  # gone, or the id is someone else's now
            continue
        candidates.add(pgid)
    live: set[int] = set()
    if not candidates:
        return live
    for entry in os.scandir("/proc"):
        fields = stat_fields(entry.name) if entry.name.isdigit() else None
        if fields is not None and fields[STATE] != "Z" and int(fields[PGRP]) in candidates:
            live.add(int(fields[PGRP]))
    return live


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a member that is not a zombie."""
    return bool(live_groups([pgid]))


def terminate_groups(allowed_pgids: Iterable[int], grace_s: float = GROUP_GRACE_S,
                     poll_s: float = GROUP_POLL_S) -> None:
    """SIGTERM each process group, SIGKILL what is left once the grace ends or none is left.

    NVRx 0.7's ``terminate_mp_processes`` with the grace cut short when it has nothing to wait
    for. As there, group 1 is never signalled and errors are swallowed (best-effort cleanup).
    """
    pgids = list(allowed_pgids)
    if 1 in pgids:  # as NVRx: rank monitors with PGID 1 in simulated multi-node runs
        return
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while live_groups(pgids) and time.monotonic() < deadline:
        time.sleep(poll_s)
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


def synced_first(wait: Callable[..., Any]) -> Callable[..., Any]:
    """``wait`` (``_wait_for_rendezvous_open``) that first syncs the node to the newest round.

    The unpatched wait does this sync on its first pass too, but only after it found its old
    round closed, and then sleeps 1.0 s before it reads the round it synced to.
    """

    def wait_synced(self: Any, *args: Any, **kwargs: Any) -> Any:
        # FT: a restarted agent joins the round its failure opened without the 1 s poll.
        self._sync_from_per_round_state()
        return wait(self, *args, **kwargs)

    wait_synced.__wrapped__ = wait  # type: ignore[attr-defined]
    wait_synced.__doc__ = wait.__doc__
    return wait_synced


def _params(fn: object) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []


def patch_launcher(launcher: ModuleType, barrier: ModuleType | None) -> list[str]:
    """Applies the replacements that fit this NVRx; returns the names of those applied.

    Args:
        launcher: ``nvidia_resiliency_ext.fault_tolerance.launcher``.
        barrier: ``nvidia_resiliency_ext.fault_tolerance.ft_rendezvous_barrier`` (None where
            this NVRx has no barrier rendezvous).
    """
    applied = []
    # FT: 0.7 binds terminate_mp_processes(allowed_pgids) into the launcher's namespace and
    # calls it from _shutdown on every restart; 0.4.1's takes (allowed_ppids, allowed_pgids).
    if _params(getattr(launcher, "terminate_mp_processes", None)) == ["allowed_pgids"]:
        setattr(launcher, "terminate_mp_processes", terminate_groups)  # noqa: B010 - NVRx >= 0.7
        applied.append("terminate_mp_processes")
    state = getattr(barrier, "_RendezvousBarrierState", None)
    wait = getattr(state, "_wait_for_rendezvous_open", None)
    if (state is not None and wait is not None and not hasattr(wait, "__wrapped__")
            and callable(getattr(state, "_sync_from_per_round_state", None))
            and _params(wait)[:2] == ["self", "node_desc"]):
        state._wait_for_rendezvous_open = synced_first(wait)
        applied.append("_wait_for_rendezvous_open")
    return applied


class WarmStarts:
    """The agent's zygote (:mod:`.trainer.zygote`): its workers' starts skip the imports.

    Started, and waited for, before ft_launcher starts the first workers: the imports a cold
    worker would make are the zygote's instead, so every incarnation starts the same way. Its
    socket reaches every worker through the environment ft_launcher passes on. It dies with this
    process (``PR_SET_PDEATHSIG``, and :meth:`close` on a normal exit); a zygote that fails
    leaves cold starts, said in one line.
    """

    def __init__(self, ready_s: float = ZYGOTE_READY_S) -> None:
        self.dir = tempfile.mkdtemp(prefix="kfp-nvrx-zygote-")  # 0700: only we connect
        self.path = os.path.join(self.dir, "zygote.sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kfp_nvrx.components.training.trainer.zygote", self.path,
             str(os.getpid())], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + ready_s
        while (not os.path.exists(self.path) and self.proc.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.02)
        if os.path.exists(self.path):
            os.environ[ZYGOTE_ENV] = self.path
        else:
            code = self.proc.poll()
            why = f"it exited {code}" if code is not None else f"not ready in {ready_s:g} s"
            print(f"kfp-nvrx-ft-launcher: no warm process ({why}); workers start cold",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stops the zygote (and any worker it still has, helpers and all) and removes its socket.

        SIGTERM first: the zygote kills its workers' process groups before it exits (a SIGKILLed
        zygote's workers die by their death signal, leaving what they spawned into their groups).
        """
        os.environ.pop(ZYGOTE_ENV, None)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=ZYGOTE_STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def main() -> int:
    """Runs ``ft_launcher`` (same argv) with :func:`patch_launcher` applied.

    With a zygote for warm worker starts when the environment asks for one (``resilience.
    warm_start``).
    """
    from nvidia_resiliency_ext.fault_tolerance import launcher

    try:  # NVRx >= 0.6; 0.4.1 rendezvous differently and has neither wait
        from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier as barrier
    except ImportError:
        barrier = None
    applied = patch_launcher(launcher, barrier)
    if applied:
        print(f"kfp-nvrx-ft-launcher: restart path without NVRx's fixed waits "
              f"({', '.join(applied)})", file=sys.stderr, flush=True)
    sys.argv[0] = "ft_launcher"  # NVRx's own usage and log lines name it
    warm = WarmStarts() if os.environ.get(WARM_START_ENV) == "1" and "--help" not in sys.argv \
        else None
    try:
        return launcher.main()
    finally:
        if warm is not None:
            warm.close()


if __name__ == "__main__":
    sys.exit(main())
