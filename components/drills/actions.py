"""What the drill itself does to a running job: kill a node, damage a checkpoint, fill the disk.

An action sees the launcher's PIDs (``on_start``), every log line (``on_line``) and the run's
events, polled by a watcher thread (``poll``; returns True once it is done). Actions that cause a
fault the trainer cannot log itself append a ``fault`` event to ``events.jsonl`` (kind
``kill-node`` / ``disk-full``), so recovery time is measured the same way for every scenario.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from kfp_nvrx.components.core.events import Checkpoint, Event, EventLog, Fault, Step, read_events
from kfp_nvrx.components.core.host_copy import host_copy_dir
from kfp_nvrx.components.core.ownership import claim_run_dir
from kfp_nvrx.components.core.volume_store import VolumeStore


class DrillSkipped(Exception):
    """The scenario cannot run on this machine (the reason says why)."""


class Action:
    """Base: does nothing. ``notes`` end up in the drill's report row."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.notes: list[str] = []
        self.done = False
        #: Commits this action saw on disk, as (time, step) (see measure.committed_steps_lost).
        self.commits_seen: list[tuple[float, int]] = []

    def setup(self) -> None:
        """Before the launch."""

    def on_start(self, pids: list[int]) -> None:
        """The agents' PIDs, node 0 first."""

    def on_line(self, line: str) -> None:
        """One launcher/trainer log line."""

    def poll(self, events: list[Event]) -> bool:
        """Called every 50 ms with the run's events; True when nothing is left to do."""
        return True

    def teardown(self) -> None:
        """After the run (always)."""

    def fault_event(self, kind: str, rank: int) -> None:
        """Records a fault the drill caused, at the last step the run logged."""
        steps = [e.step for e in read_events(self.run_dir) if isinstance(e, Step)]
        EventLog(self.run_dir).emit(Fault(kind=kind, step=steps[-1] if steps else 0, rank=rank))


def first_commit_passed(events: list[Event]) -> bool:
    """A checkpoint was committed and a later step finished."""
    commits = [e.step for e in events if isinstance(e, Checkpoint)]
    return bool(commits) and any(isinstance(e, Step) and e.step > commits[0] for e in events)


class KillNode(Action):
    """SIGKILLs the last node's process group (agent and workers) after the first commit."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self.pids: list[int] = []

    def on_start(self, pids: list[int]) -> None:  # noqa: D102
        self.pids = list(pids)

    def poll(self, events: list[Event]) -> bool:  # noqa: D102
        if not self.pids or not first_commit_passed(events):
            return False
        node = len(self.pids) - 1
        self.fault_event("kill-node", rank=node)
        os.killpg(self.pids[-1], signal.SIGKILL)
        self.notes.append(f"killed node{node} (agent pid {self.pids[-1]} and its workers)")
        return True


class DamageNewest(Action):
    """After the injected fault, damages the newest committed checkpoint before the restart."""

    def __init__(self, run_dir: Path, mode: str) -> None:
        super().__init__(run_dir)
        self.mode = mode  # "flip" or "truncate"
        self.damaged: int | None = None
        self.older: int | None = None  # the newest commit before it: where the restart must go
        self.fallback_logged = False

    def poll(self, events: list[Event]) -> bool:  # noqa: D102
        if not any(isinstance(e, Fault) for e in events):
            return False
        store = VolumeStore(self.run_dir)  # the drills damage the volume store's files
        steps = store.committed_steps()
        if not steps:
            self.notes.append("no committed checkpoint to damage")
            return True
        self.damaged, self.older = steps[0], steps[1] if len(steps) > 1 else None
        self.commits_seen.append((time.time(), steps[0]))
        target = max((f for f in store.files(steps[0]) if f.suffix == ".distcp"),
                     key=lambda p: p.stat().st_size)
        size = target.stat().st_size
        if self.mode == "truncate":
            os.truncate(target, size // 2)
        else:
            with open(target, "r+b") as fh:  # inside the tensor data: DCP alone loads it silently
                fh.seek(size // 10)
                data = fh.read(64)
                fh.seek(size // 10)
                fh.write(bytes(b ^ 0xFF for b in data))
        # A restart on the same node would load the newest commit from its host copy and never
        # read the damaged files; the drill is about the files, as on a replaced node: drop it.
        shutil.rmtree(host_copy_dir(self.run_dir), ignore_errors=True)
        self.notes.append(f"{self.mode} {target.name} of committed step {steps[0]}; "
                          "node-local host copy dropped")
        return True

    def on_line(self, line: str) -> None:  # noqa: D102
        if self.damaged is not None and f"checkpoint step {self.damaged} is damaged" in line:
            self.fallback_logged = True


class DiskFull(Action):
    """``<run_dir>/checkpoints`` on a small tmpfs whose free space runs out at the 2nd save.

    A ballast file leaves room for 1.5 checkpoints; once the trainer reports ENOSPC the drill
    deletes the ballast (an operator freeing space), and the job must recover on its own.
    """

    def __init__(self, run_dir: Path, ckpt_bytes: int) -> None:
        super().__init__(run_dir)
        self.ckpt_bytes = ckpt_bytes
        self.mount = VolumeStore(run_dir).root
        self.ballast = self.mount / "ballast"
        self.mounted = False
        self.enospc_seen = False
        self._lock = threading.Lock()

    def setup(self) -> None:  # noqa: D102
        # The drill's own new run dir, claimed as a launch would: with the mount point in it, it
        # is no longer empty, and launch-local takes only an empty folder or one of ours.
        claim_run_dir(self.run_dir)
        self.mount.mkdir(parents=True)
        size = 6 * self.ckpt_bytes
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "kfp-nvrx-drill",
                               str(self.mount)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise DrillSkipped(f"tmpfs mount not permitted here ({proc.stderr.strip()[:120]})")
        self.mounted = True
        free = shutil.disk_usage(self.mount).free
        with open(self.ballast, "wb") as fh:
            fh.truncate(0)
            fh.write(b"\0" * max(0, free - int(1.5 * self.ckpt_bytes)))
        self.notes.append(f"tmpfs of {size} bytes, {shutil.disk_usage(self.mount).free} free "
                          f"(one checkpoint: {self.ckpt_bytes} bytes)")

    def on_line(self, line: str) -> None:  # noqa: D102
        if "No space left on device" not in line:
            return
        with self._lock:
            if self.enospc_seen:
                return
            self.enospc_seen = True
        self.fault_event("disk-full", rank=-1)
        self.ballast.unlink(missing_ok=True)
        self.notes.append(f"trainer reported: {line.strip()[:160]}; ballast deleted")

    def teardown(self) -> None:
        """Unmounts the tmpfs, keeping its checkpoints in the run dir for inspection."""
        if not self.mounted:
            return
        self.ballast.unlink(missing_ok=True)
        keep = self.run_dir / ".checkpoints-from-tmpfs"
        shutil.copytree(self.mount, keep)
        for _ in range(20):
            if subprocess.run(["umount", str(self.mount)], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        else:
            subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
        self.mount.rmdir()
        keep.rename(self.mount)
        self.mounted = False


def make_action(name: str, run_dir: Path, ckpt_bytes: int) -> Action:
    """The action named by a scenario ('' = none)."""
    if name == "kill-node":
        return KillNode(run_dir)
    if name in ("flip-newest", "truncate-newest"):
        return DamageNewest(run_dir, name.split("-")[0])
    if name == "disk-full":
        return DiskFull(run_dir, ckpt_bytes)
    return Action(run_dir)


class Watcher:
    """Polls the run's events for an action in a thread until it is done or stopped."""

    def __init__(self, action: Action) -> None:
        self.action = action
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            if self.action.poll(read_events(self.action.run_dir)):
                self.action.done = True
                return
            self.stop.wait(0.05)

    def __enter__(self) -> Watcher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
