"""KFP component: text source -> tokenized train/val shards on the shared volume (``Dataset``).

The shards live under ``<workspace>/datasets/<dataset_name>`` on the shared volume (the PVC the
training pods also mount); the ``Dataset`` artifact holds a copy of ``index.json`` and points to
that directory in its metadata (``path``). A dataset whose fingerprint matches is reused.
"""

from kfp import dsl

from kfp_nvrx.components.images import components_image


@dsl.component(base_image=components_image(), install_kfp_package=False)
def prepare_dataset(
    source: str,
    workspace: str,
    dataset: dsl.Output[dsl.Dataset],
    dataset_name: str = "default",
    tokenizer: str = "byte",
    seq_len: int = 64,
    val_fraction: float = 0.05,
    text_field: str = "text",
    seed: int = 0,
) -> None:
    """Tokenize ``source`` into ``<workspace>/datasets/<dataset_name>`` (reused when unchanged).

    Args:
        source: File, glob or directory of .txt/.jsonl on the shared volume, or ``sample:`` for
            the bundled sample corpus.
        workspace: Root directory on the shared volume (datasets, runs, models live under it).
        dataset: Output artifact: ``index.json`` copy; metadata ``path`` is the dataset directory.
        dataset_name: Sub-directory name under ``<workspace>/datasets``.
        tokenizer: ``byte`` or the path of a ``tokenizer.json``.
        seq_len: Sequence length the data is for.
        val_fraction: Share of documents held out for validation.
        text_field: JSON field holding the text in .jsonl sources.
        seed: Chooses which documents go to val.

    """
    import json
    import os

    from kfp_nvrx.components.data.prepare import Recipe, summary
    from kfp_nvrx.components.data.prepare import prepare_dataset as prepare

    out_dir = os.path.join(workspace, "datasets", dataset_name)
    recipe = Recipe(tokenizer=tokenizer, text_field=text_field, val_fraction=val_fraction,
                    seed=seed)
    index = prepare(source, out_dir, recipe, seq_len=seq_len, overwrite=True, log=print)
    print(summary(index))
    os.makedirs(dataset.path, exist_ok=True)
    with open(os.path.join(dataset.path, "index.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in index.items() if k not in ("status", "path")}, f, indent=1)
    dataset.metadata.update({
        "path": index["path"], "status": index["status"], "fingerprint": index["fingerprint"],
        "vocab_size": index["vocab_size"], "dtype": index["dtype"], "seq_len": seq_len,
        "tokenizer": index["tokenizer"], "train_tokens": index["splits"]["train"]["tokens"],
        "val_tokens": index["splits"]["val"]["tokens"],
    })
