"""The node-local host copy: the staging buffers as files under ``/dev/shm`` that outlive a worker.

An in-job restart (ft_launcher starts new worker processes on the same node) would otherwise read
the whole state back from the run dir's file system (FSx for Lustre on a cluster: minutes for an
8B job). The staging buffers that every save is copied into already hold the newest committed
state in host memory; kept as files in a directory of their own, a restarted worker on the same
node maps them and loads from memory instead.

The mechanism, and what keeps it safe:

* **Owned.** ``/dev/shm/kfp-nvrx-<uid>/<run key>/``: both directories are created by us with mode
  0700 and used only when owned by this user and not writable by anyone else. Only our trainer
  writes there (the buffers of rank R are ``rank<R>.bank<i>``, its manifest ``rank<R>.json``).
* **Verified.** A rank publishes its manifest (atomically, tmp + rename) only after a save is
  committed, naming the bank, the layout, the step and the *identity* of the commit marker (the
  SHA-256 of ``COMMITTED``). A restarted worker uses a bank only when the manifest's step is the
  newest committed step, its identity equals that of the marker on disk, the run, rank and world
  size match and the layout is exactly the one the new state needs; otherwise it loads from disk.
  Staging into a bank first withdraws a manifest naming it, so a torn bank is never described.
* **Bounded.** At most two banks per local rank (the committed one and the one being staged), each
  the size of the rank's state, and only two when ``/dev/shm`` has room for both on every local
  rank; else one (a fault during a write then falls back to disk) or none (NVRx's staging).
* **Cleaned up.** A run that ends removes its files. A copy outlives its worker but not its
  ft_launcher agent: every worker start removes the directories of other runs whose agents are
  gone (a pod's ``/dev/shm`` goes with the pod anyway).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.bounded import JSON_LIMIT, read_bytes
from kfp_nvrx.components.core.host_copy import SHM_ROOT, host_copy_base, host_copy_dir
from kfp_nvrx.components.core.rundir import COMMIT_MARKER
from kfp_nvrx.components.errors import UserError

MANIFEST_VERSION = 1


class HostCopyUnavailable(RuntimeError):
    """The host copy directory cannot be used (missing, not ours, or open to others)."""


def marker_identity(step_path: Path) -> str | None:
    """SHA-256 of a checkpoint's commit marker (what a host copy must match); None when absent."""
    try:
        marker = read_bytes(step_path / COMMIT_MARKER, "checkpoint", JSON_LIMIT, "commit marker")
        return hashlib.sha256(marker).hexdigest()
    except UserError:
        return None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _recent(path: Path, seconds: float = 60.0) -> bool:
    try:
        return time.time() - path.stat().st_mtime < seconds
    except OSError:
        return False


def _private_dir(path: Path) -> None:
    """Creates ``path`` (0700) if needed; raises unless it is ours and closed to others."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
    except OSError as err:
        raise HostCopyUnavailable(f"{path}: {err}") from None
    if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise HostCopyUnavailable(f"{path} is not a private directory of this user "
                                  f"(uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})")


class HostCopyDir:
    """One rank's files in the node-local host copy directory of one run.

    Args:
        run_dir: The run directory (its absolute path keys the directory); None for a private,
            never reused directory (a staging buffer outside a run, e.g. tests and benchmarks).
        rank: Global rank (files are per rank).
        world_size: World size the copies are valid for.
        root: The shared-memory file system.
    """

    def __init__(self, run_dir: str | os.PathLike | None, rank: int, world_size: int,
                 root: Path = SHM_ROOT) -> None:
        self.root = Path(root)
        self.base = host_copy_base(self.root)
        self.run_dir = str(Path(run_dir).resolve()) if run_dir is not None else None
        self.persistent = run_dir is not None
        if self.persistent:
            self.path = host_copy_dir(self.run_dir, self.root)
        else:
            self.path = self.base / f"private-{os.getpid()}-{time.monotonic_ns()}"
        self.rank = rank
        self.world_size = world_size

    def ensure(self) -> None:
        """Creates the directories (0700) and records who owns this rank's files."""
        _private_dir(self.base)
        _private_dir(self.path)
        owner = {"run_dir": self.run_dir, "pid": os.getpid(), "agent_pid": os.getppid(),
                 "time": time.time()}
        self._write(self.path / f"rank{self.rank}.owner", json.dumps(owner).encode())

    def bank_path(self, index: int) -> Path:
        """The file of one staging bank of this rank."""
        return self.path / f"rank{self.rank}.bank{index}"

    @property
    def manifest_path(self) -> Path:
        """This rank's manifest: which bank holds which committed step."""
        return self.path / f"rank{self.rank}.json"

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        # tmpfs: rename is the atomicity needed (no fsync: the copy does not outlive the node).
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def publish(self, *, step: int, identity: str, bank: int, nbytes: int,
                slots: list[list[Any]], objects: dict[str, Any]) -> None:
        """Describes ``bank`` as holding committed ``step`` (after the commit, never before)."""
        if not self.persistent:
            return
        manifest = {"version": MANIFEST_VERSION, "run_dir": self.run_dir, "rank": self.rank,
                    "world_size": self.world_size, "step": step, "identity": identity,
                    "bank": bank, "nbytes": nbytes, "slots": slots,
                    "objects": base64.b64encode(pickle.dumps(objects)).decode(),
                    "pid": os.getpid(), "agent_pid": os.getppid(), "time": time.time()}
        self._write(self.manifest_path, json.dumps(manifest).encode())

    def withdraw(self) -> None:
        """Removes the manifest (before its bank is written again)."""
        with contextlib.suppress(FileNotFoundError):
            self.manifest_path.unlink()

    def manifest(self, step: int, identity: str | None) -> dict[str, Any] | None:
        """The manifest when it describes committed ``step`` of ``identity`` for this run/rank."""
        if not self.persistent or identity is None:
            return None
        try:
            st = self.path.lstat()
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                return None
            m = json.loads(read_bytes(self.manifest_path, "checkpoint", JSON_LIMIT, "manifest"))
        except (OSError, ValueError, UserError):
            return None
        want = {"version": MANIFEST_VERSION, "run_dir": self.run_dir, "rank": self.rank,
                "world_size": self.world_size, "step": step, "identity": identity}
        if not isinstance(m, dict) or any(m.get(k) != v for k, v in want.items()):
            return None
        bank = self.bank_path(int(m["bank"]))
        try:
            if bank.stat().st_size < int(m["nbytes"]):
                return None
        except OSError:
            return None
        m["objects"] = pickle.loads(base64.b64decode(m["objects"]))  # noqa: S301 - our own file
        return m

    def drop_banks(self, keep: set[int]) -> None:
        """Deletes this rank's bank files other than ``keep`` (an earlier worker's, unused)."""
        for p in self.path.glob(f"rank{self.rank}.bank*"):
            index = p.name.rsplit("bank", 1)[1]
            if not index.isdigit() or int(index) not in keep:
                with contextlib.suppress(OSError):
                    p.unlink()

    def remove_rank_files(self) -> None:
        """Deletes this rank's banks, manifest and owner record; the directory once empty."""
        for p in self.path.glob(f"rank{self.rank}.*"):
            with contextlib.suppress(OSError):
                p.unlink()
        with contextlib.suppress(OSError):
            self.path.rmdir()  # only when no other rank's files are left
        if not self.persistent:
            shutil.rmtree(self.path, ignore_errors=True)

    def sweep(self) -> list[Path]:
        """Removes other runs' directories whose every ft_launcher agent has exited.

        Returns:
            The directories removed.
        """
        removed = []
        try:
            dirs = [p for p in self.base.iterdir() if p.is_dir() and p != self.path]
        except OSError:
            return removed
        for d in dirs:
            agents = []
            for rec in d.glob("rank*.owner"):
                try:
                    owner = read_bytes(rec, "checkpoint", JSON_LIMIT, "owner record")
                    agents.append(int(json.loads(owner).get("agent_pid", 0)))
                except (OSError, ValueError, TypeError, UserError, AttributeError):
                    continue
            private_pid = d.name.split("-")[1] if d.name.startswith("private-") else None
            if private_pid is not None and private_pid.isdigit():
                agents.append(int(private_pid))
            if not agents and _recent(d):
                continue  # being set up by a worker that has not written its owner record yet
            if not any(_pid_alive(pid) for pid in agents):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        return removed
