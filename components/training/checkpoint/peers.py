"""Every host snapshot also held by a peer node, and restored from it when a node is lost.

The host-memory tier (:mod:`.staging`, :mod:`.host_tier`) restores a restart on a node that kept
its memory. A node that is lost (a pod rescheduled onto a new node after a GPU, host or network
failure) takes its ranks' banks with it, and without a copy elsewhere every rank would reload the
newest *committed* checkpoint from the volume. Here each rank's newest sealed snapshot is also
sent, in the background, to the same local rank of the next ``checkpoint.replicas - 1`` nodes
(:func:`peer_ranks`: never two copies on one node; the failure domain is the node, as the job's
own layout groups the ranks), which keep it sealed in host memory (:mod:`.replicas`). A restart
agrees on the newest step every rank can get from host memory, its own or a peer's copy, and the
ranks that lost theirs fetch them (:meth:`Peers.restore`); the volume is read only when a node
and every holder of its copies are lost.

Transport: a gloo process group of its own (the training's NCCL group is never touched from a
second thread; over TCP on the pod network), point-to-point, a copy being a header, the sender's
manifest and the bytes in :data:`CHUNK` pieces (:func:`send_copy`, :func:`recv_copy`).

Why not NVRx's ``LocalCheckpointManager`` with ``CliqueReplicationStrategy``: its ``save()``
exchanges the tensors (one broadcast per tensor, on the training group) in the caller's thread
before anything is asynchronous and writes every copy with ``torch.save``; here the banks the
snapshot already fills are sent as they are, from a thread, and the receiver's copy is checked
piece by piece against the CRC32s the bank was sealed with (docs/benchmarks/NOTES.md).
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kfp_nvrx.components.core.bounded import JSON_LIMIT, parse_json
from kfp_nvrx.components.core.host_copy import node_name
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.checkpoint.bank import StagingUnavailable
from kfp_nvrx.components.training.checkpoint.hostcopy import HostCopyDir
from kfp_nvrx.components.training.checkpoint.replicas import (
    Held,
    ReplicaRefused,
    Replicas,
    check_manifest,
    open_held,
)
from kfp_nvrx.components.training.ranks import gather

#: Bytes per point-to-point message of a copy.
CHUNK = 64 << 20
#: Seconds one message of a copy may take before the peer counts as gone.
TIMEOUT_S = 300.0


def node_key() -> str:
    """Which host memory this process has: its machine, and the simulated node on it."""
    return f"{socket.gethostname()}/{node_name()}"


def peer_ranks(keys: list[str], replicas: int) -> list[list[int]]:
    """For every rank, the ranks its snapshots are copied to (``keys``: each rank's node).

    Nodes are ordered by their lowest rank; copy ``j`` of a rank goes to the rank at the same
    position on the ``j``-th next node, so every copy is on another node and every rank holds
    as many copies as it sends. Fewer nodes than ``replicas``: as many copies as there are other
    nodes (one node: none).
    """
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    order = list(nodes.values())
    where = {r: (n, i) for n, ranks in enumerate(order) for i, r in enumerate(ranks)}
    copies = max(0, min(replicas - 1, len(order) - 1))
    out = []
    for rank in range(len(keys)):
        n, i = where[rank]
        out.append([order[(n + j) % len(order)][i % len(order[(n + j) % len(order)])]
                    for j in range(1, copies + 1)])
    return out


# ---------------------------------------------------------------------------- one copy on the wire
def send_copy(group: Any, dst: int, manifest: bytes, data: torch.Tensor) -> list[Any]:
    """Posts one copy to ``dst`` (header, manifest, bytes); wait on the works it returns."""
    header = torch.tensor([len(manifest), data.numel()], dtype=torch.int64)
    text = torch.frombuffer(bytearray(manifest), dtype=torch.uint8)
    works = [dist.isend(header, dst, group=group), dist.isend(text, dst, group=group)]
    for offset in range(0, data.numel(), CHUNK):
        works.append(dist.isend(data[offset:offset + CHUNK], dst, group=group))
    return works


def recv_copy(group: Any, src: int, take: Callable[[dict[str, Any], Callable], int]) -> int:
    """Receives one copy from ``src``; ``take(manifest, fill)`` keeps it (or raises).

    Every byte the sender posts is received, kept or not, so the next copy on this link starts
    in step. Returns the bytes kept.

    Raises:
        ReplicaRefused: The copy was refused (what ``take`` raised, or a malformed header).
    """
    header = torch.empty(2, dtype=torch.int64)
    dist.recv(header, src, group=group)
    mlen, nbytes = (int(v) for v in header.tolist())
    if mlen == 0:  # the sender could not open its copy: nothing follows
        raise ReplicaRefused(f"rank {src} has no copy to send")
    if not 0 < mlen <= JSON_LIMIT:
        raise ReplicaRefused(f"rank {src} sent a header of {mlen} bytes")  # the link is lost
    text = torch.empty(mlen, dtype=torch.uint8)
    dist.recv(text, src, group=group)
    got = [0]

    def fill(buffer: torch.Tensor) -> None:
        if buffer.numel() != nbytes:
            raise ReplicaRefused(f"rank {src} sends {nbytes} bytes, the manifest says "
                                 f"{buffer.numel()}")
        for offset in range(0, nbytes, CHUNK):
            dist.recv(buffer[offset:offset + CHUNK], src, group=group)
            got[0] = offset + min(CHUNK, nbytes - offset)

    try:
        manifest = parse_json(bytes(text.numpy()), "checkpoint", f"rank {src}")
        return take(manifest, fill)
    except (ReplicaRefused, UserError) as err:  # refused, the link intact: its bytes still come
        _drain(group, src, nbytes, got[0])
        raise ReplicaRefused(f"rank {src}'s copy: {err}") from None


def _drain(group: Any, src: int, nbytes: int, got: int) -> None:
    """Receives and drops what ``src`` still sends of a refused copy (``got``: bytes taken)."""
    if got >= nbytes:
        return
    scratch = torch.empty(min(CHUNK, nbytes), dtype=torch.uint8)
    for offset in range(got, nbytes, CHUNK):
        dist.recv(scratch[:min(CHUNK, nbytes - offset)], src, group=group)


# ---------------------------------------------------------------------------- the ranks' network
@dataclass
class Peers:
    """This rank's place in the replication: who holds its copies, whose it holds, the link.

    Made collectively by :meth:`open` (every rank, in the same order).

    Attributes:
        rank: This rank.
        world_size: Ranks of the job.
        targets: The ranks that hold this rank's copies.
        sources: The ranks whose copies this rank holds.
        group: The gloo group the copies travel in.
        files: This node's replica files.
        nodes: How many nodes the job has.
    """

    rank: int
    world_size: int
    targets: list[int]
    sources: list[int]
    group: Any
    files: Replicas
    nodes: int
    received: int = 0  # bytes this rank received from peers (replicas and restores)
    sent: int = 0
    fetched: list[int] = field(default_factory=list)  # ranks that fetched from a peer, last start
    fetched_bytes: int = 0  # bytes they fetched

    @classmethod
    def open(cls, home: HostCopyDir, replicas: int) -> Peers | None:
        """The replication of this run (collective); None when there is no other node or ``replicas`` is 1."""
        rank, world = dist.get_rank(), dist.get_world_size()
        keys = gather(node_key(), world)
        every = peer_ranks(keys, replicas)
        if not any(every):
            return None
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
        Replicas(home).drop_parts()
        sources = [r for j in range(len(every[rank])) for r in range(world) if every[r][j] == rank]
        return cls(rank, world, every[rank], sources, group, Replicas(home), len(set(keys)))

    # ---------------------------------------------------------------- restore
    def restore(self, own: list[int], newest: int | None, log: Callable[[str], None]) -> int | None:
        """Fetches from peers what this rank lacks of the newest step every rank can get (collective).

        Every rank lists the steps it holds itself (``own``) and the copies its node holds of
        others; all agree on the newest step (not older than the newest commit ``newest``) that
        every rank holds or some rank holds a copy of; the ranks lacking it receive it from the
        lowest such holder and keep it as their own sealed bank, checked piece by piece. The
        caller's normal memory path then loads it (and checks it again).

        Returns:
            The step fetched for (None: nobody needed a peer).
        """
        held = self.files.holdings()
        every = gather((sorted(own), sorted({(h.owner, h.step) for h in held})), self.world_size)
        step, moves = plan_restore([set(o) for o, _ in every],
                                   [{(x, s) for x, s in h} for _, h in every], newest)
        self.fetched, self.fetched_bytes = [], 0
        if step is None or not moves:
            return None
        t0, moved, problems = time.perf_counter(), 0, list[str]()
        # Every copy this rank sends is posted first, then it receives its own: the copies from
        # different holders to different ranks travel at once, and no pair waits on another.
        sending = [self._post(dst, _pick(held, dst, step), problems)
                   for src, dst in moves if src == self.rank != dst]
        for src, dst in moves:
            if dst != self.rank:
                continue
            try:
                if src == dst:  # a copy of its own state in its node's folder
                    moved += self._take_local(_pick(held, dst, step), step)
                else:
                    moved += recv_copy(self.group, src, self._keep_as_bank(step))
            except (ReplicaRefused, OSError, RuntimeError) as err:
                problems.append(f"rank {src} -> rank {dst}: {err}")
        for done in sending:
            self.sent += done()
        self.received += moved
        every_moved = gather(moved, self.world_size)
        self.fetched = [d for _, d in moves if every_moved[d] > 0]
        self.fetched_bytes = sum(every_moved)
        if problems:
            log(f"peer restore of step {step}: {problems[0]}")
        if moved:
            log(f"step {step}: rank {self.rank} fetched its state from rank "
                f"{next(s for s, d in moves if d == self.rank)} ({moved / 1e9:.2f} GB in "
                f"{time.perf_counter() - t0:.1f} s)")
        return step

    def _post(self, dst: int, held: Held, problems: list[str]) -> Callable[[], int]:
        """Posts ``held`` to ``dst``; returns what waits for it (and says the bytes sent)."""
        try:
            manifest, data, bank = open_held(held)
        except (OSError, UserError, StagingUnavailable) as err:
            # An empty header: the receiver refuses it at once instead of waiting for bytes.
            problems.append(f"rank {self.rank} -> rank {dst}: {err}")
            empty = dist.isend(torch.zeros(2, dtype=torch.int64), dst, group=self.group)

            def sent_nothing() -> int:
                if empty is not None:
                    empty.wait()
                return 0

            return sent_nothing
        works = send_copy(self.group, dst, manifest, data)

        def done() -> int:
            try:
                for work in works:
                    work.wait()
            except RuntimeError as err:
                problems.append(f"rank {self.rank} -> rank {dst}: {err}")
                return 0
            finally:
                bank.unmap()  # (the views are dropped with the works)
            return held.nbytes

        return done

    def _take_local(self, held: Held, step: int) -> int:
        """Makes a copy of this rank's state in its node's folder its own bank (checked)."""
        text, data, bank = open_held(held)
        try:
            manifest = parse_json(text, "checkpoint", held.manifest)
            return self._keep_as_bank(step)(manifest, lambda buffer: buffer.copy_(data))
        finally:
            bank.unmap()  # (a view still alive is unmapped by the GC)

    def _keep_as_bank(self, step: int) -> Callable[[dict[str, Any], Callable], int]:
        home = self.files.home

        def take(manifest: dict[str, Any], fill: Callable) -> int:
            check_manifest(manifest, home, self.rank, step)
            # The first bank index this rank has no file of (a replaced node: 0).
            index = next(i for i in itertools.count()
                         if not (os.path.lexists(home.bank_path(i))
                                 or os.path.lexists(home.manifest_path(i))))
            return self.files.receive(manifest, fill, self.rank, as_bank=index)

        return take


def _pick(held: list[Held], owner: int, step: int) -> Held:
    return next(h for h in held if h.owner == owner and h.step == step)


def plan_restore(own: list[set[int]], held: list[set[tuple[int, int]]], newest: int | None,
                 ) -> tuple[int | None, list[tuple[int, int]]]:
    """The newest step every rank can get from host memory, and the copies to move for it.

    Args:
        own: Per rank, the steps it holds itself.
        held: Per rank, ``(owner, step)`` of the copies in its node's folder (peer copies, and
            other ranks' banks left there; a copy of its own state after it moved nodes).
        newest: The newest committed step (an older snapshot is not taken).

    Returns:
        The step (None: none), and ``(holder, rank)`` for each rank that must fetch it, in rank
        order: a copy in its own node folder (``holder == rank``), else the lowest holder's.
    """
    world = len(own)
    steps = sorted(set().union(*own, *({s for _, s in h} for h in held)), reverse=True)
    for step in steps:
        if newest is not None and step < newest:
            break
        moves = []
        for rank in range(world):
            if step in own[rank]:
                continue
            # A copy in the rank's own node folder first (ranks may land on other nodes after
            # a restart: its copy is then a local file), else the lowest holder elsewhere.
            holders = sorted((h for h in range(world) if (rank, step) in held[h]),
                             key=lambda h: (h != rank, h))
            if not holders:
                break
            moves.append((holders[0], rank))
        else:
            return step, moves
    return None, []
