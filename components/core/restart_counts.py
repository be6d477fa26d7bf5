"""Restarts by layer, from a run's events: what goodput, the timeline and the Metrics count.

In-process restarts are the trainer's ``restart`` events; in-job and pod restarts are the
rendezvous rounds that each node's ``join`` records (:mod:`.rounds`: a new agent on any node is a
pod restart, which rank 0's own ``restart`` event cannot see), rounds whose workers failed before
training included; the first restart after each re-admission of a preempted job is no restart
(:mod:`.queue_waits`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kfp_nvrx.components.core.events import Event, Restart, Start
from kfp_nvrx.components.core.queue_waits import absorbed
from kfp_nvrx.components.core.rounds import rounds, start_layers


def restart_kinds(events: list[Event], sess: list[int]) -> dict[int, str]:
    """The layer of each ``restart`` event (by ``id``): rank 0's word, unless the rounds know.

    Rank 0 names the layer from its own agent only; the rounds (every node's agent) correct an
    in-job restart that was a recreated pod of another node.
    """
    layers = start_layers(events)
    starts = {(k, e.incarnation, e.iteration): layers[id(e)] for e, k in zip(events, sess,
              strict=True) if isinstance(e, Start) and layers.get(id(e))}
    return {id(e): starts.get((k, e.incarnation, e.iteration)) or e.kind
            for e, k in zip(events, sess, strict=True) if isinstance(e, Restart)}


def unstarted_restarts(events: list[Event], sess: list[int]) -> list[tuple[float, str]]:
    """(time, layer) of each restart whose round never logged a start.

    Its workers failed before training (in their set-up), or rank 0 refused the restart (the
    job's budget was spent): ft_launcher restarted them all the same. A round with a start has
    its ``restart`` event, counted there.
    """
    session_of = {id(e): k for e, k in zip(events, sess, strict=True)}
    started = {(e.agent, e.pid) for e in events if isinstance(e, Start) and not e.iteration}
    out: list[tuple[float, str]] = []
    seen: set[int] = set()
    for r in rounds(events):
        k = session_of[id(next(iter(r.joins.values())))]
        first = k not in seen  # a session's first round is its launch, no restart
        seen.add(k)
        if not first and r.layer is not None and r.rank0() not in started:
            out.append((r.time, r.layer))
    return out


def restart_counts(events: list[Event], sess: list[int],
                   admitted: Sequence[float] = ()) -> dict[str, int]:
    """Restarts by layer (see the module docstring), only the layers that restarted.

    ``admitted``: when the job was admitted again after a preemption (:mod:`.queue_waits`):
    the first restart after each is the job resuming, no restart.
    """
    kinds = restart_kinds(events, sess)
    found = [(e.time, kinds[id(e)]) for e in events if id(e) in kinds]
    found += unstarted_restarts(events, sess)
    resumes = absorbed([when for when, _ in found], admitted)
    out: dict[str, int] = {}
    for i, (_, kind) in enumerate(found):
        if i not in resumes:
            out[kind] = out.get(kind, 0) + 1
    return out
