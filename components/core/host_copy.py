"""Where a run's node-local host copy lives (torch-free, for the trainer and the fault drills).

The trainer keeps the newest committed state of each rank in files under
``/dev/shm/kfp-nvrx-<uid>/<run key>/`` (see ``trainer.checkpoint.hostcopy``); the run key is the
hash of the run directory's absolute path, so every worker of a run on a node finds the same one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SHM_ROOT = Path("/dev/shm")


def host_copy_base(root: Path = SHM_ROOT) -> Path:
    """This user's directory of host copies."""
    return Path(root) / f"kfp-nvrx-{os.getuid()}"


def host_copy_dir(run_dir: str | os.PathLike, root: Path = SHM_ROOT) -> Path:
    """The host copy directory of the run in ``run_dir``."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return host_copy_base(root) / key
