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
