"""The fields of a training job, and how each surface names them.

The launcher side raises :class:`~kfp_nvrx.components.errors.UserError` naming the domain field
(a ``JobSpec`` attribute or a launch option: ``nodes``, ``pvc``, ``job_api``; a trainer config
key such as ``train.steps`` is its own name everywhere). The CLI reports it as the flag
(``--pvc``), the ``train_fsdp`` KFP component as its parameter (``pvc_name``), ``run-local`` and
``submit`` as the pipeline parameter (``--param pvc_name``). One row per field, one column per
surface: a field is renamed in one place.
"""

from __future__ import annotations

from kfp_nvrx.components.errors import Surface

#: Domain field -> (CLI flag, KFP component / pipeline parameter; None: the domain name).
JOB_FIELDS: dict[str, tuple[str, str | None]] = {
    "nodes": ("--nodes", "nodes"),
    "nproc_per_node": ("--nproc-per-node", "nproc_per_node"),
    "instance_type": ("--instance-type", "instance_type"),
    "image": ("--image", "trainer_image"),
    "pvc": ("--pvc", "pvc_name"),
    "mount": ("--mount", "mount_path"),
    # The component puts the run under <workspace>/runs/<name>.
    "run_dir": ("--run-dir", "workspace"),
    "name": ("--name", "kfp_task"),
    "run_id": ("--run-id", "kfp_run_id"),
    "task": ("--task", "kfp_task"),
    "config": ("--config", "config"),
    "overrides": ("--set", "overrides"),
    "faults": ("--fault", "faults"),
    "backend": ("--backend", "backend"),
    "job_api": ("--job-api", "job_api"),
    "deadline_s": ("--deadline", "deadline_s"),
    "namespace": ("--namespace", None),
    "env": ("--env", None),
    "secret_env": ("--secret-env", None),
    "extra_pvcs": ("--extra-pvc", None),
    "cpu": ("--cpu", None),
    "memory": ("--memory", None),
    "efa": ("--efa", None),
    "hugepages": ("--hugepages", None),
    "shm_size": ("--shm-size", None),
    "node_selector": ("--node-selector", None),
    "tolerations": ("--toleration", None),
    "affinity": ("--affinity", None),
    # Kueue: the LocalQueue and WorkloadPriorityClass (labels on the job, jobspec.queue).
    "queue_name": ("--queue-name", None),
    "priority_class": ("--priority-class", None),
    # The pods' Kubernetes PriorityClass (priorityClassName).
    "pod_priority_class": ("--pod-priority-class", None),
    "scheduler_name": ("--scheduler-name", None),
    "service_account": ("--service-account", None),
    "image_pull_policy": ("--image-pull-policy", None),
    "fs_group": ("--fs-group", None),
    "active_deadline_s": ("--active-deadline", None),
    "ttl_after_finished_s": ("--ttl-after-finished", None),
    "backoff_limit": ("--backoff-limit", None),
    "runtime": ("--runtime", None),
    "runtime_kind": ("--runtime-kind", None),
    "delete_after": ("--delete-after", None),
    "poll_s": ("--poll-interval", None),
    # Where the job's images come from (compile, submit); the pipelines take trainer_image.
    "registry": ("--registry", None),
}

_PARAMETERS = {field: param for field, (_, param) in JOB_FIELDS.items() if param}

#: ``kfp-nvrx ...`` and the trainer's own command line.
CLI = Surface({field: flag for field, (flag, _) in JOB_FIELDS.items()}, assign="{name} {value}")
#: The ``train_fsdp`` KFP component's parameters (a field without one keeps its domain name).
COMPONENT = Surface({**{field: field for field in JOB_FIELDS}, **_PARAMETERS})
#: Pipeline parameters (``run-local --param``, ``submit --param``): config keys are overrides.
PIPELINE = Surface({**{field: field for field in JOB_FIELDS}, **_PARAMETERS}, prefix="--param ",
                   config_key="overrides ({})")
