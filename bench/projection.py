"""Goodput projection from measured stall and recovery (Young/Daly first-order model).

With a checkpoint every ``tau`` seconds of work, a visible cost ``delta`` per checkpoint, a job
MTBF ``M`` (node MTBF / nodes) and a recovery time ``R`` per failure, a failure costs on average
``R + tau / 2`` (restart plus the redone half interval), so the kept fraction is::

    goodput(tau) = tau / (tau + delta) * (1 - (R + tau / 2) / M)

maximised near ``tau* = sqrt(2 * delta * M)`` (Young 1974; Daly 2006).
"""

from __future__ import annotations

import math


def job_mtbf_s(nodes: int, node_mtbf_days: float) -> float:
    """Mean time between failures of the whole job, seconds."""
    return node_mtbf_days * 86400.0 / nodes


def goodput(tau: float, delta: float, recovery: float, mtbf: float) -> float:
    """Kept fraction of wall time at checkpoint interval ``tau`` (seconds of work)."""
    if tau <= 0:
        return 0.0
    return max(0.0, tau / (tau + delta) * (1 - (recovery + tau / 2) / mtbf))


def young_daly(delta: float, mtbf: float) -> float:
    """The interval that maximises goodput to first order."""
    return math.sqrt(2 * max(delta, 1e-9) * mtbf)


def best_interval(delta: float, recovery: float, mtbf: float) -> tuple[float, float]:
    """(tau, goodput) maximising :func:`goodput` numerically (checks the closed form)."""
    lo, hi = 1e-3, mtbf
    for _ in range(200):  # golden-section search on a unimodal function
        a, b = hi - (hi - lo) / 1.618, lo + (hi - lo) / 1.618
        if goodput(a, delta, recovery, mtbf) < goodput(b, delta, recovery, mtbf):
            lo = a
        else:
            hi = b
    tau = (lo + hi) / 2
    return tau, goodput(tau, delta, recovery, mtbf)


# FSx for Lustre SCRATCH_2, the seeds' 1.2 TiB file system: throughput for all nodes together.
FSX_TIB = 1.2
FSX_BASELINE_MB_S_PER_TIB = 200.0
FSX_BURST_MB_S_PER_TIB = 1300.0
GPUS_PER_P5 = 8


def fsx_gb_per_s(burst: bool) -> float:
    """Aggregate FSx SCRATCH_2 read throughput of the 1.2 TiB file system, GB/s."""
    per_tib = FSX_BURST_MB_S_PER_TIB if burst else FSX_BASELINE_MB_S_PER_TIB
    return per_tib * FSX_TIB / 1000


#: The paths that recover from host memory (the others read the durable tier).
MEMORY_PATH = "node kept: host memory"
PEER_PATH = "node replaced: restored from a peer"
MEMORY_PATHS = (MEMORY_PATH, PEER_PATH)
#: The peer copies travel over TCP (gloo) on the pod network, not over EFA (NCCL's alone): one
#: flow per rank pair, at most 10 Gbit/s a flow inside a cluster placement group, and a node's
#: flows share its ENA interface (100 Gbit/s). AWS's published limits, not measured here.
TCP_FLOW_GB_S = 1.25
NODE_TCP_GB_S = 12.5


def peer_fetch_s(state_gb_per_gpu: float, rank_gb_per_s: float) -> float:
    """Seconds a replaced p5 node takes to fetch its 8 ranks' copies from the peer node.

    Each rank receives its own copy on its own flow at the measured per-rank rate (sender's
    copy out, receiver's CRC32 check) capped by :data:`TCP_FLOW_GB_S`; the 8 flows share the
    node's :data:`NODE_TCP_GB_S`.
    """
    per_rank = min(rank_gb_per_s, TCP_FLOW_GB_S)
    return max(state_gb_per_gpu / per_rank, GPUS_PER_P5 * state_gb_per_gpu / NODE_TCP_GB_S)


def recovery_paths(nodes: int, measured_s: float, measured_load_s: float,
                   state_gb_per_gpu: float, peer_gb_per_s: float | None = None) -> dict[str, float]:
    """Recovery seconds of one failure on ``nodes`` p5 nodes, by the path the code takes.

    ``measured_s``/``measured_load_s``: an in-job restart measured on one GPU holding
    ``state_gb_per_gpu`` (its load from node-local memory). A p5 node holds 8 such shares.

    * ``node kept: host memory``: the measured restart (every node loads from its own memory);
    * ``node replaced: restored from a peer`` (with ``peer_gb_per_s``, the measured rate of one
      rank's copy): the replaced node's ranks fetch their copies (:func:`peer_fetch_s`), then
      every rank loads from host memory as in the measured restart; the others wait for them;
    * ``node replaced: every node reads FSx``: a replaced node whose copies are gone too (or
      ``checkpoint.replicas=1``): every node reads the newest commit from FSx at once, at the
      burst and at the baseline throughput.
    """
    node_gb = GPUS_PER_P5 * state_gb_per_gpu
    rest = measured_s - measured_load_s
    paths = {MEMORY_PATH: measured_s}
    if peer_gb_per_s:
        paths[PEER_PATH] = measured_s + peer_fetch_s(state_gb_per_gpu, peer_gb_per_s)
    paths["node replaced: every node reads FSx (burst)"] = \
        rest + nodes * node_gb / fsx_gb_per_s(True)
    paths["node replaced: every node reads FSx (baseline)"] = \
        rest + nodes * node_gb / fsx_gb_per_s(False)
    return paths
