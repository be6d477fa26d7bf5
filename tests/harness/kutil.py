"""Small helpers over the kubernetes DynamicClient for the server-truth and controller tests.

Waiting is by condition with a generous deadline (a loaded 2-core machine); the tests assert on
what the server and the controllers did, never on how fast.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: How long a controller may take to act on a loaded machine; a wait that runs out fails.
SETTLE_S = 120.0
TRAINER_FAILED = "TrainJobResourcesCreationFailed"
JOB_CREATION_FAILED = "JobCreationFailed"
POD_CREATION_FAILED = "FailedCreatePod"
SERVICE_CREATION_FAILED = "FailedCreateService"


@dataclass
class Verdict:
    """What a checker said of one object: accepted, or refused with a message."""

    accepted: bool
    message: str = ""

    def __str__(self) -> str:
        return "accepted" if self.accepted else f"refused: {self.message}"


def api_message(err: Exception) -> str:
    """The Status message of an ApiException (or the exception text)."""
    body = getattr(err, "body", None)
    try:
        return json.loads(body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(err)


def resource(dyn, obj: dict[str, Any]):
    """The dynamic resource of ``obj``'s apiVersion and kind."""
    return dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])


def submit(dyn, obj: dict[str, Any], namespace: str, dry_run: bool = True) -> Verdict:
    """Create ``obj`` (server-side dry-run, strict field validation unless ``dry_run`` is off).

    Strict field validation is what ``kubectl apply --validate=strict`` asks for and what our
    offline schemas emulate; the server's default only warns about unknown fields.
    """
    from kubernetes.client.exceptions import ApiException
    from kubernetes.dynamic.exceptions import DynamicApiError

    res = resource(dyn, obj)
    params = [("fieldValidation", "Strict")] + ([("dryRun", "All")] if dry_run else [])
    try:
        res.create(body=obj, namespace=namespace if res.namespaced else None,
                   query_params=params)
    except (ApiException, DynamicApiError) as err:
        if getattr(err, "status", 0) in (400, 403, 404, 409, 422):
            return Verdict(False, api_message(err))
        raise
    return Verdict(True)


#: The Trainer webhook's refusal of a TrainJob whose runtime it does not know (yet).
RUNTIME_UNSEEN = "must be created before the TrainJob"


def wait_runtime_seen(dyn, runtime: dict[str, Any], namespace: str) -> None:
    """Wait until the Trainer's TrainJob webhook knows a runtime that was just created.

    The webhook looks runtimes up in the controller manager's informer cache, which trails the
    API server: a TrainJob created right after its runtime can be refused with "specified
    trainingRuntime must be created before the TrainJob" (seen once in CI on a busy box). A
    dry-run TrainJob that names the runtime is refused for that reason until the cache has it.
    """
    probe = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
             "metadata": {"name": f"seen-{uuid.uuid4().hex[:8]}", "namespace": namespace},
             "spec": {"runtimeRef": {"name": runtime["metadata"]["name"],
                                     "kind": runtime["kind"],
                                     "apiGroup": "trainer.kubeflow.org"}}}

    def seen() -> bool:
        verdict = submit(dyn, probe, namespace)
        return verdict.accepted or RUNTIME_UNSEEN not in verdict.message

    wait_for(f"the Trainer webhook to see {runtime['kind']} {runtime['metadata']['name']}", seen)


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = SETTLE_S) -> Any:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout_s:.0f} s "
                                 f"(last: {got!r})")
        time.sleep(0.25)


def items(dyn, api_version: str, kind: str, namespace: str, **kw) -> list[dict[str, Any]]:
    """Objects of one kind in a namespace, as plain dicts."""
    res = dyn.resources.get(api_version=api_version, kind=kind)
    return [i.to_dict() for i in res.get(namespace=namespace, **kw).items]


def warnings_about(dyn, namespace: str, kind: str, name: str, reason: str) -> list[str]:
    """Notes of the Warning events with ``reason`` about one object."""
    out = []
    for e in items(dyn, "events.k8s.io/v1", "Event", namespace):
        reg = e.get("regarding") or {}
        if reg.get("kind") == kind and reg.get("name") == name and e.get("reason") == reason:
            out.append(e.get("note") or "")
    return out


def new_namespace(dyn, prefix: str) -> str:
    """Create a fresh namespace (the ``default`` ServiceAccount appears by itself)."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    dyn.resources.get(api_version="v1", kind="Namespace").create(
        body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def delete_namespace(dyn, name: str) -> None:
    """Delete a namespace and what is in it (in the background: nothing waits on it)."""
    dyn.resources.get(api_version="v1", kind="Namespace").delete(name=name)


#: Warnings a controller emits for a conflict with its own cache, then retries and succeeds: the
#: Trainer re-creating a JobSet it had just created (seen once in CI: "... already exists") or
#: updating a stale copy. They say nothing about the object, so they are no refusal.
TRANSIENT = ("already exists", "the object has been modified")


def _refusals(dyn, namespace: str, kind: str, name: str, reason: str) -> list[str]:
    # Kueue's JobSet webhook refuses a JobSet whose owner TrainJob its cache has not seen yet
    # ('TrainJob.trainer.kubeflow.org "<name>" not found'); the Trainer's next try is accepted.
    stale_owner = f'TrainJob.trainer.kubeflow.org "{name}" not found'
    return [n for n in warnings_about(dyn, namespace, kind, name, reason)
            if not any(t in n for t in (*TRANSIENT, stale_owner))]


def trainjob_outcome(dyn, namespace: str, name: str) -> Verdict:
    """Wait until the controllers accepted (Job ``<name>-node-0`` exists) or refused a TrainJob.

    A refusal is a Warning event: the Trainer's when the JobSet webhook refused the JobSet, the
    JobSet controller's when the API server refused a Job.
    """
    def probe() -> Verdict | None:
        for kind, obj, reason in (("TrainJob", name, TRAINER_FAILED),
                                  ("JobSet", name, JOB_CREATION_FAILED)):
            notes = _refusals(dyn, namespace, kind, obj, reason)
            if notes:
                return Verdict(False, notes[0])
        jobs = items(dyn, "batch/v1", "Job", namespace,
                     label_selector=f"jobset.sigs.k8s.io/jobset-name={name}")
        return Verdict(True) if jobs else None

    return wait_for(f"TrainJob {namespace}/{name} to get a Job or a Warning", probe)


def pytorchjob_outcome(dyn, namespace: str, name: str) -> Verdict:
    """Wait until the operator created a worker Pod and its Service, or said why it could not."""
    def probe() -> Verdict | None:
        for reason in (POD_CREATION_FAILED, SERVICE_CREATION_FAILED):
            notes = _refusals(dyn, namespace, "PyTorchJob", name, reason)
            if notes:
                return Verdict(False, notes[0])
        selector = f"training.kubeflow.org/job-name={name}"
        made = [items(dyn, "v1", kind, namespace, label_selector=selector)
                for kind in ("Pod", "Service")]
        return Verdict(True) if all(made) else None

    return wait_for(f"PyTorchJob {namespace}/{name} to get a Pod and a Service, or a Warning",
                    probe)
