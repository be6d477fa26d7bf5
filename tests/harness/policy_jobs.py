"""Jobs for the failure-policy tests: ours, with ft_launcher replaced by a shell line.

The jobs are rendered by ``render-job`` (the shipped ``kfp-nvrx-ft`` runtime, the PyTorchJob's
``restartPolicy: ExitCode``, the pods' ``pod_entry`` entrypoint); only the command after the
entrypoint is a shell line that ends the way ft_launcher or the infrastructure would. What the Job
controller, JobSet, the Trainer and the Training Operator then do is real.

Markers on the shared volume, one per pod hostname (stable when a pod is recreated:
``<job>-worker-1``, ``<trainjob>-node-0-1``), let a second attempt succeed, so "restarted" and
"failed" are told apart by the outcome, not by timing. Each pod also holds an ``flock`` on
``<hostname>.lock`` while its processes live; :data:`SURVIVE` watches the other pods' locks and
reacts to a peer whose processes ended (killed, stopped, its node lost) the way ft_launcher does
when it loses a peer or its rendezvous host: NVRx's "Agent run ended with exception" line, exit 1.
"""

from __future__ import annotations

import contextlib

from support.rendering import render_pytorchjob, render_trainjob

from harness.kutil import wait_for
from kfp_nvrx.components.launch.jobspec.pod import POD_ENTRY
from kfp_nvrx.components.launch.jobspec.spec import JobSpec

WAIT_S = 240.0
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
PYTORCHJOB_LABEL = "training.kubeflow.org/job-name"
TRAINER = ("trainer.kubeflow.org", "v1alpha1")
JOBSET = ("jobset.x-k8s.io", "v1alpha2")
KUBEFLOW = ("kubeflow.org", "v1")

#: ft_launcher's last lines (its ``main``; ``tests/integration/test_pod_entry.py`` shows them on
#: the real NVRx).
GAVE_UP = ("[ERROR] Some rank(s) exited with non-zero exit code: {1: ProcessFailure()}. "
           "Agent's exit code = 1")
BROKE = ("[ERROR] Agent run ended with exception, e=RendezvousConnectionError(The connection "
         "to the C10d store has failed). Agent's exit code = 1")

#: A pod's first attempt is the body after it; the second exits 0 at once.
ONCE = "[ -e $m ] && exit 0; touch $m; "
#: A pod's first attempt is the body after it; the second exits 0 once every pod of the job ran
#: a second attempt (so a job that succeeds recreated both pods, whichever API recreates them).
AGAIN = ("[ -e $m ] && { touch $m.done; until [ $$(ls $d/*.done | wc -l) -ge 2 ]; "
         "do sleep 0.2; done; exit 0; }; touch $m; ")
#: This pod's lock, held by its shell while it lives (taken before it is visible under its name).
HOLD = "exec 9>$m.tmp; flock 9; mv $m.tmp $m.lock; "
#: As ft_launcher when a peer pod or the rendezvous host vanishes: once both pods hold their
#: locks, a peer's lock that can be taken means its processes ended.
SURVIVE = ("until [ $$(ls $d/*.lock 2>/dev/null | wc -l) -ge 2 ]; do sleep 0.2; done; "
           "while :; do for f in $d/*.lock; do "
           f"if [ $f != $m.lock ] && flock -n $f true; then echo \"{BROKE}\" >&2; exit 1; fi; "
           "done; sleep 0.2; done")
#: First attempt: run until a peer is lost (or this pod is stopped: ft_launcher exits 1 on
#: SIGTERM, the entrypoint makes that 143); the second succeeds (:data:`AGAIN`).
FT_POD = AGAIN + "trap 'exit 1' TERM; " + HOLD + SURVIVE


def spec(name: str, **kw) -> JobSpec:
    """The tiny CPU job on 2 nodes."""
    return JobSpec(image="kfp-nvrx-trainer:test", pvc="kfp-nvrx-shared", instance_type="cpu",
                   nodes="2", name=name, config="tiny", overrides=["data.path=/fsx/data"], **kw)


def script(body: str, name: str) -> list[str]:
    """The pods' real entrypoint with ``body`` in place of ft_launcher (``$$`` is a literal
    ``$`` after the kubelet's expansion)."""
    return [*POD_ENTRY, "/bin/sh", "-c", f"d=/fsx/policy/{name}; mkdir -p $d; "
            f"m=$d/$$(hostname); {body}"]


def per_node(node0: str, node1: str) -> str:
    """A body that differs by the pod's index (``...-0`` / ``...-1`` hostnames, both APIs)."""
    return f"case $$(hostname) in *-0) {node0};; *) {node1};; esac"


def custom(kube):
    from kubernetes import client

    return client.CustomObjectsApi(kube.client())


def core(kube):
    from kubernetes import client

    return client.CoreV1Api(kube.client())


def get(kube, api: tuple[str, str], plural: str, name: str) -> dict:
    return custom(kube).get_namespaced_custom_object(*api, kube.namespace, plural, name)


def delete(kube, api: tuple[str, str], plural: str, name: str) -> None:
    custom(kube).delete_namespaced_custom_object(*api, kube.namespace, plural, name,
                                                 propagation_policy="Foreground")


def create_trainjob(kube, name: str, body: str, runtime: str = "", **kw) -> None:
    job = (render_trainjob(spec(name, **kw), runtime_name=runtime) if runtime
           else render_trainjob(spec(name, **kw))).to_dict()
    job["spec"]["trainer"]["command"] = script(body, name)
    job["spec"]["trainer"].pop("args", None)
    custom(kube).create_namespaced_custom_object(*TRAINER, kube.namespace, "trainjobs", job)


def conditions(obj: dict) -> dict[str, dict]:
    """The True conditions of an object, or of its ``status``, by type."""
    status = obj["status"] if isinstance(obj.get("status"), dict) else obj
    return {c["type"]: c for c in status.get("conditions") or [] if c["status"] == "True"}


def trainjob_end(kube, name: str) -> tuple[str, dict, int]:
    """Wait for Complete/Failed; return it, the JobSet's status and its restarts."""
    def done():
        conds = conditions(get(kube, TRAINER, "trainjobs", name))
        return next((t for t in ("Complete", "Failed") if t in conds), None)
    outcome = wait_for(f"TrainJob {name} finished", done, WAIT_S)
    status = get(kube, JOBSET, "jobsets", name)["status"]
    return outcome, status, status.get("restarts", 0)


def job_reasons(kube, name: str) -> set[str]:
    """Why the TrainJob's Jobs failed (``PodFailurePolicy``, ``BackoffLimitExceeded``, ...)."""
    from kubernetes import client

    jobs = client.BatchV1Api(kube.client()).list_namespaced_job(
        kube.namespace, label_selector=f"{JOBSET_LABEL}={name}").items
    return {c.reason for j in jobs for c in (j.status.conditions or []) if c.type == "Failed"}


def create_pytorchjob(kube, name: str, body: str, **kw) -> dict:
    job = render_pytorchjob(spec(name, **kw)).to_dict()
    for rs in job["spec"]["pytorchReplicaSpecs"].values():
        rs["template"]["spec"]["containers"][0]["command"] = script(body, name)
        rs["template"]["spec"]["containers"][0].pop("args", None)
    return custom(kube).create_namespaced_custom_object(*KUBEFLOW, kube.namespace, "pytorchjobs",
                                                        job)


def pytorchjob_end(kube, name: str) -> tuple[str, dict]:
    """Wait for Succeeded/Failed; return it and that condition."""
    def done():
        conds = conditions(get(kube, KUBEFLOW, "pytorchjobs", name))
        return next(((t, conds[t]) for t in ("Succeeded", "Failed") if t in conds), None)
    return wait_for(f"PyTorchJob {name} finished", done, WAIT_S)


def running_pods(kube, selector: str, n: int = 2) -> list:
    """Wait for ``n`` running pods of ``selector``; return them sorted by name (node 0 first)."""
    def check():
        pods = [p for p in core(kube).list_namespaced_pod(kube.namespace,
                                                          label_selector=selector).items
                if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
        return sorted(pods, key=lambda p: p.metadata.name) if len(pods) >= n else None
    return wait_for(f"{n} running pods of {selector}", check, WAIT_S)


def holding(kube, name: str, n: int = 2) -> None:
    """Wait until ``n`` pods of job ``name`` hold their locks (their watch has begun)."""
    folder = kube.root / "volumes" / kube.namespace / "kfp-nvrx-shared" / "policy" / name
    wait_for(f"{n} pods of {name} holding their locks",
             lambda: len(list(folder.glob("*.lock"))) >= n or None, WAIT_S)


def stop(kube, pod, how: str) -> None:
    """Evict (``DisruptionTarget``, then SIGTERM) or delete (SIGTERM) ``pod``."""
    from kubernetes import client

    if how == "evict":
        core(kube).create_namespaced_pod_eviction(pod.metadata.name, kube.namespace,
                                                  client.V1Eviction(metadata=client.V1ObjectMeta(
                                                      name=pod.metadata.name,
                                                      namespace=kube.namespace)))
    else:
        core(kube).delete_namespaced_pod(pod.metadata.name, kube.namespace)


def pod_runs(kube, prefix: str) -> dict[str, int]:
    """How many pods of each name the agent ran (a recreated PyTorchJob pod keeps its name;
    the API may no longer show the first one)."""
    import json

    runs: dict[str, int] = {}
    for f in (kube.root / "agent" / "pods").glob("*/pids.json"):
        rec = json.loads(f.read_text())
        if rec["name"].startswith(prefix):
            runs[rec["name"]] = runs.get(rec["name"], 0) + 1
    return runs


@contextlib.contextmanager
def lost_node(kube, pod):
    """The node of ``pod`` stops heartbeating and its processes die; then its Node is deleted
    (what the cloud node controller does for a terminated instance). Registered again after."""
    node = pod.spec.node_name
    control = kube.root / "agent" / "control" / node
    try:
        control.write_text("lost")
        wait_for(f"node {node} lost", lambda: (kube.root / "agent" / "control" /
                                               f"{node}.lost").is_file() or None, 60)
        core(kube).delete_node(node)
        yield node
    finally:
        control.unlink(missing_ok=True)  # the agent registers the node again
        # A node registered again has no conditions until its first status update: not back yet.
        wait_for(f"node {node} back", lambda: any(
            n.metadata.name == node and {c.type: c.status for c in n.status.conditions or []}.get(
                "Ready") == "True" for n in core(kube).list_node().items) or None, 60)
