"""``fsdp-train``: prepare a dataset -> train with FSDP2 + NVRx -> export the model.

Every task mounts the shared volume (``pvc_name``) at :data:`MOUNT_PATH`; ``workspace`` must lie on
it when the pipeline runs on Kubeflow (``kfp-nvrx run-local`` points it at a local directory
instead, where the Kubernetes settings are ignored). The training task gets /dev/shm, the launcher
node selector and tolerations, no caching and a long timeout; prepare and export are retried.
"""

from typing import NamedTuple

from kfp import dsl

from kfp_nvrx.components import images
from kfp_nvrx.components.core.faults import with_fault_kinds
from kfp_nvrx.components.export_checkpoint.component import export_checkpoint
from kfp_nvrx.components.prepare_dataset.component import prepare_dataset
from kfp_nvrx.components.train_fsdp.component import DEFAULT_JOB_API, train_fsdp
from kfp_nvrx.pipelines.steps import MOUNT_PATH, Placement, export_size, prepare_step, train_step
from kfp_nvrx.pipelines.steps import export_step as place_export


class Outputs(NamedTuple):
    """What a run of ``fsdp-train`` returns (shown under the run's outputs)."""

    model: dsl.Model
    train_metrics: dsl.Metrics
    eval_metrics: dsl.Metrics
    timeline: dsl.HTML


@dsl.pipeline(name="fsdp-train",
              description="Prepare a dataset, train with FSDP2 made resilient by NVIDIA "
                          "Resiliency Extension, and export the model.")
@with_fault_kinds  # the faults description lists the registered kinds
def fsdp_train(
    source: str = "sample:",
    workspace: str = MOUNT_PATH + "/kfp-nvrx",
    pvc_name: str = "kfp-nvrx-shared",
    dataset_name: str = "default",
    tokenizer: str = "byte",
    seq_len: int = 64,
    val_fraction: float = 0.05,
    text_field: str = "text",
    config: str = "tiny",
    overrides: list = [],  # noqa: B006 - KFP takes list defaults as literals
    faults: list = [],  # noqa: B006
    nodes: str = "2",
    nproc_per_node: int = 0,
    instance_type: str = "cpu",
    trainer_image: str = images.trainer_image(),
    backend: str = "kubernetes",
    job_api: str = DEFAULT_JOB_API,
    deadline_s: int = 0,
    queue_name: str = "",
    priority_class: str = "",
    export_step: int = -1,
    eval_batches: int = 8,
    launcher_node_selector: dict = {"kubernetes.io/os": "linux"},  # noqa: B006
    launcher_tolerations: list = [],  # noqa: B006
    export_memory: str = "",
    export_cpu: str = "2",
    export_node_selector: dict = {"kubernetes.io/os": "linux"},  # noqa: B006
) -> Outputs:
    """Prepare -> train -> export.

    Args:
        source: Text/JSONL file, glob or directory on the shared volume, or 'sample:'.
        workspace: Directory on the shared volume for datasets, runs and models.
        pvc_name: PersistentVolumeClaim of the shared volume (mounted at /fsx).
        dataset_name: Dataset directory name under '<workspace>/datasets'.
        tokenizer: 'byte' or a 'tokenizer.json' path.
        seq_len: Sequence length the dataset must support.
        val_fraction: Share of documents held out for validation.
        text_field: JSON field holding the text.
        config: Trainer preset (tiny, 125m, 1b, 8b) or YAML path.
        overrides: Trainer overrides as a JSON list of 'section.key=value' strings, e.g.
            ["train.steps=200"].
        faults: Fault drills as a JSON list of 'KIND@STEP[/RANK]' strings, e.g.
            ["kill@20/1"] (KIND: {fault_kinds}).
        nodes: 'N' or 'MIN:MAX' nodes.
        nproc_per_node: Processes per node; 0 = the instance profile's GPUs (1 on cpu).
        instance_type: Worker instance profile (p5.48xlarge, p4d.24xlarge, cpu).
        trainer_image: Trainer image of the worker pods (default: this version's image).
        backend: 'kubernetes' (a job of job_api) or 'local' (in the task's pod: needs an image
            with torch and NVRx; 'kfp-nvrx run-local' uses it).
        job_api: 'pytorchjob', 'trainjob' or 'auto' (the cluster's; TrainJob when both).
        deadline_s: Training time limit in seconds (0 = none); time waiting in a Kueue queue
            does not count.
        queue_name: Kueue LocalQueue the training job waits in for quota ('' = none).
        priority_class: Kueue WorkloadPriorityClass of the training job (needs queue_name).
        export_step: Checkpoint step to export (-1 = newest).
        eval_batches: Val batches for the eval loss.
        launcher_node_selector: Node selector of the training (launcher) task's pod, a JSON
            object of label: value.
        launcher_tolerations: Tolerations of the training (launcher) task's pod, a JSON list
            of Kubernetes tolerations, e.g. [{"key": "dedicated", "operator": "Exists",
            "effect": "NoSchedule"}].
        export_memory: Memory of the export step (request = limit), a Kubernetes quantity
            such as 96Gi; empty = sized from the config (three fp32 copies of the weights + 2 GiB:
            92Gi for 8b, 3Gi for tiny).
        export_cpu: CPU request of the export step.
        export_node_selector: Node selector of the export step's pod, a JSON object of
            label: value (it needs a node with export_memory free).

    """
    prep = prepare_dataset(source=source, workspace=workspace, dataset_name=dataset_name,
                           tokenizer=tokenizer, seq_len=seq_len, val_fraction=val_fraction,
                           text_field=text_field)
    prepare_step(prep, pvc_name)

    train = train_fsdp(dataset=prep.outputs["dataset"], workspace=workspace, pvc_name=pvc_name,
                       mount_path=MOUNT_PATH, config=config, overrides=overrides, faults=faults,
                       nodes=nodes, nproc_per_node=nproc_per_node, instance_type=instance_type,
                       trainer_image=trainer_image, backend=backend, job_api=job_api,
                       deadline_s=deadline_s, queue_name=queue_name,
                       priority_class=priority_class)
    train_step(train, pvc_name, launcher_node_selector, launcher_tolerations)

    size = export_size(config, overrides, export_memory, pvc_name)
    export = export_checkpoint(run=train.outputs["run"], step=export_step,
                               eval_batches=eval_batches)
    place_export(export, pvc_name, Placement(size.output, export_cpu, export_node_selector))
    return Outputs(model=export.outputs["model"], train_metrics=train.outputs["metrics"],
                   eval_metrics=export.outputs["metrics"], timeline=train.outputs["timeline"])
