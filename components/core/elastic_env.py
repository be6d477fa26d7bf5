"""Integers the elastic launcher (torchrun, ft_launcher) gives a worker in its environment.

One reader, two ways to take a value that is no integer, each said where it is read: a worker's
identity and rendezvous (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_PORT``) are never
guessed, so such a value raises; what a record or a count only reports (``GROUP_RANK`` in a
``join`` event, ``TORCHELASTIC_RESTART_COUNT``) reads as the default instead. Imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def env_int(name: str, default: int = 0, env: Mapping[str, str] | None = None, *,
            or_default: bool = False) -> int:
    """The integer in ``name``; ``default`` when it is not set.

    Args:
        name: The variable.
        default: Its value when unset (with ``or_default``: also when empty or no integer).
        env: The environment to read (default: this process's).
        or_default: Read an empty value or one that is no integer as ``default`` instead of
            raising.

    Raises:
        ValueError: The value is no integer (not with ``or_default``).
    """
    environ = os.environ if env is None else env
    if not or_default:
        return int(environ.get(name, default))
    try:
        return int(environ.get(name, "") or default)
    except ValueError:
        return default


#: The agent that started this worker, where the worker's parent is not that agent (a warm start:
#: the worker is forked by the agent's zygote, ``kfp_nvrx.components.training.trainer.handoff``).
AGENT_PID_ENV = "KFP_NVRX_AGENT_PID"


def agent_pid() -> int:
    """The pid of the agent (ft_launcher, torchrun) that started this worker."""
    value = os.environ.get(AGENT_PID_ENV, "")
    return int(value) if value.isdigit() else os.getppid()
