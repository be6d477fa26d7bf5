"""Where a start's state came from, in words (torch-free: the trainer's log and the timeline)."""

from __future__ import annotations

from collections import Counter


def source_words(sources: list[str] | None, peer_bytes: int | None = None) -> str:
    """`` (from host memory)``, `` (host memory: 3 ranks, peer: 1 rank, 0.52 GB)`` or ''.

    Args:
        sources: Per rank: ``memory``, ``peer`` or ``volume`` (None: a fresh start).
        peer_bytes: Bytes fetched from peers.
    """
    if not sources:
        return ""
    counts = Counter(sources)
    if set(counts) == {"volume"}:
        return ""
    if set(counts) == {"memory"}:
        return " (from host memory)"
    names = {"memory": "host memory", "peer": "peer", "volume": "volume"}
    parts = [f"{names.get(kind, kind)}: {n} rank{'s' if n != 1 else ''}"
             for kind, n in sorted(counts.items(), key=lambda kv: list(names).index(kv[0])
                                   if kv[0] in names else 9)]
    if counts.get("peer"):
        parts.append(f"{(peer_bytes or 0) / 1e9:.2f} GB from peers")
    return f" ({', '.join(parts)})"
