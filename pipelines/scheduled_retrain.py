"""``scheduled-retrain``: recurring retraining that only ever promotes a better model.

prepare (new data) -> train, warm-started from the promoted model when there is one -> export ->
compare both models on the new val split -> ``dsl.If(decision == "promote")`` -> promote. The
decision and both eval losses are in the compare task's ``Metrics``. The promoted model lives at
``<workspace>/models/<model_name>/promoted`` on the shared volume (a link to one of its
``versions/``). Schedule it with ``kfp-nvrx schedule`` and ``--max-concurrency 1``.
"""

from typing import Any, NamedTuple

from kfp import dsl

from kfp_nvrx.components.evaluate_promote.component import compare_models, promote_model
from kfp_nvrx.components.export_checkpoint.component import export_checkpoint
from kfp_nvrx.components.prepare_dataset.component import prepare_dataset
from kfp_nvrx.components.train_fsdp.component import train_fsdp
from kfp_nvrx.pipelines.steps import (
    EXPORT_TIMEOUT_S,
    MOUNT_PATH,
    Placement,
    export_size,
    export_step,
    on_shared_volume,
    prepare_step,
    retried,
    sized_task,
    train_parameters,
    train_step,
)


class Outputs(NamedTuple):
    """What a run of ``scheduled-retrain`` returns (the candidate, whether or not promoted)."""

    model: dsl.Model
    train_metrics: dsl.Metrics
    decision_metrics: dsl.Metrics
    timeline: dsl.HTML


@dsl.pipeline(name="scheduled-retrain",
              description="Retrain on new data from the promoted model; promote the result only "
                          "if its eval loss is better.")
@train_parameters(omit=("faults",))  # a retrain injects no faults
def scheduled_retrain(
    source: str = MOUNT_PATH + "/kfp-nvrx/incoming",
    workspace: str = MOUNT_PATH + "/kfp-nvrx",
    pvc_name: str = "kfp-nvrx-shared",
    model_name: str = "default",
    dataset_name: str = "retrain",
    tokenizer: str = "byte",
    seq_len: int = 64,
    val_fraction: float = 0.05,
    text_field: str = "text",
    train_args: dict[str, Any] | None = None,  # the train step's (train_parameters)
    eval_batches: int = 8,
    min_improvement: float = 0.0,
    launcher_node_selector: dict = {"kubernetes.io/os": "linux"},  # noqa: B006
    launcher_tolerations: list = [],  # noqa: B006
    export_memory: str = "",
    export_cpu: str = "2",
    export_node_selector: dict = {"kubernetes.io/os": "linux"},  # noqa: B006
) -> Outputs:
    """Prepare -> warm-started train -> export -> compare -> promote if better.

    Args:
        source: New data: text/JSONL file, glob or directory on the shared volume, or 'sample:'.
        workspace: Directory on the shared volume for datasets, runs and models.
        pvc_name: PersistentVolumeClaim of the shared volume (mounted at /fsx).
        model_name: Name of the promoted model line under '<workspace>/models'.
        dataset_name: Dataset directory name under '<workspace>/datasets' (rebuilt on new data).
        tokenizer: 'byte' or a 'tokenizer.json' path.
        seq_len: Sequence length the dataset must support.
        val_fraction: Share of documents held out for validation.
        text_field: JSON field holding the text.
        train_args: The training step's parameters, as the train_fsdp component declares them
            (but faults: a retrain injects none).
        eval_batches: Val batches per model in the export and the comparison.
        min_improvement: Eval-loss margin a candidate must win by to be promoted.
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
    promoted = f"{workspace}/models/{model_name}/promoted"
    prep = prepare_dataset(source=source, workspace=workspace, dataset_name=dataset_name,
                           tokenizer=tokenizer, seq_len=seq_len, val_fraction=val_fraction,
                           text_field=text_field)
    prepare_step(prep, pvc_name)

    train_args = train_args or {}  # given by train_parameters, one by one to KFP
    train = train_fsdp(dataset=prep.outputs["dataset"], workspace=workspace, pvc_name=pvc_name,
                       mount_path=MOUNT_PATH, init_from=promoted, init_from_required=False,
                       **train_args)
    train_step(train, pvc_name, launcher_node_selector, launcher_tolerations)

    size = export_size(train_args["config"], train_args["overrides"], export_memory, pvc_name)
    model_task = Placement(size.output, export_cpu, export_node_selector)
    export = export_checkpoint(run=train.outputs["run"], eval_batches=eval_batches)
    export_step(export, pvc_name, model_task)

    compare = compare_models(candidate=export.outputs["model"], dataset=prep.outputs["dataset"],
                             promoted_dir=promoted, min_improvement=min_improvement,
                             eval_batches=eval_batches)
    compare.set_display_name("compare-models")
    compare.set_caching_options(False)  # the promoted model changes between runs
    on_shared_volume(compare, pvc_name)
    retried(compare, EXPORT_TIMEOUT_S)
    sized_task(compare, model_task)  # two models, eval batches

    with dsl.If(compare.outputs["Output"] == "promote", name="better-than-promoted"):
        promote = promote_model(candidate=export.outputs["model"], promoted_dir=promoted)
        promote.set_display_name("promote-model")
        promote.set_caching_options(False)
        on_shared_volume(promote, pvc_name)
        retried(promote, EXPORT_TIMEOUT_S)
    return Outputs(model=export.outputs["model"], train_metrics=train.outputs["metrics"],
                   decision_metrics=compare.outputs["metrics"], timeline=train.outputs["timeline"])
