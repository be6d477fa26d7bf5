"""The worker's job: what every incarnation of this worker shares, and how a worker ends it.

Below every module that uses it: :mod:`.bootstrap` builds the :class:`Job`, :mod:`.train` runs
its incarnations and :mod:`.loop` its steps; :func:`give_up` ends the whole job from any of them.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kfp_nvrx.components.core.elastic_env import agent_pid
from kfp_nvrx.components.training.trainer.stopping import StopWatch

if TYPE_CHECKING:  # the job's parts are built by bootstrap (torch, numpy, NVRx)
    import torch

    from kfp_nvrx.components.core.config import Config
    from kfp_nvrx.components.core.faults import Fault
    from kfp_nvrx.components.training.checkpoint import HostStaging, NvrxWriter
    from kfp_nvrx.components.training.trainer.data import TokenDataset
    from kfp_nvrx.components.training.trainer.resilience import Monitor


@dataclass
class Job:
    """What every incarnation of this worker shares."""

    cfg: Config
    run_dir: Path
    faults: list[Fault]
    data: TokenDataset
    device: torch.device
    monitor: Monitor
    run_id: str = field(default_factory=lambda: os.environ.get("TORCHELASTIC_RUN_ID", ""))
    restart_count: int = 0  # in-job incarnation of this job (rank 0 derives it from events)
    # What checkpointing keeps across in-process restarts: the staging buffer (restore source)
    # and NVRx's writer (its processes, killed on abort, are reaped by a later incarnation).
    staging: HostStaging | None = None
    writer: NvrxWriter | None = None
    # The process's start-up before the first incarnation (seconds per part, in order), when it
    # began (process creation) and when those parts ended: the first ``start`` event adds its own.
    boot: dict[str, float] = field(default_factory=dict)
    boot_origin: float | None = None
    boot_mark: float | None = None
    # Whether this node was asked to stop (SIGTERM with a stop request): save, then exit.
    stop: StopWatch = field(default_factory=lambda: StopWatch(0.0))

    # The job's state changes only through these: its modules read it, none writes it.
    def booted(self, parts: dict[str, float], origin: float) -> None:
        """The process's start-up is over: ``parts`` (seconds each, in order) since ``origin``."""
        self.boot, self.boot_origin, self.boot_mark = parts, origin, time.time()

    def watch_stops(self, stop_save_timeout: float) -> None:
        """A SIGTERM that asks this node to stop is a stop to save for, not a fault, from now."""
        self.stop = StopWatch(stop_save_timeout, on_stop=self.monitor.go_quiet)
        self.stop.install()

    def keep(self, staging: HostStaging | None, writer: NvrxWriter | None) -> None:
        """What the next incarnation's checkpointing starts from (in-process restarts)."""
        self.staging, self.writer = staging, writer

    def counted_restarts(self, count: int) -> None:
        """Rank 0's job-wide count of in-job restarts so far (from the run's events)."""
        self.restart_count = count


def give_up(line: str, stop_timeout: float) -> None:
    """Ends the job, not just this incarnation: says ``line`` and stops this node's agent.

    ``line`` starts with :data:`~kfp_nvrx.components.core.exits.GAVE_UP`, which the pod
    entrypoint and the local launcher read as a final verdict (exit 1, never restarted). Without
    an elastic agent above this worker (no ``TORCHELASTIC_RUN_ID``) it only exits 1.
    """
    print(line, file=sys.stderr, flush=True)
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        os.kill(agent_pid(), signal.SIGTERM)  # FT: the agent stops its workers (this one too)
        time.sleep(stop_timeout + 30)  # stopped by the agent meanwhile
    raise SystemExit(1)
