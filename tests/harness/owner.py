"""Who owns a test cluster's folder (``CLUSTER_DIR``), and what a new cluster starts from.

Every checkout of one user has the same default folder (``/tmp/kfp-nvrx-cluster-$UID``). A
cluster is owned by its supervisor (the ``flock`` on ``D/lock``) and ``D/owner.json`` names it:
the supervisor's pid and start time and the checkout it runs from. ``up`` from another checkout
refuses a folder a live cluster owns (naming both), instead of taking it over; a new cluster
starts from clean state (no etcd data, no node-agent control files, pods or volumes of an
earlier cluster), and ``down`` removes the etcd data, so no later cluster re-runs old pods.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .procs import alive, start_time

#: This checkout (the repository holding tests/cluster).
CHECKOUT = Path(__file__).resolve().parents[2]
OWNER = "owner.json"
#: What a cluster leaves in its folder, removed before the next one starts (only these names:
#: a folder given as CLUSTER_DIR may hold other things).
STATE = ("etcd", "agent", "volumes", "pki", "apiserver-certs", "trainer", "jobset",
         "training-operator", "kubeconfig", "state.json", "audit-policy.yaml", "logs")


def read_owner(root: Path) -> dict | None:
    """The owner record, when its supervisor still runs (None: no live owner)."""
    try:
        rec = json.loads((root / OWNER).read_text())
        pid, started = int(rec["pid"]), rec.get("started")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rec if alive(pid, started) else None


def describe(rec: dict) -> str:
    """``supervisor pid 123, checkout /src/kfp-nvrx``."""
    return f"supervisor pid {rec.get('pid')}, checkout {rec.get('checkout')}"


def claim(root: Path) -> None:
    """Record this process (the supervisor, holding the lock) as the folder's owner."""
    tmp = root / f".{OWNER}.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "started": start_time(os.getpid()),
                               "checkout": str(CHECKOUT)}))
    os.replace(tmp, root / OWNER)


def clean(root: Path) -> None:
    """Remove what an earlier cluster left (called with the lock held, before anything starts)."""
    for name in STATE:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def stop_hint(root: Path) -> str:
    """How to stop the cluster in ``root`` (the folder named: it need not be the default)."""
    return f"`make cluster-down CLUSTER_DIR={root}`"
