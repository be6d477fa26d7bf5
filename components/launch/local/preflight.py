"""What is checked on this machine before any local agent starts.

The trainer's own input checks, once, and that ``ft_launcher`` is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from kfp_nvrx.components.core.launch_command import FT_LAUNCHER, TRAINER_MODULE, TrainerArgs
from kfp_nvrx.components.errors import UserError


def preflight(trainer: TrainerArgs, env: dict[str, str] | None = None) -> None:
    """Runs every check a worker makes before training, once, before any agent starts.

    The checks need the trainer's imports (torch for the dataset, the device and the checkpoint's
    model shapes), so they run in a child interpreter (``--check``) rather
    than in this one; bad input there would otherwise fail every worker once per restart.

    Raises:
        UserError: The first failed check, as the trainer reports it.
    """
    proc = subprocess.run([sys.executable, "-m", TRAINER_MODULE, *trainer.argv(), "--check"],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if proc.returncode == 0:
        return
    for line in reversed(proc.stdout.splitlines()):
        try:
            err = json.loads(line)
        except ValueError:
            continue
        if isinstance(err, dict) and {"field", "message"} <= err.keys():
            raise UserError(str(err["field"]), str(err["message"]))
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    # Only a missing module means a missing install; anything else is reported as it is.
    fix = ("install the trainer with pip install 'kfp-nvrx[trainer]'"
           if re.search(r"ModuleNotFoundError|ImportError", proc.stderr)
           else f"run it alone for the traceback: python -m {TRAINER_MODULE} ... --check")
    raise UserError("trainer", f"its input check exited {proc.returncode} ({last[:300]}); {fix}")


def _installed(name: str) -> str:
    """``name``'s script next to this interpreter, else on PATH ('' when neither)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name) or ""


def ft_launcher() -> str:
    """The agent (:data:`FT_LAUNCHER`) next to this interpreter, else on PATH.

    It runs NVRx's ``ft_launcher``, so that must be installed too.

    Raises:
        UserError: Either is not installed.
    """
    for name in ("ft_launcher", FT_LAUNCHER):
        if not _installed(name):
            raise UserError("ft_launcher", f"{name} not found; install the trainer (pip "
                            "install 'kfp-nvrx[trainer]', which brings nvidia-resiliency-ext)")
    return _installed(FT_LAUNCHER)
