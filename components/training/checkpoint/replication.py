"""The background copies of each sealed snapshot to its peer nodes, one round at a time.

A *round* sends this rank's newest sealed snapshot (its bank's bytes, as they are, and its
manifest) to its targets and receives its sources' (:class:`.peers.Peers`), on a thread of its
own; the loop only starts rounds and learns they ended, from :meth:`Replicator.tick`, with one
small collective per step while there is something to do. A round takes the newest snapshot
sealed on every rank; snapshots taken while it runs are not queued: the next round takes the
newest then. The bank it sends is lent (never staged into) until every rank's part ended. A
snapshot counts as held by a peer (:attr:`Replicator.replicated`) only once every rank's copies
of it arrived complete and matched their CRC32s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kfp_nvrx.components.core.bounded import JSON_LIMIT, parse_json, read_bytes
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.checkpoint.peers import Peers, recv_copy, send_copy
from kfp_nvrx.components.training.checkpoint.replicas import ReplicaRefused, check_manifest
from kfp_nvrx.components.training.checkpoint.snapshots import Pace
from kfp_nvrx.components.training.checkpoint.staging import HostStaging
from kfp_nvrx.components.training.ranks import all_ranks

#: Called on rank 0 after each round with (step, seconds, bytes each rank sent, ok, and the
#: seconds the training loop spent in replication's collectives since the last round).
OnReplica = Callable[[int, float, int, bool, float], None]


class Round:
    """One round of copies: this rank's snapshot of ``step`` out, its sources' copies in."""

    def __init__(self, peers: Peers, step: int, manifest: bytes, data: torch.Tensor) -> None:
        self.peers, self.step = peers, step
        self.ok, self.error, self.received = False, "", 0
        self.sent = data.numel() * len(peers.targets)
        self.started = time.perf_counter()
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(manifest, data),
                                        name="ckpt-replicate", daemon=True)
        self._thread.start()

    def _run(self, manifest: bytes, data: torch.Tensor) -> None:
        peers = self.peers
        try:
            works = [w for dst in peers.targets for w in send_copy(peers.group, dst, manifest, data)]
            for src in peers.sources:
                self.received += recv_copy(peers.group, src, self._keep(src))
            for work in works:
                work.wait()
            self.ok = True
        except Exception as err:  # noqa: BLE001 - a lost peer, a refused copy: reported by tick
            self.error = f"{type(err).__name__}: {err}"
        finally:
            self.seconds = time.perf_counter() - self.started

    def _keep(self, src: int) -> Callable[[dict[str, Any], Callable], int]:
        files = self.peers.files

        def take(manifest: dict[str, Any], fill: Callable) -> int:
            check_manifest(manifest, files.home, src, self.step)
            return files.receive(manifest, fill, src)

        return take

    def finished(self) -> bool:
        """Whether this rank's part is over (never blocks)."""
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        """Waits for this rank's part (its bank is unmapped only after it)."""
        self._thread.join(timeout)


class Replicator:
    """Starts a round after each snapshot sealed on every rank; learns that it ended (collective).

    Args:
        peers: This rank's place in the replication.
        staging: The banks the snapshots are in.
        pace: The snapshot pace (its ``newest`` is the same on every rank).
        device: The training device (the flags are reduced there).
        log: Where one-line notices go.
        on_replica: Told on rank 0 of each round's end.
    """

    def __init__(self, peers: Peers, staging: HostStaging, pace: Pace, device: torch.device,
                 log: Callable[[str], None], on_replica: OnReplica | None = None) -> None:
        self.peers, self.staging, self.pace, self.device = peers, staging, pace, device
        self.log, self.on_replica = log, on_replica
        self.round: Round | None = None
        self.replicated = -1  # the newest step every rank's peers hold
        self.failed = -1  # a step whose round failed: not tried again
        self.failing = False  # the last round failed (said once)
        self.rounds = 0
        self.round_s: list[float] = []
        self.loop_s = 0.0  # seconds the loop spent in replication's collectives since the last report

    def tick(self) -> None:
        """Once per step on every rank: ends the round in flight, or starts the next one.

        Its collectives are the loop's cost of replication: timed, and reported with the round.
        """
        t0 = time.perf_counter()
        try:
            if self.round is not None:
                self._end()
            else:
                self._start()
        finally:
            self.loop_s += time.perf_counter() - t0

    def _start(self) -> None:
        step = self.pace.newest
        if step < 0 or step <= self.replicated or step == self.failed:
            return
        staging = self.staging
        bank = staging._holding(step)
        manifest = _sealed(staging, bank.index, step) if bank is not None else None
        if not all_ranks(manifest is not None, self.device):
            return  # a rank has not sealed it yet (its CRC32s are taken in the background)
        assert bank is not None and bank.buffer is not None and manifest is not None
        self.round = Round(self.peers, step, manifest, bank.buffer[:staging.nbytes])
        staging.lend_peer(bank, self.round.join)

    def _end(self) -> None:
        r = self.round
        assert r is not None
        if not all_ranks(r.finished(), self.device):
            return
        ok = all_ranks(r.ok, self.device)
        self.round = None
        self.staging.lend_peer(None, None)
        self.rounds += 1
        self.round_s.append(r.seconds)
        if ok:
            self.replicated, self.failing = r.step, False
        else:
            self.failed = r.step
            if not self.failing:  # one line when copies start failing, not one per snapshot
                self.log(f"step {r.step} is not held by a peer: "
                         f"{r.error or 'a copy failed on another rank'} (said once until a "
                         "copy succeeds again)")
            self.failing = True
        if self.peers.rank == 0 and self.on_replica is not None:
            loop_s, self.loop_s = self.loop_s, 0.0
            self.on_replica(r.step, r.seconds, r.sent, ok, loop_s)

    def abort(self) -> None:
        """Error path: the round in flight is given up (its thread ends with the group)."""
        if self.round is not None:
            self.round = None
            self.staging.lend_peer(None, None)

    def close(self, timeout: float) -> None:
        """The run's end: lets the round in flight finish its part (``timeout`` at most)."""
        if self.round is not None:
            self.round.join(timeout)
            self.round = None
            self.staging.lend_peer(None, None)


def _sealed(staging: HostStaging, index: int, step: int) -> bytes | None:
    """Bank ``index``'s published manifest when it describes ``step`` (None: not sealed yet)."""
    home = staging.home
    try:
        data = read_bytes(home.manifest_path(index), "checkpoint", JSON_LIMIT, "manifest")
        check_manifest(parse_json(data, "checkpoint", home.manifest_path(index)), home,
                       home.rank, step)
    except (OSError, UserError, ReplicaRefused):  # not sealed (yet), or withdrawn meanwhile
        return None
    return data
