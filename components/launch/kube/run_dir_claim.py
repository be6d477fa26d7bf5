"""The launcher's part of one writer per run dir (:mod:`kfp_nvrx.components.core.run_claim`).

The pods claim the run dir themselves, so two jobs with one run dir are refused wherever they
were launched from (another pipeline, ``kubectl``). Where the launcher sees the volume (the KFP
step mounts the run's PVC), it also claims the run dir before it creates the job, and asks the
cluster about the holder:

- a run dir another job is writing is refused in one line naming that job, before anything is
  created (rather than by the new job's pods, after it was queued and scheduled);
- a claim whose job is gone (deleted, finished) is taken at once, not waited out for its lease:
  a relaunch right after a cancelled run is never blocked by it;
- the launcher renews the claim while the job waits in a Kueue queue (its pods renew it once they
  run) and releases it when the job ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from kfp_nvrx.components.core.ownership import is_run_dir
from kfp_nvrx.components.core.run_claim import (
    RENEWALS_PER_LEASE,
    Claim,
    in_use,
    kube_holder,
    lease_s,
    release,
    renew,
    take,
)
from kfp_nvrx.components.launch.kube import calls
from kfp_nvrx.components.launch.kube.followed import Resource

#: Conditions of a job that ended (TrainJob: Complete/Failed; PyTorchJob: Succeeded/Failed).
_ENDED = ("Complete", "Succeeded", "Failed")


def _ended(job: dict[str, Any]) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(isinstance(c, dict) and c.get("type") in _ENDED and c.get("status") == "True"
               for c in conditions)


def holder_gone(client: Any, holder: Claim, job_kinds: Callable[[], list[Resource]]) -> bool:
    """Whether the job ``holder`` names is gone: no job of that name in any job API, or ended.

    ``job_kinds`` gives the custom resource of every job API (the registry's, read from above:
    :func:`.job_apis.resources`).

    A holder this cluster cannot name (another cluster's, a local run's) or a read that fails is
    not known to be gone: its lease decides.
    """
    ns, _, name = holder.holder.removeprefix("k8s:").partition("/")
    if not holder.holder.startswith("k8s:") or not ns or not name:
        return False
    custom, host = k8s.CustomObjectsApi(client), calls.host_of(client)
    for res in job_kinds():
        try:
            job = calls.call(f"reading {res.kind} {ns}/{name}", host,
                             custom.get_namespaced_custom_object, res.group, res.version, ns,
                             res.plural, name, ok=(403, 404))
        except ApiException as err:
            if err.status == 403:
                return False  # not ours to read: not known to be gone
            continue
        except calls.ClusterError:
            return False
        if isinstance(job, dict) and not _ended(job):
            return False
    return True


class LauncherClaim:
    """The launcher's hold on the run dir of the job it creates (None-safe: see :func:`claim`).

    Args:
        run_dir: The run dir, as the pods and this launcher see it.
        me: The claim (the job's holder id, shared with its pods).
    """

    def __init__(self, run_dir: str, me: Claim) -> None:
        self.run_dir, self.me = run_dir, me
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def keep(self) -> None:
        """Renews the claim until :meth:`end` (the job may wait in a queue for hours)."""
        def renewals() -> None:
            while not self._stop.wait(self.me.lease_s / RENEWALS_PER_LEASE):
                try:
                    if renew(self.run_dir, self.me) is not None:
                        return  # another job took it: the pods will stop, and say so
                except Exception:  # noqa: BLE001 - the volume hiccuped: try again next time
                    continue

        self._thread = threading.Thread(target=renewals, name="run-dir-claim", daemon=True)
        self._thread.start()

    def end(self, job_ended: bool) -> None:
        """Stops renewing; releases the claim when the job has ended (else its pods hold it)."""
        self._stop.set()
        if job_ended:
            release(self.run_dir, self.me)


def claim(run_dir: str, namespace: str, name: str, client: Any, say: Callable[[str], None],
          job_kinds: Callable[[], list[Resource]]) -> LauncherClaim | None:
    """Claims ``run_dir`` for job ``namespace/name`` before it is created; None: not here.

    Only a run dir of ours this launcher sees (a resume): a new run dir is claimed by the pods,
    and nothing is written into a folder that is not a run dir.

    Raises:
        UserError: Naming ``run_dir`` and the job that writes it now.
    """
    if not Path(run_dir).is_dir() or not is_run_dir(run_dir):
        return None
    me = Claim(holder=kube_holder(namespace, name), what=f"job {namespace}/{name}",
               pod="", lease_s=lease_s())
    holder = take(run_dir, me, gone=lambda c: holder_gone(client, c, job_kinds))
    if holder is not None:
        raise in_use(run_dir, holder, "run_dir")
    say(f"claimed {run_dir} for {namespace}/{name} (one job writes a run dir at a time)")
    return LauncherClaim(run_dir, me)
