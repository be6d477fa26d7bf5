"""Pods that wait for an object only their user can create: said while waiting, then refused.

A PyTorchJob or TrainJob whose pods name a PersistentVolumeClaim or a Secret that does not exist
waits (``Pending``: the scheduler's "persistentvolumeclaim not found", the kubelet's
``CreateContainerConfigError``) until the job's deadline, 7 days by default. That is bad input, not
a cluster's slowness: the launcher says so the moment a pod shows it, and when the object is still
missing :data:`MISSING_S` later it deletes the job it created and fails in one line naming the
field (``pvc``, ``extra_pvcs``, ``secret_env``). An object created meanwhile lets the job go on.
"""

from __future__ import annotations

from collections.abc import Callable

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob

#: Seconds an object the pods need may be missing before the launch fails.
MISSING_S = 60.0


class MissingWatch:
    """Follows what the pods wait for that does not exist (``Kind name`` strings).

    Args:
        namespace: The job's namespace (for the lines).
        grace_s: Seconds an object may stay missing.
        say: Where the warning goes (once per object).
    """

    def __init__(self, namespace: str, grace_s: float, say: Callable[[str], None]) -> None:
        self.namespace, self.grace_s, self.say = namespace, grace_s, say
        self.since: dict[str, float] = {}

    def check(self, missing: list[str], now: float) -> str | None:
        """The object missing for longer than ``grace_s``, if any (``now``: monotonic)."""
        for gone in set(self.since) - set(missing):  # created meanwhile: the job goes on
            del self.since[gone]
        for what in missing:
            if what not in self.since:
                self.since[what] = now
                self.say(f"warning: the pods wait for {what}, which does not exist in namespace "
                         f"{self.namespace}: create it, or launch with one that exists; this "
                         f"launch fails in {self.grace_s:g} s unless it appears")
            elif now - self.since[what] >= self.grace_s:
                return what
        return None


def missing_error(what: str, namespace: str, job: ResolvedJob, waited_s: float) -> UserError:
    """The one-line error for ``what`` (``Kind name``), naming the field that asked for it."""
    kind, _, name = what.partition(" ")
    field = "secret_env"
    if kind == "PersistentVolumeClaim":
        field = "pvc" if name == job.worker().pvc else "extra_pvcs"
    return UserError(field, f"{kind} {name!r} does not exist in namespace {namespace!r} (the "
                     f"pods waited {waited_s:g} s for it; the job was deleted): create it first, "
                     f"or give one that exists")
