"""The result every launcher backend returns (``kubernetes`` and ``local`` alike)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LaunchResult:
    """What happened to one training job.

    Attributes:
        name: Job name (the PyTorchJob's or TrainJob's, or the local run's).
        backend: ``kubernetes`` or ``local``.
        state: Final state: ``Succeeded``, ``Failed``, ``Cancelled`` or ``DeadlineExceeded``.
        reason: Operator/launcher reason for a non-success state ('' on success).
        run_dir: Where the run directory lives (a path on the shared volume).
        restarts: In-job restarts seen (ft_launcher worker-group restarts / incarnations - 1).
        pod_restarts: Container restarts counted by Kubernetes (0 for local).
        started_at: Unix time the job was created/started.
        finished_at: Unix time it reached its final state.
        last_log_lines: Tail of the failing replica's log (empty on success).
        extra: Backend-specific details.
    """

    name: str
    backend: str
    state: str
    run_dir: str
    reason: str = ""
    restarts: int = 0
    pod_restarts: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    last_log_lines: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def succeeded(self) -> bool:
        """True when the job reached ``Succeeded``."""
        return self.state == "Succeeded"

    @property
    def duration_s(self) -> float:
        """Wall time from start to the final state."""
        return max(0.0, self.finished_at - self.started_at)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        out = dataclasses.asdict(self)
        out["duration_s"] = self.duration_s
        return out
