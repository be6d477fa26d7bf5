"""Copies of other ranks' snapshots that this node holds: peer replicas, kept as sealed files.

A replica is another node's newest sealed snapshot of one rank (its bank's bytes and its manifest,
:mod:`.hostcopy`), received over the job's network (:mod:`.peers`) and kept in this node's host
copy folder as ``rank<H>.replica<X>`` (the bytes) and ``rank<H>.replica<X>.json`` (the manifest),
``H`` the rank that received it and ``X`` the rank whose state it is. Being ``rank<H>.`` files they
go with the holder's own (a finished run, a relaunch on fewer nodes) and only into a directory
:meth:`.HostCopyDir.private` proved ours (never through a link).

What keeps a replica honest:

* It is published only once every byte arrived and the CRC32 of every piece matched the sender's
  manifest (a torn or damaged transfer is never described); the previous replica of that rank is
  withdrawn only then, so a round cut by a fault leaves the older one in place.
* A manifest is taken only for this run (its run dir and the run record's identity, less the
  device number, which differs between nodes mounting one volume), this world size, the rank and
  step asked for, and pieces that cover its size (:func:`.hostcopy.covers`); anything else is
  refused, and so is a bank file shorter than the manifest says.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kfp_nvrx.components.core.bounded import JSON_LIMIT, parse_json, read_bytes
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.checkpoint.bank import StagingUnavailable, _Bank
from kfp_nvrx.components.training.checkpoint.hostcopy import (
    MANIFEST_VERSION,
    HostCopyDir,
    HostCopyUnavailable,
    covers,
    decode_objects,
)
from kfp_nvrx.components.training.checkpoint.integrity import SnapshotDamaged, check_pieces

_REPLICA = re.compile(r"^rank(\d+)\.replica(\d+)\.json$")
#: Numbers the files being received (a thread of an aborted incarnation may still be writing one).
_PARTS = itertools.count()
_OWN = re.compile(r"^rank(\d+)\.bank(\d+)\.json$")


class ReplicaRefused(RuntimeError):
    """A peer's copy is not one this rank may take (another run, step, rank or size; damaged)."""


def same_run(a: Any, b: Any) -> bool:
    """Whether two run identities (``dev:ino:mtime``) name one run, on whichever node.

    The device number is the mount's on each node (one FSx volume gets a different one per
    node); the inode and the record's mtime are the file's own.
    """
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    return a.partition(":")[2] == b.partition(":")[2] != ""


@dataclass(frozen=True)
class Held:
    """A snapshot of rank ``owner`` that this node holds, as :func:`holdings` lists it.

    Attributes:
        owner: The rank whose state it is.
        step: The snapshot's step.
        nbytes: Its size.
        data: The file holding its bytes.
        manifest: Its manifest file.
    """

    owner: int
    step: int
    nbytes: int
    data: Path
    manifest: Path


def check_manifest(m: Any, home: HostCopyDir, rank: int, step: int | None = None) -> dict[str, Any]:
    """``m`` as a manifest of rank ``rank``'s snapshot of this run (and ``step``), or refused.

    Raises:
        ReplicaRefused: Naming what does not match.
    """
    if not isinstance(m, dict) or m.get("version") != MANIFEST_VERSION:
        raise ReplicaRefused("not a snapshot manifest of this version")
    if m.get("run_dir") != home.run_dir or not same_run(m.get("run"), home.run):
        raise ReplicaRefused(f"another run's snapshot ({m.get('run_dir')})")
    want = {"rank": rank, "world_size": home.world_size} | ({"step": step} if step is not None else {})
    for key, value in want.items():
        if m.get(key) != value:
            raise ReplicaRefused(f"{key} {m.get(key)!r}, expected {value}")
    if not all(type(m.get(k)) is int and m[k] >= 0 for k in ("step", "nbytes")):
        raise ReplicaRefused("no step or size")
    if not covers(m.get("crc32"), m["nbytes"]):
        raise ReplicaRefused("its CRC32 pieces do not cover its bytes")
    if not isinstance(m.get("slots"), list):
        raise ReplicaRefused("no layout")
    return m


def _read_manifest(path: Path) -> Any:
    try:
        return parse_json(read_bytes(path, "checkpoint", JSON_LIMIT, "replica manifest"),
                          "checkpoint", path)
    except (OSError, UserError):
        return None


def _file_holds(path: Path, nbytes: int) -> bool:
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_size >= nbytes


class Replicas:
    """The copies this node's folder holds for other ranks, and the ones it receives.

    Args:
        home: This rank's host copy directory (its node's folder of the run).
    """

    def __init__(self, home: HostCopyDir) -> None:
        self.home = home

    def data_path(self, owner: int) -> Path:
        """Where this rank keeps its replica of ``owner``'s newest snapshot."""
        return self.home.path / f"rank{self.home.rank}.replica{owner}"

    def manifest_path(self, owner: int) -> Path:
        """That replica's manifest."""
        return self.home.path / f"rank{self.home.rank}.replica{owner}.json"

    def holdings(self) -> list[Held]:
        """Every sealed snapshot of another rank in this node's folder, checked.

        The replicas any rank of this node received, and the banks of other ranks left by
        earlier workers here (after a restart ranks may land on other nodes). Empty when the
        folder is not a private directory of ours.
        """
        home = self.home
        if not home.keeps or not home.private():
            return []
        found: list[Held] = []
        for path in home.path.iterdir():
            replica, own = _REPLICA.match(path.name), _OWN.match(path.name)
            if replica is not None:
                owner, data = int(replica[2]), path.with_suffix("")
            elif own is not None and int(own[1]) != home.rank:
                owner, data = int(own[1]), path.with_suffix("")
            else:
                continue
            try:
                m = check_manifest(_read_manifest(path), home, owner)
            except ReplicaRefused:
                continue
            if own is not None and m.get("bank") != int(own[2]):
                continue
            if _file_holds(data, m["nbytes"]):
                found.append(Held(owner, m["step"], m["nbytes"], data, path))
        return found

    def receive(self, manifest: dict[str, Any], fill: Any, owner: int, *,
                as_bank: int | None = None) -> int:
        """Receives a copy of ``owner``'s snapshot into a new file, then publishes it.

        ``fill(buffer)`` writes the bytes into the mapped file (the network receive). They are
        checked against the manifest's CRC32s before anything is published.

        Args:
            manifest: The sender's manifest (checked by the caller: :func:`check_manifest`).
            fill: Writes ``manifest["nbytes"]`` bytes into the tensor it is given.
            owner: The rank whose state it is.
            as_bank: Publish it as this rank's own bank ``as_bank`` (a restore from a peer),
                else as the replica of ``owner``.

        Returns:
            The bytes received.

        Raises:
            ReplicaRefused: The bytes did not match (nothing is published), or no room.
        """
        home, nbytes = self.home, int(manifest["nbytes"])
        final = home.bank_path(as_bank) if as_bank is not None else self.data_path(owner)
        tmp = final.with_name(f".{final.name}.{os.getpid()}-{next(_PARTS)}.part")
        bank, checked = _Bank(-1, tmp), False
        buffer: torch.Tensor | None = None
        try:
            home.ensure()  # a replaced node's folder is made here (0700; a link is refused)
            bank.map(max(nbytes, 1), create=True)
            assert bank.buffer is not None
            buffer = bank.buffer[:nbytes]
            fill(buffer)
            check_pieces(buffer, manifest["crc32"])
            checked = True
        except (SnapshotDamaged, StagingUnavailable, HostCopyUnavailable) as err:
            raise ReplicaRefused(str(err)) from None
        finally:
            buffer = None  # the view goes before the mapping is closed
            bank.unmap()
            if not checked:
                with contextlib.suppress(OSError):
                    tmp.unlink()
        if as_bank is not None:
            home.withdraw(as_bank)
            os.replace(tmp, final)
            with contextlib.suppress(OSError):
                os.chmod(final, 0o600)
            objects = decode_objects(manifest.get("objects", {"__dict__": []}))
            if not home.publish(as_bank, step=manifest["step"], nbytes=nbytes,
                                slots=manifest["slots"], objects=objects,
                                crc32=manifest["crc32"]):
                raise ReplicaRefused("its manifest could not be published")
        else:
            with contextlib.suppress(FileNotFoundError):
                self.manifest_path(owner).unlink()  # the older replica is no longer described
            os.replace(tmp, final)
            kept = dict(manifest, run=home.run, holder=home.rank)
            HostCopyDir._write(self.manifest_path(owner), json.dumps(kept).encode())
        return nbytes

    def drop_parts(self) -> None:
        """Deletes the files an earlier worker of this rank left half received (it died)."""
        if not self.home.private():
            return
        for p in self.home.path.glob(f".rank{self.home.rank}.*.part"):
            with contextlib.suppress(OSError):
                p.unlink()


def open_held(held: Held) -> tuple[bytes, torch.Tensor, _Bank]:
    """A held copy's manifest bytes and its bytes mapped (unmap the bank when sent)."""
    data = read_bytes(held.manifest, "checkpoint", JSON_LIMIT, "replica manifest")
    bank = _Bank(-1, held.data)
    bank.map(held.nbytes if held.nbytes else 1, create=False)
    assert bank.buffer is not None
    return data, bank.buffer[:held.nbytes], bank
