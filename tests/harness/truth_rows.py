"""The objects of the server-truth test: every shape we render, and bad objects the server refuses.

A bad row is one mutation of a good object (the p5 golden PyTorchJob or TrainJob, the
``kfp-nvrx-ft`` runtime) and says where the real cluster refuses it:

* ``admission``: the API server, with the CRD schema (strict field validation), its CEL rules and
  the controllers' admission webhooks, refuses the create (a server-side dry-run shows it);
* ``controller``: the create is accepted and the refusal comes later, as a Warning event, when a
  controller builds from it: the Trainer when the JobSet webhook refuses the JobSet, the JobSet
  controller when the API server refuses a Job, the Training Operator when it refuses a Pod.

``lenient`` rows are objects the real server accepts and our offline validators refuse on
purpose; the reason is the row's note (also in docs/eks.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from support.golden_specs import IMAGE, golden_specs
from support.rendering import render_pytorchjob, render_trainjob

from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.trainjob.runtime import build_runtime

Mutation = Callable[[dict[str, Any]], Any]


@dataclass(frozen=True)
class Row:
    """One bad object: what to change, which object the server judges, where it refuses."""

    id: str
    api: str  # pytorchjob | trainjob | runtime
    stage: str  # admission | controller
    job: Mutation | None = None
    runtime: Mutation | None = None
    lenient: str = ""


def base_pytorchjob() -> dict[str, Any]:
    """The p5 golden PyTorchJob (4 workers, GPUs, EFA, hugepages)."""
    return render_pytorchjob(golden_specs("pytorchjob", "4")["pytorchjob_p5.yaml"]).to_dict()


def base_trainjob() -> dict[str, Any]:
    """The p5 golden TrainJob (4 nodes) referring to TrainingRuntime ``kfp-nvrx-ft``."""
    return render_trainjob(golden_specs("trainjob", "4")["trainjob_p5.yaml"]).to_dict()


def base_runtime() -> dict[str, Any]:
    """The runtime we ship."""
    return build_runtime()


# -- where things are ------------------------------------------------------------------------

def _wpod(j: dict) -> dict:
    return j["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


def _wc(j: dict) -> dict:
    return _wpod(j)["containers"][0]


def _tr(j: dict) -> dict:
    return j["spec"]["trainer"]


def _patch(j: dict) -> dict:
    return j["spec"]["runtimePatches"][0]


def _ppod(j: dict) -> dict:
    return _patch(j)["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]


def _rjob(r: dict) -> dict:
    return r["spec"]["template"]["spec"]["replicatedJobs"][0]


def _rpod(r: dict) -> dict:
    return _rjob(r)["template"]["spec"]["template"]["spec"]


def _pfp(r: dict) -> list:
    return _rjob(r)["template"]["spec"]["podFailurePolicy"]["rules"]


def _exit_rule(r: dict) -> dict:
    """The podFailurePolicy rule on exit codes (after the DisruptionTarget rule)."""
    return next(rule for rule in _pfp(r) if "onExitCodes" in rule)


def _codes(r: dict) -> dict:
    """The first exit-code rule of the node Job's podFailurePolicy."""
    return next(rule for rule in _pfp(r) if "onExitCodes" in rule)["onExitCodes"]


def _fp(r: dict) -> dict:
    return r["spec"]["template"]["spec"]["failurePolicy"]


def _master(j: dict, replicas: int) -> None:
    master = copy.deepcopy(j["spec"]["pytorchReplicaSpecs"]["Worker"])
    master["replicas"] = replicas
    j["spec"]["pytorchReplicaSpecs"]["Master"] = master


def _set(d: dict, **kw: Any) -> None:
    d.update(kw)


ROWS: list[Row] = [
    # -- PyTorchJob: the CRD schema, CEL and the Training Operator webhook ---------------------
    Row("pj-name-not-dns1035", "pytorchjob", "admission", lambda j: _set(j["metadata"],
                                                                         name="bad.name")),
    Row("pj-name-64", "pytorchjob", "admission", lambda j: _set(j["metadata"], name="a" * 64)),
    Row("pj-unknown-field", "pytorchjob", "admission",
        lambda j: _set(j["spec"]["elasticPolicy"], rdzvBackendd="c10d")),
    Row("pj-replica-type-chief", "pytorchjob", "admission",
        lambda j: _set(j["spec"]["pytorchReplicaSpecs"],
                       Chief=copy.deepcopy(j["spec"]["pytorchReplicaSpecs"]["Worker"]))),
    Row("pj-no-pytorch-container", "pytorchjob", "admission", lambda j: _set(_wc(j),
                                                                             name="trainer")),
    Row("pj-container-without-image", "pytorchjob", "admission", lambda j: _wc(j).pop("image")),
    Row("pj-two-masters", "pytorchjob", "admission", lambda j: _master(j, 2)),
    Row("pj-restart-policy-unknown", "pytorchjob", "controller",
        lambda j: _set(j["spec"]["pytorchReplicaSpecs"]["Worker"], restartPolicy="Sometimes")),
    Row("pj-elastic-min-over-max", "pytorchjob", "admission",
        lambda j: _set(j["spec"]["elasticPolicy"], minReplicas=5),
        lenient="the v1.9 webhook does not compare min and max; the pods would get "
                "PET_NNODES=5:4, which ft_launcher refuses at start"),
    Row("pj-elastic-nproc-twice", "pytorchjob", "admission",
        lambda j: _set(j["spec"]["elasticPolicy"], nProcPerNode=8)),
    Row("pj-clean-pod-policy-unknown", "pytorchjob", "admission",
        lambda j: _set(j["spec"]["runPolicy"], cleanPodPolicy="Some"),
        lenient="neither the CRD (no enum) nor the v1.9 webhook checks it; the operator would "
                "leave the pods of a finished job running"),
    Row("pj-backoff-limit-negative", "pytorchjob", "admission",
        lambda j: _set(j["spec"]["runPolicy"], backoffLimit=-1),
        lenient="neither the CRD (no minimum) nor the v1.9 webhook checks it"),
    Row("pj-replicas-not-int", "pytorchjob", "admission",
        lambda j: _set(j["spec"]["pytorchReplicaSpecs"]["Worker"], replicas="four")),
    Row("pj-managed-by-unknown", "pytorchjob", "admission",
        lambda j: _set(j["spec"]["runPolicy"], managedBy="example.com/other")),
    Row("pj-no-replica-specs", "pytorchjob", "admission",
        lambda j: _set(j["spec"], pytorchReplicaSpecs={})),
    # -- PyTorchJob: accepted, then the API server refuses the operator's Pod -----------------
    Row("pj-gpu-limit-not-request", "pytorchjob", "controller",
        lambda j: _set(_wc(j)["resources"]["limits"], **{"nvidia.com/gpu": "4"})),
    Row("pj-mount-without-volume", "pytorchjob", "controller",
        lambda j: _wc(j)["volumeMounts"].append({"name": "nope", "mountPath": "/nope"})),
    Row("pj-mount-path-twice", "pytorchjob", "admission",
        lambda j: _wc(j)["volumeMounts"].append({"name": "shared", "mountPath": "/dev/shm"})),
    Row("pj-hugepages-without-cpu-memory", "pytorchjob", "controller",
        lambda j: [_wc(j)["resources"]["requests"].pop(k) for k in ("cpu", "memory")]),
    Row("pj-name-60-service-too-long", "pytorchjob", "controller",
        lambda j: _set(j["metadata"], name="a" * 60)),  # Service a..-worker-0: 69 characters
    Row("pj-env-twice", "pytorchjob", "admission",  # the CRD's list-map key
        lambda j: _wc(j)["env"].append({"name": "NCCL_DEBUG", "value": "INFO"})),
    # -- TrainJob: the CRD schema, CEL and the Trainer webhook -----------------------------------
    Row("tj-name-not-dns1035", "trainjob", "admission", lambda j: _set(j["metadata"],
                                                                       name="bad.name")),
    Row("tj-name-64", "trainjob", "admission", lambda j: _set(j["metadata"], name="a" * 64)),
    Row("tj-env-pet-nnodes", "trainjob", "admission",
        lambda j: _tr(j)["env"].append({"name": "PET_NNODES", "value": "3"})),
    Row("tj-env-pet-master-addr", "trainjob", "admission",
        lambda j: _tr(j)["env"].append({"name": "PET_MASTER_ADDR", "value": "x"})),
    Row("tj-runtime-missing", "trainjob", "admission",
        lambda j: _set(j["spec"]["runtimeRef"], name="no-such-runtime")),
    Row("tj-runtime-kind-unknown", "trainjob", "admission",
        lambda j: _set(j["spec"]["runtimeRef"], kind="Runtime")),
    Row("tj-runtime-group-unknown", "trainjob", "admission",
        lambda j: _set(j["spec"]["runtimeRef"], apiGroup="example.com")),
    Row("tj-patch-unknown-job", "trainjob", "controller",
        lambda j: _set(_patch(j)["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0],
                       name="worker")),
    Row("tj-patch-unknown-container", "trainjob", "controller",
        lambda j: _ppod(j)["containers"].append({"name": "sidecar"})),
    Row("tj-patch-node-env", "trainjob", "admission",
        lambda j: _set(_ppod(j)["containers"][0], env=[{"name": "A", "value": "b"}])),
    Row("tj-patch-manager-not-a-path", "trainjob", "admission",
        lambda j: _set(_patch(j), manager="not a path")),
    Row("tj-num-nodes-zero", "trainjob", "controller", lambda j: _set(_tr(j), numNodes=0),
        lenient="the CRD has no minimum and no webhook checks it: the controllers build a Job "
                "of 0 completions, a TrainJob that runs nothing"),
    Row("tj-unknown-field", "trainjob", "admission", lambda j: _set(_tr(j), numNodess=2)),
    Row("tj-managed-by-unknown", "trainjob", "admission",
        lambda j: _set(j["spec"], managedBy="example.com/other")),
    Row("tj-deadline-zero", "trainjob", "admission",
        lambda j: _set(j["spec"], activeDeadlineSeconds=0)),
    # -- TrainJob: accepted, then the JobSet webhook or the Job API refuses --------------------
    Row("tj-name-49-pod-names-too-long", "trainjob", "controller",
        lambda j: _set(j["metadata"], name="a" * 49)),
    Row("tj-gpu-limit-not-request", "trainjob", "controller",
        lambda j: _set(_tr(j)["resourcesPerNode"]["limits"], **{"nvidia.com/gpu": "4"})),
    Row("tj-mount-without-volume", "trainjob", "controller",
        lambda j: _ppod(j)["containers"][0]["volumeMounts"].append(
            {"name": "nope", "mountPath": "/nope"})),
    Row("rt-rule-name-dash", "trainjob", "controller",
        runtime=lambda r: _set(_fp(r)["rules"][0], name="gave-up")),
    Row("rt-rule-names-twice", "trainjob", "controller",
        runtime=lambda r: _set(_fp(r)["rules"][1], name=_fp(r)["rules"][0]["name"])),
    Row("rt-failure-reason-unknown", "trainjob", "controller",
        runtime=lambda r: _set(_fp(r)["rules"][0], onJobFailureReasons=["PodFailed"])),
    Row("rt-in-place-restart-gated", "trainjob", "controller",
        runtime=lambda r: _set(_fp(r), restartStrategy="InPlaceRestart")),
    Row("rt-restart-job-gated", "trainjob", "controller",
        runtime=lambda r: _set(_fp(r)["rules"][0], action="RestartJob")),
    Row("rt-pfp-in-zero", "trainjob", "controller",
        runtime=lambda r: _exit_rule(r)["onExitCodes"]["values"].insert(0, 0)),
    Row("rt-pfp-unordered", "trainjob", "controller",
        runtime=lambda r: _exit_rule(r)["onExitCodes"]["values"].reverse()),
    Row("rt-pfp-unknown-container", "trainjob", "controller",
        runtime=lambda r: _set(_exit_rule(r)["onExitCodes"], containerName="trainer")),
    Row("rt-pfp-on-failure-restarts", "trainjob", "controller",
        runtime=lambda r: _set(_rpod(r), restartPolicy="OnFailure")),
    # -- the runtime itself: CRD schema, CEL and the TrainingRuntime webhook -------------------
    Row("rt-trainer-replicas-2", "runtime", "admission", runtime=lambda r: _set(_rjob(r),
                                                                                 replicas=2)),
    Row("rt-no-node-container", "runtime", "admission",
        runtime=lambda r: _set(_rpod(r)["containers"][0], name="main")),
    Row("rt-two-ml-policies", "runtime", "admission",
        runtime=lambda r: _set(r["spec"]["mlPolicy"], mpi={})),
    Row("rt-env-injection-node", "runtime", "admission",
        runtime=lambda r: _set(r["spec"]["mlPolicy"]["torch"], envInjection={"targets": [
            {"jobName": "node", "containerNames": ["node"]}]})),
    Row("rt-unknown-field", "runtime", "admission",
        runtime=lambda r: _set(r["spec"]["mlPolicy"], elastic={})),
    Row("rt-restart-strategy-unknown", "runtime", "admission",
        runtime=lambda r: _set(_fp(r), restartStrategy="Sometimes")),
]


# -- the shapes render-job produces -----------------------------------------------------------

NODES = (1, 2, 8, 16)
PROFILES = ("p5.48xlarge", "p4d.24xlarge", "cpu")
OPTIONS = ("plain", "secrets", "placement")


def shape_spec(nodes: int | str, profile: str, option: str, api: str) -> JobSpec:
    """One render-job shape (a unique derived name per shape: run id from the shape)."""
    extra: dict[str, Any] = {}
    if option == "secrets":
        extra = dict(secret_env=["HF_TOKEN=hf-token:token", "WANDB_API_KEY=wandb:key"],
                     env={"MY_FLAG": "1", "FI_PROVIDER": "efa"})
    if option == "placement":
        extra = dict(node_selector={"karpenter.sh/capacity-type": "on-demand"},
                     tolerations=[{"key": "team", "operator": "Equal", "value": "ml",
                                   "effect": "NoSchedule"}], fs_group=1000,
                     service_account="trainer", extra_pvcs=["models:/models:ro", "scratch:/s"],
                     affinity={"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                                                   [{"labelSelector": {"matchLabels": {
                                                       "app.kubernetes.io/name": "kfp-nvrx"}},
                                                     "topologyKey": "kubernetes.io/hostname"}]}})
        if api == "pytorchjob":  # what a TrainJob cannot carry (refused with one line there)
            extra.update(pod_priority_class="training-high", scheduler_name="default-scheduler")
    return JobSpec(image=IMAGE, pvc="fsx", run_id=f"{api}-{nodes}-{profile}-{option}",
                   task="train-fsdp", nodes=str(nodes), instance_type=profile, **extra)


#: What the real server's refusal says, per row: the row is refused for the reason it is about.
EXPECT = {
    "pj-name-not-dns1035": "a DNS-1035 label must consist of",
    "pj-name-64": "must be no more than 63 characters",
    "pj-unknown-field": 'unknown field "spec.elasticPolicy.rdzvBackendd"',
    "pj-replica-type-chief": 'Unsupported value: "Chief"',
    "pj-no-pytorch-container": "must have at least one container with name pytorch",
    "pj-container-without-image": "containers[0].image: Required value",
    "pj-two-masters": "pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1",
    "pj-restart-policy-unknown": 'spec.restartPolicy: Unsupported value: "Sometimes"',
    "pj-elastic-nproc-twice": "must not be used with spec.nprocPerNode",
    # Kueue's mutating webhook (every PyTorchJob create, Fail policy) decodes the object before
    # the API server checks its schema ("replicas in body must be of type integer" without it).
    "pj-replicas-not-int": "cannot unmarshal string into Go struct field ReplicaSpec"
                           ".spec.pytorchReplicaSpecs.replicas of type int32",
    "pj-managed-by-unknown": 'managedBy: Unsupported value: "example.com/other"',
    # The webhook sees the Worker spec gone before the empty map.
    "pj-no-replica-specs": "must be configured if elastic policy is used",
    "pj-gpu-limit-not-request": "must be equal to nvidia.com/gpu limit of 4",
    "pj-mount-without-volume": 'volumeMounts[2].name: Not found: "nope"',
    "pj-mount-path-twice": 'Duplicate value: {"mountPath":"/dev/shm"}',
    "pj-hugepages-without-cpu-memory": "HugePages require cpu or memory",
    "pj-name-60-service-too-long": "-worker-0\": must be no more than 63 characters",
    "pj-env-twice": 'Duplicate value: {"name":"NCCL_DEBUG"}',
    "tj-name-not-dns1035": "metadata.name must match RFC 1035 DNS label format",
    "tj-name-64": "metadata.name must be no more than 63 characters",
    "tj-env-pet-nnodes": "must not have reserved envs, invalid envs configured: [PET_NNODES]",
    "tj-env-pet-master-addr": "invalid envs configured: [PET_MASTER_ADDR]",
    # Two validating webhooks refuse it, in no set order: the Trainer's, and Kueue's (v0.17 builds
    # the JobSet of every TrainJob it validates from the runtime).
    "tj-runtime-missing": ("specified trainingRuntime must be created before the TrainJob",
                           "runtime 'no-such-runtime' not found"),
    "tj-runtime-kind-unknown": "unsupported runtime: Runtime.trainer.kubeflow.org",
    "tj-runtime-group-unknown": "unsupported runtime: TrainingRuntime.example.com",
    # The webhook's own "doesn't exist in the runtime" checks do not fire (it validates the
    # merged template): the Job API refuses the image-less job or container instead.
    "tj-patch-unknown-job": '"tj-patch-unknown-job-worker-0" is invalid: spec.template.spec.'
                            'containers[0].image: Required value',
    "tj-patch-unknown-container": "containers[1].image: Required value",
    "tj-patch-node-env": "must not have envs for the dataset-initializer, model-initializer, node",
    "tj-patch-manager-not-a-path": "must be a domain-prefixed path",
    "tj-unknown-field": 'unknown field "spec.trainer.numNodess"',
    "tj-managed-by-unknown": "ManagedBy must be trainer.kubeflow.org/trainjob-controller",
    "tj-deadline-zero": "activeDeadlineSeconds in body should be greater than or equal to 1",
    "tj-name-49-pod-names-too-long": "pod names generated for this JobSet will exceed 63",
    "tj-gpu-limit-not-request": "must be equal to nvidia.com/gpu limit of 4",
    "tj-mount-without-volume": 'volumeMounts[2].name: Not found: "nope"',
    "rt-rule-name-dash": "invalid failure policy rule name 'gave-up'",
    "rt-rule-names-twice": "rule names are not unique",
    "rt-failure-reason-unknown": "invalid job failure reason 'PodFailed'",
    "rt-in-place-restart-gated": "InPlaceRestart feature gate is disabled",
    "rt-restart-job-gated": "when RestartJob feature gate is disabled",
    "rt-pfp-in-zero": "must not be 0 for the In operator",
    "rt-pfp-unordered": "must be ordered",
    "rt-pfp-unknown-container": "must be one of the container or initContainer names",
    "rt-pfp-on-failure-restarts": 'only "Never" is supported when podFailurePolicy is specified',
    "rt-trainer-replicas-2": "replicas: Invalid value: 2: always must be 1",
    "rt-no-node-container": "must contain the required container for the ancestor: trainer",
    "rt-two-ml-policies": "Only one of the policy can be configured",
    "rt-env-injection-node": "containerNames must not include the main node container",
    "rt-unknown-field": 'unknown field "spec.mlPolicy.elastic"',
    "rt-restart-strategy-unknown": 'restartStrategy: Unsupported value: "Sometimes"',
}
