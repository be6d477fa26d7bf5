"""The node-local host copy: staged snapshots as files under ``/dev/shm`` that outlive a worker.

Every save is first copied into a staging bank (:mod:`.staging`) in host memory. Kept as files in
a directory of their own, the banks let a restarted worker on the same node load the newest
snapshot that *every* rank staged, even one whose write to the volume is still in flight or was
cut by the fault, instead of the newest committed checkpoint on the file system (which lags the
newest save by a write: tens of seconds at 1b, minutes on FSx).

The mechanism, and what keeps it safe:

* **Owned.** ``/dev/shm/kfp-nvrx-<uid>/<run key>/``: both directories are created by us with mode
  0700 and nothing in them is listed, read, written or deleted, by any method, before both are
  proven real directories owned by this user and closed to everyone else (:meth:`HostCopyDir.
  private`); a link in their place is refused, never followed. Only our trainer writes there:
  rank R's banks are ``rank<R>.bank<i>``, each described by ``rank<R>.bank<i>.json``.
* **Verified.** A bank's manifest is published (atomically, tmp + rename) only once its snapshot
  is complete, with the CRC32 of each of its pieces (together the whole bank: a manifest whose
  pieces leave bytes out describes nothing), the layout, the step, the rank, the world size and
  the run's identity (:func:`run_identity`: a run dir deleted and made again is another
  run). Staging into a bank first withdraws its manifest, so a torn bank is never described. A
  restart agrees on one step every rank holds (:meth:`.checkpointer.Checkpointer.resume`) and
  checks every piece's CRC32 as it loads; one mismatch on any rank sends every rank to the disk.
  The manifest is JSON (no pickle): non-tensor leaves are encoded by :func:`encode_objects`.
* **Bounded.** At most two banks per local rank (the one kept while the next save is staged, and
  that save's), each the size of the rank's state. A finished run deletes its files; a restart
  deletes the banks it does not adopt and the files of ranks the job no longer has; a run that
  failed or was cancelled leaves files only until its launcher's agent is gone (the next worker
  start on the node, or the local launcher's exit, sweeps them; a pod's ``/dev/shm`` goes with the
  pod).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.bounded import JSON_LIMIT, parse_json, read_bytes
from kfp_nvrx.components.core.elastic_env import agent_pid
from kfp_nvrx.components.core.host_copy import (
    SHM_ROOT,
    HostCopyUnavailable,
    host_copy_base,
    host_copy_dir,
    node_copy_dir,
    node_name,
    pid_alive,
    private_dir,
    remove_copy,
)
from kfp_nvrx.components.core.rundir import CONFIG_FILE
from kfp_nvrx.components.errors import UserError

#: 3: the banks' pieces carry CRC-32C (2: zlib's CRC-32), so a bank an older worker described is
#: read from the volume instead.
MANIFEST_VERSION = 3
#: Names of the directories under the base that we create (a run key, or a private one).
_OURS = re.compile(r"^([0-9a-f]{16}|private-\d+-\d+)$")


def run_identity(run_dir: str | os.PathLike[str]) -> str | None:
    """Who the run in ``run_dir`` is: its ``config.yaml`` record's device, inode and mtime.

    The record is written by the run's first start and never replaced, so it names the run for
    its whole life; a run dir deleted and created again at the same path gets a new record.
    None when there is no record (nothing is then kept for a later worker).
    """
    try:
        st = os.lstat(Path(run_dir) / CONFIG_FILE)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}"


# ---------------------------------------------------------------------- manifest codec
def encode_objects(value: Any) -> Any:
    """A state's non-tensor leaves as plain JSON (tuples, dicts with any keys, NaN tagged).

    Raises:
        TypeError: A leaf JSON cannot carry faithfully (the bank is then not published).
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_objects(v) for v in value]}
    if isinstance(value, list):
        return [encode_objects(v) for v in value]
    if isinstance(value, dict):
        return {"__dict__": [[encode_objects(k), encode_objects(v)] for k, v in value.items()]}
    raise TypeError(f"{type(value).__name__} leaf")


def decode_objects(value: Any) -> Any:
    """The inverse of :func:`encode_objects`."""
    if isinstance(value, list):
        return [decode_objects(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode_objects(v) for v in value["__tuple__"])
        if "__float__" in value:
            return float(value["__float__"])
        return {decode_objects(k): decode_objects(v) for k, v in value["__dict__"]}
    return value


def _recent(path: Path, seconds: float = 60.0) -> bool:
    try:
        return time.time() - path.lstat().st_mtime < seconds
    except OSError:
        return False


def _read_json(path: Path, what: str) -> Any:
    """A bounded read of one of our JSON files; None when missing, not a file or not JSON."""
    try:
        return parse_json(read_bytes(path, "checkpoint", JSON_LIMIT, what), "checkpoint", path)
    except (OSError, UserError):
        return None


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
        self.run = run_identity(self.run_dir) if self.run_dir is not None else None
        self.node = node_name() if self.run_dir is not None else ""
        if self.run_dir is not None:
            self.run_path = host_copy_dir(self.run_dir, self.root)
            self.path = node_copy_dir(self.run_dir, self.node, self.root)
        else:
            self.path = self.base / f"private-{os.getpid()}-{time.monotonic_ns()}"
            self.run_path = self.path
        self.rank = rank
        self.world_size = world_size

    def private(self) -> bool:
        """The base and this run's directory are real directories of ours closed to others.

        Checked (``lstat``: a link is refused, never followed) before anything in them is
        listed, read, written or deleted: a link planted in either place (``/dev/shm`` is open
        to every user) would otherwise turn our deletes of ``rank<N>.*`` into deletes in any
        folder the link names. Once the base is proven ours, no other user can replace anything
        in it (0700), so the check holds for what follows.
        """
        try:
            for d in self._dirs():
                private_dir(d, create=False)
        except HostCopyUnavailable:
            return False
        return True

    def _dirs(self) -> list[Path]:
        """The base, the run's directory and (a simulated node's) this node's folder in it."""
        return [self.base, self.run_path] + ([self.path] if self.path != self.run_path else [])

    @property
    def keeps(self) -> bool:
        """Whether snapshots are described for a later worker (a run with a config record)."""
        return self.persistent and self.run is not None

    def ensure(self) -> None:
        """Creates the directories (0700) and records who owns this rank's files."""
        for d in self._dirs():
            private_dir(d)
        owner = {"run_dir": self.run_dir, "pid": os.getpid(), "agent_pid": agent_pid(),
                 "time": time.time()}
        self._write(self.path / f"rank{self.rank}.owner", json.dumps(owner).encode())

    def bank_path(self, index: int) -> Path:
        """The file of one staging bank of this rank."""
        return self.path / f"rank{self.rank}.bank{index}"

    def manifest_path(self, index: int) -> Path:
        """The manifest of one bank: which complete snapshot it holds."""
        return self.path / f"rank{self.rank}.bank{index}.json"

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        # tmpfs: rename is the atomicity needed (no fsync: the copy does not outlive the node).
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)

    def publish(self, index: int, *, step: int, nbytes: int, slots: list[list[Any]],
                objects: dict[str, Any], crc32: list[list[int]]) -> bool:
        """Describes bank ``index`` as holding the complete snapshot of ``step``.

        Args:
            index: The bank.
            step: The snapshot's step.
            nbytes: The bank's size.
            slots: The layout (rows of key, offset, nbytes, shape, dtype).
            objects: The snapshot's non-tensor leaves.
            crc32: ``[offset, length, crc]`` of every piece of the bank.

        Returns:
            False when nothing was published (no run record, or a leaf JSON cannot carry).
        """
        if not self.keeps or not self.private():
            return False
        try:
            encoded = encode_objects(objects)
        except TypeError:
            return False
        manifest = {"version": MANIFEST_VERSION, "run_dir": self.run_dir, "run": self.run,
                    "rank": self.rank, "world_size": self.world_size, "step": step,
                    "bank": index, "nbytes": nbytes, "slots": slots, "objects": encoded,
                    "crc32": crc32, "pid": os.getpid(), "time": time.time()}
        try:
            self._write(self.manifest_path(index), json.dumps(manifest).encode())
        except OSError:  # a full or read-only /dev/shm: this snapshot is not kept, that is all
            return False
        return True

    def withdraw(self, index: int | None = None) -> None:
        """Removes the manifest of bank ``index`` (before it is written again); None: all of them."""
        if not self.private():
            return  # nothing of ours is there to withdraw
        paths = ([self.manifest_path(index)] if index is not None
                 else list(self.path.glob(f"rank{self.rank}.bank*.json")))
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def snapshots(self) -> list[dict[str, Any]]:
        """This rank's described snapshots of this run and world size, newest first.

        Only manifests in a private directory of ours whose bank is a regular file of at least
        the described size; anything else (a stranger's file, a FIFO, another run's copy, an
        older format) is not a snapshot of this run.
        """
        if not self.keeps or not self.private():
            return []
        found = []
        for path in self.path.glob(f"rank{self.rank}.bank*.json"):
            m = _read_json(path, "host copy manifest")
            if self._describes(m, path):
                found.append(m)
        return sorted(found, key=lambda m: -m["step"])

    def _describes(self, m: Any, path: Path) -> bool:
        want = {"version": MANIFEST_VERSION, "run_dir": self.run_dir, "run": self.run,
                "rank": self.rank, "world_size": self.world_size}
        if not isinstance(m, dict) or any(m.get(k) != v for k, v in want.items()):
            return False
        if not all(isinstance(m.get(k), int) for k in ("step", "bank", "nbytes")):
            return False
        if path.name != self.manifest_path(m["bank"]).name:
            return False
        if not covers(m.get("crc32"), m["nbytes"]):
            return False  # a piece left unchecked would be loaded unchecked
        try:
            st = self.bank_path(m["bank"]).lstat()
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_size >= m["nbytes"]

    def drop_banks(self, keep: set[int]) -> None:
        """Deletes this rank's bank files (and manifests) other than ``keep``."""
        if not self.private():
            return
        for p in self.path.glob(f"rank{self.rank}.bank*"):
            index = p.name.removeprefix(f"rank{self.rank}.bank").removesuffix(".json")
            if not index.isdigit() or int(index) not in keep:
                with contextlib.suppress(OSError):
                    p.unlink()

    def drop_other_ranks(self) -> None:
        """Deletes the files of ranks this job does not have (a relaunch on fewer nodes)."""
        if not self.private():
            return
        pattern = re.compile(r"^\.?rank(\d+)\.")
        for p in self.path.iterdir():
            match = pattern.match(p.name)
            if match and int(match.group(1)) >= self.world_size:
                with contextlib.suppress(OSError):
                    p.unlink()

    def remove_rank_files(self) -> None:
        """Deletes this rank's banks, manifests and owner record; the directory once empty."""
        if not self.private():
            return
        for p in self.path.glob(f"rank{self.rank}.*"):
            with contextlib.suppress(OSError):
                p.unlink()
        if not self.persistent:
            remove_copy(self.path)
            return
        for d in dict.fromkeys([self.path, self.run_path]):
            with contextlib.suppress(OSError):
                d.rmdir()  # only when no other rank's (or node's) files are left

    def sweep(self) -> list[Path]:
        """Removes other runs' directories whose every ft_launcher agent has exited.

        Only inside a base directory that is ours and private, and only entries that are real
        directories named as we name them: a link in the base's place (or in it) is never
        followed, so nothing outside our own copies can be deleted.

        Returns:
            The directories removed.
        """
        removed: list[Path] = []
        try:
            private_dir(self.base, create=False)
            entries = list(self.base.iterdir())
        except (HostCopyUnavailable, OSError):
            return removed
        for d in entries:
            if d == self.path or not _OURS.match(d.name) or not _is_private(d):
                continue  # only a private directory of ours is read (its owner records)
            if _agents_gone(d) and remove_copy(d):
                removed.append(d)
        return removed


def _is_private(d: Path) -> bool:
    try:
        private_dir(d, create=False)
    except HostCopyUnavailable:
        return False
    return True


def covers(crc32: Any, nbytes: int) -> bool:
    """Whether ``crc32`` is ``[offset, length, crc]`` pieces covering ``[0, nbytes)`` end to end.

    The manifest's CRCs are how a restart knows a bank holds what was staged; pieces that leave
    bytes out (``[]``, a gap, an overlap, one past the end) would let those bytes load unchecked.
    """
    if not isinstance(crc32, list):
        return False
    end = 0
    for piece in crc32:
        if not (isinstance(piece, list) and len(piece) == 3
                and all(type(v) is int for v in piece)):
            return False
        offset, length, crc = piece
        if offset != end or length <= 0 or not 0 <= crc < 2**32:
            return False
        end += length
    return end == nbytes


def _agents_gone(d: Path) -> bool:
    """Whether every agent that wrote files into host copy ``d`` has exited."""
    agents = []
    for rec in [*d.glob("rank*.owner"), *d.glob("node-*/rank*.owner")]:  # d is private: no links
        owner = _read_json(rec, "owner record")
        if isinstance(owner, dict) and isinstance(owner.get("agent_pid"), int):
            agents.append(owner["agent_pid"])
    if d.name.startswith("private-"):
        agents.append(int(d.name.split("-")[1]))  # any digits (_OURS): pid_alive bounds them
    if not agents and _recent(d):
        return False  # being set up by a worker that has not written its owner record yet
    return not any(pid_alive(pid) for pid in agents)
