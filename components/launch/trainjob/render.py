"""``ResolvedJob`` -> Kubeflow Trainer v2 ``TrainJob`` (trainer.kubeflow.org/v1alpha1), validated.

The same resolved job means the same job as the PyTorchJob of :mod:`..pytorchjob.render`: the
worker pod is built by the same code (:mod:`..jobspec.pod`) and then split the way v2 wants it:

* ``spec.trainer`` takes image, command, env, node count, processes per node and resources;
* ``spec.runtimePatches`` takes what v2 lets a TrainJob change in the runtime's pod template:
  volumes and mounts (shared volume, /dev/shm, extra PVCs), node selector, tolerations, affinity,
  security contexts (``IPC_LOCK`` for EFA, ``fsGroup``), service account, grace period, labels and
  the Istio opt-out;
* everything else comes from the runtime we ship (:mod:`.runtime`, ``images/deploy``): the
  ``node`` replicated job, its pod failure policy and the JobSet failure policy.

v2 has no elastic policy and injects no rendezvous settings: the command gets the c10d endpoint
``$(PET_MASTER_ADDR):$(PET_MASTER_PORT)`` (node 0's stable DNS name, port 29500) and the TrainJob
name as rendezvous id, from the one ft_launcher command builder. What v2 cannot express is refused
with a one-line error naming the field.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any

import yaml

from kfp_nvrx.components.core.launch_command import pod_grace_period_s
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.job_api import Rendered
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec.pod import (
    job_annotations,
    labels,
    pod_spec,
    to_dict,
    trainer_command,
)
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
from kfp_nvrx.components.launch.jobspec.spec import JobSpec, check_resource_name
from kfp_nvrx.components.launch.trainjob import runtime as rt
from kfp_nvrx.components.launch.trainjob.models import manifest, tm, typed
from kfp_nvrx.components.launch.trainjob.validate import PLUGIN_ENV, validate_trainjob
from kfp_nvrx.components.launch.trainjob.validate_jobset import POD_SUFFIX

KIND = "TrainJob"
#: Owner of our runtime patch (``runtimePatches`` is a map keyed by manager).
PATCH_MANAGER = "kfp-nvrx.io/jobspec"
#: Pod fields a runtime patch may set (the v2.3.0 CRD's patch schema), in the rendered order.
_PATCHABLE_POD = ("affinity", "nodeSelector", "securityContext", "serviceAccountName",
                  "terminationGracePeriodSeconds", "tolerations", "volumes")


def rdzv_endpoint() -> str:
    """c10d endpoint from what the torch plugin injects (node 0's headless-Service DNS name)."""
    return "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"


def _default(name: str) -> Any:
    field = next(f for f in fields(JobSpec) if f.name == name)
    return field.default


def refuse(job: ResolvedJob, runtime_name: str = rt.RUNTIME_NAME,
           runtime_kind: str = rt.RUNTIME_KIND) -> None:
    """Raise UserError for what a TrainJob cannot express (one line, naming the field).

    Args:
        job: The resolved job.
        runtime_name: The runtime the TrainJob would refer to.
        runtime_kind: ``TrainingRuntime`` or ``ClusterTrainingRuntime``.
    """
    pod = job.worker()
    if job.elastic:
        raise UserError("nodes", f"'{job.min_nodes}:{job.max_nodes}': Trainer v2 has no elastic "
                        "policy (fixed node count); use `nodes=N`, or `job_api=pytorchjob` for "
                        "MIN:MAX")
    if pod.pod_priority_class:
        raise UserError("pod_priority_class", "a TrainJob cannot set priorityClassName (v2 runtime "
                        "patches do not carry it); set it in the TrainingRuntime or use "
                        "`job_api=pytorchjob`")
    if pod.scheduler_name:
        raise UserError("scheduler_name", "a TrainJob cannot set schedulerName (v2 runtime "
                        "patches do not carry it); set it in the TrainingRuntime or use "
                        "`job_api=pytorchjob`")
    if pod.pull_policy != rt.IMAGE_PULL_POLICY:
        raise UserError("image_pull_policy", f"a TrainJob takes the pull policy from the "
                        f"TrainingRuntime ({rt.IMAGE_PULL_POLICY}); edit the runtime instead")
    if pod.ttl_after_finished_s != _default("ttl_after_finished_s"):
        raise UserError("ttl_after_finished_s", "a TrainJob has no TTL; `delete_after` "
                        "removes it, or use `job_api=pytorchjob`")
    if pod.backoff_limit != _default("backoff_limit"):
        raise UserError("backoff_limit", "whole-job restarts of a TrainJob come from the "
                        f"runtime's failurePolicy.maxRestarts ({rt.MAX_RESTARTS}); edit the "
                        "runtime instead")
    for name, _ in job.user_env:
        if name in PLUGIN_ENV:
            raise UserError("env", f"{name} is injected by Trainer v2's torch plugin; the "
                            "TrainJob webhook rejects it")
    check_resource_name("runtime", runtime_name)
    check_runtime_kind(runtime_kind)
    check_name(job.name, job.max_nodes)
    _refuse_queued_grace(job)


def _refuse_queued_grace(job: ResolvedJob) -> None:
    """A queued TrainJob's pods get the runtime's grace period: refuse a job that needs another.

    Kueue v0.17 is built with Trainer v2.2 API types, which have no
    ``runtimePatches[].…podSpec.terminationGracePeriodSeconds`` (new in v2.3): when it admits a
    TrainJob it writes the job back without that field. Its pods never get it: a JobSet made
    after the admission lacks it, and one made before is changed by the Trainer while suspended,
    which the JobSet webhook refuses ("field is immutable"): that job is admitted and never
    starts (both seen on the real controllers, tests/cluster/test_kueue.py).
    A queued TrainJob therefore carries no grace period of its own and takes the runtime's
    (:data:`.runtime.GRACE_PERIOD_S`), which must cover what its settings need.
    """
    if job.queue is None:
        return
    needs = pod_grace_period_s(job.config.resilience)
    if needs > rt.GRACE_PERIOD_S:
        raise UserError("queue_name", f"a queued TrainJob's pods get the runtime's grace period "
                        f"({rt.GRACE_PERIOD_S} s: Kueue v0.17 drops a TrainJob's own when it "
                        f"admits it), but this job's resilience settings need {needs} s; shorten "
                        "the resilience stop timeouts or use `job_api=pytorchjob`")


def check_name(name: str, nodes: int) -> None:
    """Raise UserError naming ``name`` unless the JobSet-derived names stay valid.

    The JobSet is named after the TrainJob and the headless Service is ``<name>``; the JobSet
    webhook refuses a JobSet whose longest pod name ``<name>-node-0-<index>-<5 characters>`` (the
    Job controller's suffix) is not a DNS-1035 label of at most 63 characters, when the Trainer
    creates it: the TrainJob itself would be accepted and never start.
    """
    if not naming.DNS1035.match(name) or len(name) > naming.MAX_LABEL:
        raise UserError("name", f"{name!r} is not a DNS-1035 label of at most "
                        f"{naming.MAX_LABEL} characters (lower-case letters, digits and '-', "
                        "starting with a letter)")
    longest = f"{name}-{rt.REPLICATED_JOB}-0-{nodes - 1}{POD_SUFFIX}"
    if len(longest) > naming.MAX_LABEL:
        most = len(name) - (len(longest) - naming.MAX_LABEL)
        raise UserError("name", f"{name!r} is too long: the JobSet's pod names "
                        f"{longest[:-len(POD_SUFFIX)]}-xxxxx would exceed {naming.MAX_LABEL} "
                        f"characters; use at most {most}")


@dataclass
class RenderedTrainJob(Rendered):
    """A built TrainJob (plain dict in API field names), its runtime and the resolved job."""

    job: dict[str, Any]
    runtime: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """Return a copy of the TrainJob manifest."""
        return copy.deepcopy(self.job)

    def to_yaml(self, with_runtime: bool = False) -> str:
        """Return the TrainJob as YAML; with the runtime it refers to first when asked."""
        docs = [self.runtime, self.job] if with_runtime else [self.job]
        return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)

    def describe(self) -> str:
        """Nodes, processes, the runtime it refers to and the run dir."""
        job, ref = self.resolved, self.job["spec"]["runtimeRef"]
        return (f"{job.max_nodes} x {job.worker().profile.name} ({job.procs_per_node} procs "
                f"each), runtime {ref['kind']}/{ref['name']}, run dir {job.run_dir}")


def _split_pod(pod: dict[str, Any]) -> tuple[dict, dict]:
    """Split a worker pod spec into (trainer, pod patch); refuse fields v2 cannot carry."""
    (container,) = pod.pop("containers")
    if container.get("imagePullPolicy", rt.IMAGE_PULL_POLICY) != rt.IMAGE_PULL_POLICY:
        raise UserError("image_pull_policy", f"the TrainingRuntime sets {rt.IMAGE_PULL_POLICY}")
    trainer = {"image": container["image"], "command": container["command"], "env": container["env"],
               "resourcesPerNode": container["resources"]}
    patch_c: dict[str, Any] = {"name": rt.CONTAINER_NAME,
                               "volumeMounts": container["volumeMounts"]}
    if container.get("securityContext"):
        patch_c["securityContext"] = container["securityContext"]
    # ports: the torch plugin opens 29500 itself; name/command/pull policy: set above/runtime.
    left = set(container) - {"name", "image", "imagePullPolicy", "command", "env", "resources",
                             "volumeMounts", "securityContext", "ports"}
    left |= set(pod) - set(_PATCHABLE_POD)
    if left:
        raise UserError(f"pod.{sorted(left)[0]}", "cannot be set on a TrainJob (v2 runtime "
                        "patches do not carry it); use `job_api=pytorchjob`")
    patch = {"containers": [patch_c], **{k: pod[k] for k in _PATCHABLE_POD if k in pod}}
    return trainer, patch


def _trainer(job: ResolvedJob, trainer: dict[str, Any]) -> tm.TrainerV1alpha1Trainer:
    """``spec.trainer``: the container's image, command, env and resources, and the shape."""
    return tm.TrainerV1alpha1Trainer(
        image=trainer["image"], command=trainer["command"],
        env=[typed(tm.IoK8sApiCoreV1EnvVar, e, "env") for e in trainer["env"]],
        resources_per_node=typed(tm.IoK8sApiCoreV1ResourceRequirements,
                                 trainer["resourcesPerNode"], "resources"),
        num_nodes=job.max_nodes, num_proc_per_node=job.procs_per_node)


def _runtime_patch(pod_template: dict[str, Any]) -> tm.TrainerV1alpha1RuntimePatch:
    """Our one runtime patch: ``pod_template`` on the runtime's ``node`` replicated job."""
    job_patch = tm.TrainerV1alpha1JobTemplatePatch(spec=tm.TrainerV1alpha1JobSpecPatch(
        template=typed(tm.TrainerV1alpha1PodTemplatePatch, pod_template, "pod")))
    jobset_patch = tm.TrainerV1alpha1JobSetSpecPatch(replicated_jobs=[
        tm.TrainerV1alpha1ReplicatedJobPatch(name=rt.REPLICATED_JOB, template=job_patch)])
    return tm.TrainerV1alpha1RuntimePatch(
        manager=PATCH_MANAGER, training_runtime_spec=tm.TrainerV1alpha1TrainingRuntimeSpecPatch(
            template=tm.TrainerV1alpha1JobSetTemplatePatch(spec=jobset_patch)))


def check_runtime_kind(kind: str) -> str:
    """Return ``kind`` if a TrainJob can refer to it; else raise UserError naming the field."""
    if kind not in rt.RUNTIME_KINDS:
        raise UserError("runtime_kind", f"must be {' or '.join(rt.RUNTIME_KINDS)}, got {kind!r}")
    return kind


def build_trainjob(job: ResolvedJob, runtime_name: str = rt.RUNTIME_NAME,
                   runtime_kind: str = rt.RUNTIME_KIND) -> RenderedTrainJob:
    """Build (do not validate) the TrainJob for a resolved job, referring to that runtime.

    Raises:
        UserError: On a setting v2 cannot express, naming the field.

    """
    refuse(job, runtime_name, runtime_kind)
    # FT: the one builder; v2 injects no PET_RDZV_*: endpoint from node 0's DNS name, id = name.
    command = trainer_command(job, rdzv_endpoint=rdzv_endpoint(), rdzv_id=job.name)
    trainer, pod_patch = _split_pod(to_dict(pod_spec(job, container_name=rt.CONTAINER_NAME,
                                                     command=command)))
    pod_labels = labels(job)
    if job.queue is not None:  # the runtime's value instead (_refuse_queued_grace)
        pod_patch.pop("terminationGracePeriodSeconds", None)
    template = {"metadata": {"labels": dict(pod_labels), "annotations": dict(rt.POD_ANNOTATIONS)},
                "spec": pod_patch}
    spec = tm.TrainerV1alpha1TrainJobSpec(
        runtime_ref=tm.TrainerV1alpha1RuntimeRef(name=runtime_name, kind=runtime_kind,
                                                 api_group=rt.GROUP),
        trainer=_trainer(job, trainer), runtime_patches=[_runtime_patch(template)],
        active_deadline_seconds=job.worker().active_deadline_s)
    # Kueue reads its labels on the TrainJob only (jobspec.queue), not on the pods.
    meta = tm.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
        name=job.name, namespace=job.namespace or None,
        labels={**pod_labels, **(job.queue.labels() if job.queue else {})},
        annotations=job_annotations(job))
    trainjob = manifest(tm.TrainerV1alpha1TrainJob(api_version=rt.API_VERSION, kind=KIND,
                                                   metadata=meta, spec=spec))
    runtime = rt.build_runtime(runtime_name, namespace=job.namespace, kind=runtime_kind)
    return RenderedTrainJob(job=trainjob, runtime=runtime, resolved=job)


def render(job: ResolvedJob, runtime_name: str = rt.RUNTIME_NAME,
           runtime_kind: str = rt.RUNTIME_KIND) -> RenderedTrainJob:
    """Build the TrainJob and validate it (CRD schemas, webhook rules, the node pod).

    Args:
        job: The resolved job.
        runtime_name: The runtime the TrainJob refers to.
        runtime_kind: ``TrainingRuntime`` (namespaced) or ``ClusterTrainingRuntime``.

    Raises:
        UserError: Bad input, naming the field or the manifest field.

    """
    rendered = build_trainjob(job, runtime_name, runtime_kind)
    validate_trainjob(rendered.job, rendered.runtime)
    return rendered
