"""The Kubeflow Trainer v2 ``TrainingRuntime`` our TrainJobs refer to (``kfp-nvrx-ft``).

``images/deploy/base/trainer-runtime.yaml`` is this object as YAML (a test keeps them equal); it is
applied with the rest of the deploy kustomization. It holds only what is the same for every job;
each TrainJob patches in its own volumes, placement and security settings (:mod:`.render`).

Failure handling, the counterpart of the PyTorchJob's ``restartPolicy: ExitCode`` (the table in
docs/eks.md, each row shown on the real controllers by tests/cluster/test_failure_policy.py and
test_train_e2e.py):

* In-job restarts belong to ft_launcher inside each pod; Kubernetes sees nothing.
* The ``node`` Job's ``podFailurePolicy`` (``backoffLimit: 0``), first match wins: a pod with a
  ``DisruptionTarget`` condition (eviction, drain, preemption, node lost) *counts*: the Job fails
  with ``BackoffLimitExceeded``, whatever the exit code (ft_launcher exits 1 on SIGTERM too). An
  exit code 1..127 means ft_launcher decided: it gave up (1: restarts used up), saw no progress
  (93, NVRx 0.7 ``--ft-max-no-progress-cycles``) or the config is bad: ``FailJob``
  (``PodFailurePolicy``). A container killed by a signal (>= 128: OOM kill, SIGKILL, a lost
  machine), stopped (143) or whose ft_launcher lost a peer or the rendezvous host (200: the
  entrypoint ``pod_entry`` tells that 1 from giving up) matches no rule and counts:
  ``BackoffLimitExceeded``.
* The JobSet ``failurePolicy``: ``PodFailurePolicy`` fails the JobSet (and the TrainJob) at once,
  no pointless recreation of a job that already used its in-job restarts; ``BackoffLimitExceeded``
  (infrastructure) recreates every pod, at most :data:`MAX_RESTARTS` times, and the run resumes
  from the newest committed checkpoint; anything else (a deadline) fails it.
"""

from __future__ import annotations

from typing import Any

from kfp_nvrx.components.launch.trainjob.models import manifest, tm, typed

GROUP = "trainer.kubeflow.org"
API_VERSION = f"{GROUP}/v1alpha1"
RUNTIME_KIND = "TrainingRuntime"
#: The cluster-scoped kind: one runtime for every namespace (applied by a cluster admin).
CLUSTER_RUNTIME_KIND = "ClusterTrainingRuntime"
RUNTIME_KINDS = (RUNTIME_KIND, CLUSTER_RUNTIME_KIND)
RUNTIME_NAME = "kfp-nvrx-ft"
#: The torch plugin's replicated job and trainer container names.
REPLICATED_JOB = "node"
CONTAINER_NAME = "node"
IMAGE_PULL_POLICY = "IfNotPresent"
#: Whole-JobSet recreations after infrastructure failures (each resumes from the last checkpoint).
MAX_RESTARTS = 2
#: ft_launcher's own exit codes (gave up 1, no progress 93, bad config); >= 128 is a signal, a
#: stop (143) or a lost peer (200, ``exits.PEER_LOST``).
GAVE_UP_EXIT_CODES = list(range(1, 128))
#: Kubeflow profile namespaces inject Istio sidecars; they break c10d/NCCL bootstrap traffic.
POD_ANNOTATIONS = {"sidecar.istio.io/inject": "false"}
#: The runtime pods' ``terminationGracePeriodSeconds``. A TrainJob sets the grace its resilience
#: settings need in a runtime patch, except a queued one: Kueue v0.17 drops that field when it
#: admits the job (:mod:`.render`), and its pods get this, which must be at least what they need
#: (longer costs nothing: a pod ends when its processes do).
GRACE_PERIOD_S = 300
#: Placeholder image; every TrainJob sets ``trainer.image``.
DEFAULT_IMAGE = "kfp-nvrx-trainer:0.1.0"
#: The node container's command when a TrainJob sets none (the Kubeflow SDK's
#: ``CustomTrainerContainer``): it reads the run from the env and args
#: (:mod:`kfp_nvrx.components.core.runtime_entry`). A rendered TrainJob's ``trainer.command``
#: replaces it.
COMMAND = ["python", "-m", "kfp_nvrx.components.core.runtime_entry"]
#: The shared volume every node mounts unless a TrainJob patches its own claim in (the claim of
#: images/deploy; a runtime patch's volume of the same name replaces its source).
SHARED_CLAIM = "kfp-nvrx-shared"
SHARED_VOLUME, SHARED_MOUNT = "shared", "/fsx"
SHM_VOLUME = "dshm"
#: Downward-API env of the node container. A rendered TrainJob's ``trainer.env`` sets the pod's
#: three again (same values); the TrainJob's name is the JobSet's, on every pod as a label.
_ENV = [("POD_IP", "status.podIP"), ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
        ("KFP_NVRX_TRAINJOB", "metadata.labels['jobset.sigs.k8s.io/jobset-name']")]


def build_runtime(name: str = RUNTIME_NAME, namespace: str = "",
                  kind: str = RUNTIME_KIND) -> dict[str, Any]:
    """Return the runtime as a plain dict (API field names), built from the typed models.

    Args:
        name: Its name.
        namespace: Its namespace (a ``TrainingRuntime`` only; '' = the current one).
        kind: ``TrainingRuntime`` or the cluster-scoped ``ClusterTrainingRuntime`` (same spec).

    """
    meta = tm.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
        name=name, namespace=namespace if namespace and kind == RUNTIME_KIND else None,
        labels={"trainer.kubeflow.org/framework": "torch", "app.kubernetes.io/name": "kfp-nvrx"})
    failure_policy = tm.JobsetV1alpha2FailurePolicy(
        max_restarts=MAX_RESTARTS, restart_strategy="Recreate",
        # Rule names: the JobSet webhook allows ^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$ only
        # (no '-'); it checks them when the Trainer creates the JobSet, long after the runtime
        # and the TrainJob were accepted.
        rules=[tm.JobsetV1alpha2FailurePolicyRule(name="ft_launcher_gave_up", action="FailJobSet",
                                                  on_job_failure_reasons=["PodFailurePolicy"]),
               tm.JobsetV1alpha2FailurePolicyRule(name="infrastructure", action="RestartJobSet",
                                                  on_job_failure_reasons=["BackoffLimitExceeded"]),
               tm.JobsetV1alpha2FailurePolicyRule(name="anything_else", action="FailJobSet")])
    spec = tm.TrainerV1alpha1TrainingRuntimeSpec(
        ml_policy=tm.TrainerV1alpha1MLPolicy(num_nodes=1,
                                             torch=tm.TrainerV1alpha1TorchMLPolicySource()),
        template=tm.TrainerV1alpha1JobSetTemplateSpec(spec=tm.JobsetV1alpha2JobSetSpec(
            replicated_jobs=[_node_job()], failure_policy=failure_policy)))
    model = (tm.TrainerV1alpha1TrainingRuntime if kind == RUNTIME_KIND
             else tm.TrainerV1alpha1ClusterTrainingRuntime)
    return manifest(model(api_version=API_VERSION, kind=kind, metadata=meta, spec=spec))


def _node_job() -> tm.JobsetV1alpha2ReplicatedJob:
    """The ``node`` replicated job: its pod, and which of its failures are final."""
    pod = {
        "metadata": {"annotations": dict(POD_ANNOTATIONS)},
        "spec": {
            # podFailurePolicy requires Never: pod-level retries are the Job controller's.
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": GRACE_PERIOD_S,
            "containers": [_node_container()],
            # What a TrainJob without runtime patches mounts (one made by the Kubeflow SDK).
            "volumes": [
                {"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": SHARED_CLAIM}},
                # NCCL, DataLoader workers and the checkpoint staging buffers use /dev/shm.
                {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
            ],
        },
    }
    template = {
        "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
        "spec": {
            # Every counted failure ends the Job at once: the JobSet decides what follows.
            "backoffLimit": 0,
            "podFailurePolicy": {"rules": [
                # Evicted, drained, preempted, node gone: infrastructure, whatever the exit
                # code (ft_launcher exits 1 on the SIGTERM that precedes an eviction).
                {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget",
                                                     "status": "True"}]},
                # FT: ft_launcher gave up (in-job restarts used up) or saw no progress: final.
                {"action": "FailJob", "onExitCodes": {
                    "containerName": CONTAINER_NAME, "operator": "In",
                    "values": list(GAVE_UP_EXIT_CODES)}},
                # Killed by a signal (OOM, SIGKILL): no rule, counted -> BackoffLimitExceeded.
            ]},
            "template": pod,
        },
    }
    return tm.JobsetV1alpha2ReplicatedJob(
        name=REPLICATED_JOB, template=typed(tm.IoK8sApiBatchV1JobTemplateSpec, template, "runtime"))


def _node_container() -> dict[str, Any]:
    """The trainer container: what a TrainJob that sets only image, env and resources runs."""
    return {
        "name": CONTAINER_NAME, "image": DEFAULT_IMAGE, "imagePullPolicy": IMAGE_PULL_POLICY,
        "command": list(COMMAND),
        "env": [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
                for name, path in _ENV],
        "volumeMounts": [{"name": SHARED_VOLUME, "mountPath": SHARED_MOUNT},
                         {"name": SHM_VOLUME, "mountPath": "/dev/shm"}],
    }
