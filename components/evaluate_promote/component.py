"""KFP components: compare a candidate model with the promoted one, and promote it.

``compare_models`` returns ``promote`` or ``keep`` (its single ``Output``, which ``dsl.If`` tests)
and writes the decision and both eval losses to ``Metrics``; ``promote_model`` runs only under
``dsl.If(... == "promote")`` and swaps the ``promoted`` link on the shared volume.
``compare_models`` runs both models, so it uses the trainer image (torch; it must also contain
``kfp``); ``promote_model`` only copies files and uses the component image.
"""

from kfp import dsl

from kfp_nvrx.components.images import components_image, trainer_image


@dsl.component(base_image=trainer_image(), install_kfp_package=False)
def compare_models(
    candidate: dsl.Input[dsl.Model],
    dataset: dsl.Input[dsl.Dataset],
    promoted_dir: str,
    metrics: dsl.Output[dsl.Metrics],
    min_improvement: float = 0.0,
    eval_batches: int = 8,
) -> str:
    """Score candidate and promoted model on the dataset's val split; return the decision.

    Args:
        candidate: The new export.
        dataset: The dataset (metadata ``path``) whose val split both models are scored on.
        promoted_dir: The promoted model link on the shared volume (may not exist yet).
        metrics: Output: ``promote`` (1/0), ``candidate_eval_loss``, ``promoted_eval_loss``,
            ``improvement``.
        min_improvement: Loss margin the candidate must win by.
        eval_batches: Val batches per model.

    Returns:
        ``promote`` or ``keep``.

    """
    import warnings

    # torch imports pynvml, which warns on every import; nothing here uses NVML.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    from kfp_nvrx.components.training.export.promote import PROMOTE, compare

    result = compare(candidate.path, dataset.metadata["path"], promoted_dir,
                     min_improvement=min_improvement, eval_batches=eval_batches)
    print(f"decision: {result['decision']} ({result['reason']})")
    metrics.log_metric("promote", 1 if result["decision"] == PROMOTE else 0)
    metrics.log_metric("has_promoted_model", 0 if result["promoted_eval_loss"] is None else 1)
    for key in ("candidate_eval_loss", "promoted_eval_loss", "improvement", "min_improvement"):
        if result[key] is not None:
            metrics.log_metric(key, float(result[key]))
    return result["decision"]


@dsl.component(base_image=components_image(), install_kfp_package=False)
def promote_model(
    candidate: dsl.Input[dsl.Model],
    promoted_dir: str,
    kfp_run_id: str = dsl.PIPELINE_JOB_ID_PLACEHOLDER,
) -> str:
    """Copy the candidate into ``versions/`` and point ``promoted_dir`` at it.

    Args:
        candidate: The export that won the comparison.
        promoted_dir: The promoted model link on the shared volume.
        kfp_run_id: The KFP run (stored in ``promotion.json``).

    Returns:
        The new version directory.

    """
    from kfp_nvrx.components.training.export.promote import promote

    version = promote(candidate.path, promoted_dir,
                      record={"kfp_run_id": kfp_run_id, **dict(candidate.metadata)})
    print(f"promoted {candidate.path} -> {version} ({promoted_dir} now points to it)")
    return str(version)
