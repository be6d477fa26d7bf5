"""KFP component: run one resilient FSDP training job and report goodput.

The job runs through the launcher library: ``backend="local"`` (the embedded default: ft_launcher
agents in this task's own container or machine) or ``backend="kubernetes"`` (a PyTorchJob or a
TrainJob, as ``job_api`` picks, that the task creates, follows and cleans up). The run directory
is ``<workspace>/runs/<job name>`` on the shared volume, named from the KFP run id and task name,
so a retried task resumes the same run.
Caching must stay off for this task (the pipelines do that): its cache key covers only its inputs.
"""

from kfp import dsl

from kfp_nvrx.components.core.faults import with_fault_kinds
from kfp_nvrx.components.images import components_image


# KFP runs this function's source alone, so its defaults are literals; job_api's is
# options.DEFAULT_JOB_API (tests/integration/test_pipelines.py holds them equal). KFP takes the
# parameter descriptions from the docstring, where with_fault_kinds lists the registered fault
# kinds (the source KFP runs keeps the placeholder). The pipelines take the training parameters they offer,
# with these types, defaults and descriptions, from here (pipelines/steps.py: train_parameters),
# so those descriptions are plain text, as a pipeline's parameters read in the Kubeflow UI.
@dsl.component(base_image=components_image(), install_kfp_package=False)
@with_fault_kinds
def train_fsdp(
    dataset: dsl.Input[dsl.Dataset],
    workspace: str,
    run: dsl.Output[dsl.Artifact],
    metrics: dsl.Output[dsl.Metrics],
    timeline: dsl.Output[dsl.HTML],
    pvc_name: str = "",
    mount_path: str = "/fsx",
    config: str = "tiny",
    overrides: list = [],  # noqa: B006 - KFP takes list defaults as literals
    faults: list = [],  # noqa: B006
    nodes: str = "2",
    nproc_per_node: int = 0,
    instance_type: str = "cpu",
    trainer_image: str = "",
    backend: str = "kubernetes",
    job_api: str = "auto",
    init_from: str = "",
    init_from_required: bool = True,
    deadline_s: int = 0,
    queue_name: str = "",
    priority_class: str = "",
    kfp_run_id: str = dsl.PIPELINE_JOB_ID_PLACEHOLDER,
    kfp_task: str = dsl.PIPELINE_TASK_NAME_PLACEHOLDER,
) -> None:
    """Train on ``dataset`` under ft_launcher; write the run, goodput ``Metrics`` and a timeline.

    Args:
        dataset: Prepared dataset (metadata ``path`` on the shared volume).
        workspace: Root directory on the shared volume; the run goes to ``<workspace>/runs/``.
        run: Output: metadata ``path`` = run directory (checkpoints, events); events copy.
        metrics: Output: goodput, steps, final loss, restarts by kind, recovery, checkpoint stall.
        timeline: Output: the goodput timeline page.
        pvc_name: PVC of the shared volume (kubernetes backend: mounted in every worker pod).
        mount_path: Where that PVC is mounted (the same path in this task and in the workers).
        config: Trainer preset (tiny, 125m, 1b, 8b) or a YAML path on the shared volume.
        overrides: Trainer overrides as a JSON list of 'section.key=value' strings, e.g.
            ["train.steps=200"].
        faults: Fault drills as a JSON list of 'KIND@STEP[/RANK]' strings, e.g. ["kill@20/1"]
            (KIND: {fault_kinds}).
        nodes: 'N' or 'MIN:MAX' nodes (pods, or local ft_launcher agents).
        nproc_per_node: Processes per node; 0 = the instance profile's (its GPUs; 1 locally).
        instance_type: Instance profile of the worker pods (p5.48xlarge, p4d.24xlarge, cpu).
        trainer_image: Trainer image of the worker pods ('' = the image of this package version).
        backend: 'kubernetes' (a job of job_api) or 'local' (in the training task's container,
            which then needs torch and NVRx: 'kfp-nvrx run-local', or a custom image).
        job_api: For 'kubernetes': 'pytorchjob' (Training Operator v1), 'trainjob' (Kubeflow
            Trainer v2) or 'auto' (ask the cluster; TrainJob when it serves both).
        init_from: Warm start from this export directory or model.safetensors.
        init_from_required: Fail when ``init_from`` is missing (False: train from scratch).
        deadline_s: Limit of the job's time in seconds (0 = none); time it waits in a Kueue
            queue for quota does not count.
        queue_name: For 'kubernetes': the Kueue LocalQueue the job waits in for quota ('' = none).
        priority_class: For 'kubernetes': its Kueue WorkloadPriorityClass (needs queue_name).
        kfp_run_id: KFP run id (job name, labels, re-attach).
        kfp_task: KFP task name (job name).

    """
    import importlib.util
    import os

    from kfp_nvrx.components import images
    from kfp_nvrx.components.core import fields
    from kfp_nvrx.components.errors import UserError
    from kfp_nvrx.components.launch import ui_outputs
    from kfp_nvrx.components.launch.backends import check, launch
    from kfp_nvrx.components.launch.jobspec.spec import JobSpec
    from kfp_nvrx.components.launch.options import options
    from kfp_nvrx.components.redaction import redact, redacted_output

    if backend == "local" and importlib.util.find_spec("torch") is None:
        raise UserError("backend", "'local' trains inside this task's container, which has no "
                        "torch (the component image); use backend=kubernetes")
    sets = [f"data.path={dataset.metadata['path']}", *overrides]
    if init_from and os.path.exists(init_from):
        sets.append(f"checkpoint.init_from={init_from}")
    elif init_from and init_from_required:
        raise UserError("init_from", f"{init_from} does not exist")
    elif init_from:
        print(f"no model at {init_from} yet: training from scratch")
    # The run goes to <workspace>/runs/<job name>: the name is the job's, derived when it is
    # resolved (from the KFP run id and task, so a retried task resumes the same run).
    spec = JobSpec(image=trainer_image or images.trainer_image(), pvc=pvc_name, run_id=kfp_run_id,
                   task=kfp_task, nodes=nodes, instance_type=instance_type,
                   nproc_per_node=nproc_per_node or None, mount=mount_path,
                   runs_dir=os.path.join(workspace, "runs"), config=config, overrides=sets,
                   faults=list(faults), queue_name=queue_name, priority_class=priority_class)
    # Pod logs, API errors and the reason come from the cluster: no credential the launcher
    # authenticated with may reach the task log, Metrics or the HTML (one redaction).
    with redacted_output():
        try:
            # job_api is a Kubernetes option; the local backend has none.
            kube = {"job_api": job_api} if backend == "kubernetes" else {}
            opts = options(backend, deadline_s=deadline_s or None, **kube)
            job = check(spec, opts)
            result = launch(job, opts)
        except UserError as err:  # the library names the field; say this component's parameter
            raise fields.COMPONENT.reword(err) from None
        except Exception as err:  # the executor prints it (and its chain) as a traceback
            raise RuntimeError(redact(f"{type(err).__name__}: {err}")) from None
    result.reason = redact(result.reason)
    result.last_log_lines = [redact(line) for line in result.last_log_lines]
    summary = ui_outputs.publish(job.run_dir, result, run=run, metrics=metrics, timeline=timeline,
                                 title=job.name)
    queued = (f", queued {result.queued_s:.0f}s by Kueue (preempted {result.preemptions}x)"
              if "queue" in result.extra else "")
    print(f"{result.state}: goodput {summary['goodput']:.3f}, steps {summary['steps_final']}, "
          f"restarts {summary['restarts']}{queued}, run dir {job.run_dir}")
    for line in summary.get("what_happened") or []:
        print(f"  {line}")
    if not result.succeeded:
        tail = "\n".join(result.last_log_lines[-20:])
        raise RuntimeError(f"training {result.state}: {result.reason}\n{tail}")
