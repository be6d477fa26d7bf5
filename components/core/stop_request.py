"""A stop asked of a node (SIGTERM: preemption, a drain, a deleted pod): its workers save first.

ft_launcher answers every stop of its workers with SIGTERM: when it restarts them because a peer
failed, and when its own pod was asked to stop. Only the second should save (a peer is gone in
the first: a collective save would wait for it), and only the node's entry point knows which: on
SIGTERM it writes this node's *stop request* (the time by which ft_launcher will SIGKILL the
workers) before it forwards the signal (:mod:`.pod_entry`; ``launch-local`` does the same when it
is cancelled or its deadline passes). A worker whose SIGTERM finds the request saves the newest
state it can in the time left and exits; one that finds none exits at once, as before.

The request is a small JSON file whose path each worker finds in :data:`STOP_FILE_ENV`. Imports
no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from kfp_nvrx.components.core.bounded import read_json
from kfp_nvrx.components.errors import UserError

#: The environment variable naming this node's stop request file.
STOP_FILE_ENV = "KFP_NVRX_STOP_FILE"
#: Seconds before ft_launcher's SIGKILL by which the workers' save must be over (their exit and
#: the process teardown come after it).
SAVE_MARGIN_S = 3.0


def stop_file(directory: str | os.PathLike[str], name: str) -> Path:
    """Where a node's stop request goes (a fresh name per node and launch)."""
    return Path(directory) / f"kfp-nvrx-stop-{name}.json"


def request_stop(path: str | os.PathLike[str], seconds_left: float) -> None:
    """Records that this node was asked to stop; its workers have ``seconds_left`` to save.

    Safe in a signal handler (one small write and a rename); an unwritable path is ignored: the
    workers then stop without saving, as before.
    """
    path = Path(path)
    body = json.dumps({"deadline": time.time() + max(0.0, seconds_left), "pid": os.getpid()})
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(OSError):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(body)
        os.replace(tmp, path)


def read_stop(path: str | os.PathLike[str] | None) -> float | None:
    """The deadline (Unix seconds) of this node's stop request; None when there is none."""
    if not path or not os.path.lexists(path):
        return None
    try:
        data = read_json(path, "stop request", limit=4096)
    except UserError:
        return None
    deadline = data.get("deadline") if isinstance(data, dict) else None
    return float(deadline) if isinstance(deadline, (int, float)) else None


def withdraw_stop(path: str | os.PathLike[str] | None) -> None:
    """Removes a stop request (the node's run is over)."""
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)
