"""KFP component: a training run's checkpoint -> consolidated ``Model`` + eval loss ``Metrics``.

It loads tensors and runs the model, so it uses the trainer image (torch, safetensors; the
component image has no torch). That image must also contain ``kfp`` for the KFP executor.
"""

from kfp import dsl

from kfp_nvrx.components.images import components_image, trainer_image


@dsl.component(base_image=trainer_image(), install_kfp_package=False)
def export_checkpoint(
    run: dsl.Input[dsl.Artifact],
    model: dsl.Output[dsl.Model],
    metrics: dsl.Output[dsl.Metrics],
    step: int = -1,
    eval_batches: int = 8,
) -> None:
    """Write ``model.safetensors`` + ``config.json`` + ``export.json`` of one committed checkpoint.

    Args:
        run: The training run (metadata ``path``: the run directory on the shared volume).
        model: Output: the consolidated model, independent of the world size that trained it.
        metrics: Output: ``eval_loss`` on the dataset's val split, ``source_step``, ``num_params``.
        step: Checkpoint step to export; -1 = the newest committed one.
        eval_batches: Val batches for the eval loss; 0 skips it.

    """
    import warnings

    # torch imports pynvml, which warns on every import; nothing here uses NVML.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    from kfp_nvrx.components.training.export.consolidate import export_checkpoint as export
    from kfp_nvrx.components.training.export.consolidate import summary

    info = export(run.metadata["path"], model.path, step=None if step < 0 else step,
                  eval_batches=eval_batches, log=print)
    print(summary(info))
    model.framework = "pytorch"
    model.metadata.update({k: info[k] for k in ("source_step", "sha256", "num_params", "seq_len",
                                               "world_size", "eval_loss") if k in info})
    metrics.log_metric("source_step", int(info["source_step"]))
    metrics.log_metric("num_params", int(info["num_params"]))
    if info.get("eval_loss") is not None:
        metrics.log_metric("eval_loss", float(info["eval_loss"]))


@dsl.component(base_image=components_image(), install_kfp_package=False)
def size_export(config: str, overrides: list = [], export_memory: str = "") -> str:  # noqa: B006
    """Return the export step's memory (request = limit): ``export_memory``, else from the config.

    Sized as about three fp32 copies of the model's weights plus 2 GiB (92Gi for the 8b preset);
    torch-free, so it runs on the component image while training runs.

    Args:
        config: Trainer preset or YAML path (the training step's).
        overrides: Trainer overrides (the training step's).
        export_memory: A Kubernetes quantity that overrides the estimate ('' = estimate).

    """
    from kfp_nvrx.components.core.sizing import export_memory as size

    memory = size(config, [str(o) for o in overrides], export_memory)
    print(f"export step memory: {memory}")
    return memory
