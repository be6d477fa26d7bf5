"""The Kubeflow Trainer v2 ``TrainingRuntime`` our TrainJobs refer to (``kfp-nvrx-ft``).

``images/deploy/base/trainer-runtime.yaml`` is this object as YAML (a test keeps them equal); it is
applied with the rest of the deploy kustomization. It holds only what is the same for every job;
each TrainJob patches in its own volumes, placement and security settings (:mod:`.trainjob`).

Failure handling, the counterpart of the PyTorchJob's ``restartPolicy: ExitCode``:

* In-job restarts belong to ft_launcher inside each pod.
* The ``node`` Job's ``podFailurePolicy``: a container killed by a signal (exit code >= 128: OOM
  kill, SIGKILL) or a pod disrupted (node drain, preemption) is *ignored*: the Job controller
  recreates that pod with the same index and its ft_launcher agent re-joins the rendezvous, as
  the operator does for an ExitCode worker. An exit code 1..127 means ft_launcher gave up (its
  restarts are used up, or the config is bad): ``FailJob`` at once, no pod-level retry.
* The JobSet ``failurePolicy`` then recreates the whole JobSet (all pods, possibly on other nodes)
  at most :data:`MAX_RESTARTS` times for that reason (``PodFailurePolicy``), and fails the
  TrainJob for any other Job failure (e.g. an exhausted ``backoffLimit``), so the whole job is
  restarted only after ft_launcher's in-job restarts are used up.
"""

from __future__ import annotations

from typing import Any

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
#: Whole-JobSet recreations after ft_launcher gave up (each starts from the last checkpoint).
MAX_RESTARTS = 2
#: ft_launcher's own exit codes when it gives up; >= 128 is a signal (retry the pod).
GAVE_UP_EXIT_CODES = list(range(1, 128))
#: Kubeflow profile namespaces inject Istio sidecars; they break c10d/NCCL bootstrap traffic.
POD_ANNOTATIONS = {"sidecar.istio.io/inject": "false"}
#: Placeholder image; every TrainJob sets ``trainer.image``.
DEFAULT_IMAGE = "kfp-nvrx-trainer:0.1.0"


def build_runtime(name: str = RUNTIME_NAME, namespace: str = "",
                  kind: str = RUNTIME_KIND) -> dict[str, Any]:
    """Return the runtime as a plain dict (API field names).

    Args:
        name: Its name.
        namespace: Its namespace (a ``TrainingRuntime`` only; '' = the current one).
        kind: ``TrainingRuntime`` or the cluster-scoped ``ClusterTrainingRuntime`` (same spec).

    """
    meta: dict[str, Any] = {"name": name}
    if namespace and kind == RUNTIME_KIND:
        meta["namespace"] = namespace
    meta["labels"] = {"trainer.kubeflow.org/framework": "torch",
                      "app.kubernetes.io/name": "kfp-nvrx"}
    pod = {
        "metadata": {"annotations": dict(POD_ANNOTATIONS)},
        "spec": {
            # podFailurePolicy requires Never: pod-level retries are the Job controller's.
            "restartPolicy": "Never",
            "containers": [{"name": CONTAINER_NAME, "image": DEFAULT_IMAGE,
                            "imagePullPolicy": IMAGE_PULL_POLICY}],
        },
    }
    node_job = {
        "name": REPLICATED_JOB,
        "template": {
            "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
            "spec": {
                # Failures the policy below does not ignore or fail fast end the Job at once.
                "backoffLimit": 0,
                "podFailurePolicy": {"rules": [
                    # FT: ft_launcher gave up (in-job restarts used up): fail, let JobSet decide.
                    {"action": "FailJob", "onExitCodes": {
                        "containerName": CONTAINER_NAME, "operator": "In",
                        "values": list(GAVE_UP_EXIT_CODES)}},
                    # Killed by a signal (OOM, SIGKILL): a new pod re-joins the rendezvous.
                    {"action": "Ignore", "onExitCodes": {
                        "containerName": CONTAINER_NAME, "operator": "NotIn",
                        "values": [0, *GAVE_UP_EXIT_CODES]}},
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                ]},
                "template": pod,
            },
        },
    }
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": meta,
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": {
                "replicatedJobs": [node_job],
                "failurePolicy": {
                    "maxRestarts": MAX_RESTARTS,
                    "restartStrategy": "Recreate",
                    # Rule names: the JobSet webhook allows ^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$
                    # only (no '-'); it checks them when the Trainer creates the JobSet, long
                    # after the runtime and the TrainJob were accepted.
                    "rules": [
                        {"name": "ft_launcher_gave_up", "action": "RestartJobSet",
                         "onJobFailureReasons": ["PodFailurePolicy"]},
                        {"name": "anything_else", "action": "FailJobSet"},
                    ],
                },
            }},
        },
    }
