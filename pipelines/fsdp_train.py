"""``fsdp-train``: prepare a dataset -> train with FSDP2 + NVRx -> export the model.

Every task mounts the shared volume (``pvc_name``) at :data:`MOUNT_PATH`; ``workspace`` must lie on
it when the pipeline runs on Kubeflow (``kfp-nvrx run-local`` points it at a local directory
instead, where the Kubernetes settings are ignored). The training task gets /dev/shm, the launcher
node selector and tolerations, no caching and a long timeout; prepare and export are retried.
"""

from typing import Any, NamedTuple

from kfp import dsl

from kfp_nvrx.components.export_checkpoint.component import export_checkpoint
from kfp_nvrx.components.prepare_dataset.component import prepare_dataset
from kfp_nvrx.components.train_fsdp.component import train_fsdp
from kfp_nvrx.pipelines.steps import (
    MOUNT_PATH,
    Placement,
    export_size,
    prepare_step,
    train_parameters,
    train_step,
)
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
@train_parameters()
def fsdp_train(
    source: str = "sample:",
    workspace: str = MOUNT_PATH + "/kfp-nvrx",
    pvc_name: str = "kfp-nvrx-shared",
    dataset_name: str = "default",
    tokenizer: str = "byte",
    seq_len: int = 64,
    val_fraction: float = 0.05,
    text_field: str = "text",
    train_args: dict[str, Any] | None = None,  # the train step's (train_parameters)
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
        train_args: The training step's parameters, as the train_fsdp component declares them.
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

    train_args = train_args or {}  # given by train_parameters, one by one to KFP
    train = train_fsdp(dataset=prep.outputs["dataset"], workspace=workspace, pvc_name=pvc_name,
                       mount_path=MOUNT_PATH, **train_args)
    train_step(train, pvc_name, launcher_node_selector, launcher_tolerations)

    size = export_size(train_args["config"], train_args["overrides"], export_memory, pvc_name)
    export = export_checkpoint(run=train.outputs["run"], step=export_step,
                               eval_batches=eval_batches)
    place_export(export, pvc_name, Placement(size.output, export_cpu, export_node_selector))
    return Outputs(model=export.outputs["model"], train_metrics=train.outputs["metrics"],
                   eval_metrics=export.outputs["metrics"], timeline=train.outputs["timeline"])
