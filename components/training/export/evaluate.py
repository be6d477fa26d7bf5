"""Eval loss of an exported model: mean next-token cross-entropy on a dataset's val split.

Windows of ``seq_len + 1`` tokens are taken at evenly spaced, non-overlapping positions of the
split, so the same model and data always give the same number (no sampling, no RNG).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kfp_nvrx.components.core.bounded import read_json
from kfp_nvrx.components.data.shards import (
    SplitTokens,
    check_checksums,
    check_files,
    read_index,
)
from kfp_nvrx.components.errors import UserError


def check_dataset(data_dir: str | os.PathLike[str], vocab_size: int, seq_len: int,
                  split: str = "val") -> dict[str, Any]:
    """Check that ``data_dir`` is a dataset the model can read; return its index.

    Raises:
        UserError: (``data``) when it is not a dataset, its vocabulary is larger than the model's,
            or the split is shorter than one window.

    """
    index = read_index(data_dir, "data")
    if index["vocab_size"] > vocab_size:
        raise UserError("data", f"{data_dir} has vocab_size {index['vocab_size']} but the model "
                        f"has {vocab_size}; evaluate on data made with the model's tokenizer")
    if split not in index["splits"]:
        raise UserError("data", f"{data_dir} has no {split!r} split")
    if index["splits"][split]["tokens"] < seq_len + 1:
        raise UserError("data", f"the {split} split of {data_dir} has "
                        f"{index['splits'][split]['tokens']} tokens, fewer than seq_len + 1 = "
                        f"{seq_len + 1}")
    problem = check_files(Path(data_dir), index)
    if problem:
        raise UserError("data", f"{data_dir}: {problem}; re-run prepare-data")
    check_checksums(data_dir, index, [split], "data")
    return index


def window_starts(n_tokens: int, seq_len: int, n_windows: int) -> np.ndarray:
    """Return up to ``n_windows`` evenly spaced, non-overlapping window starts."""
    span = seq_len + 1
    n = max(0, min(n_windows, n_tokens // span))
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    return np.linspace(0, n_tokens - span, n).round().astype(np.int64)


@dataclass(frozen=True)
class Windows:
    """Which windows of a split an eval reads.

    Attributes:
        seq_len: Tokens per window input (targets are shifted by one).
        batch_size: Windows per forward pass.
        batches: Number of batches; fewer windows are used when the split is short.
    """

    seq_len: int
    batch_size: int = 4
    batches: int = 8


def eval_loss(model: Any, data_dir: str | os.PathLike[str], windows: Windows, *,
              split: str = "val", vocab_size: int | None = None) -> dict[str, Any]:
    """Mean next-token cross-entropy of ``model`` over deterministic windows of a split.

    Args:
        model: Maps tokens (B, T) to logits (B, T, vocab); evaluated on CPU in float32.
        data_dir: A ``prepare-data`` dataset.
        windows: Window length, windows per batch and batches.
        split: Which split to read.
        vocab_size: The model's vocabulary (default: ``model.cfg.vocab_size``).

    Returns:
        ``{"loss": float, "tokens": int, "windows": int}``.

    """
    import torch
    import torch.nn.functional as F

    seq_len, batch_size = windows.seq_len, windows.batch_size
    vocab = vocab_size if vocab_size is not None else _vocab_size(model)
    index = check_dataset(data_dir, vocab, seq_len, split)
    tokens = SplitTokens(data_dir, split, index)
    starts = window_starts(len(tokens), seq_len, windows.batches * batch_size)
    model = model.float().eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(starts), batch_size):
            rows = np.stack([tokens.read(int(s), seq_len + 1) for s in starts[i:i + batch_size]])
            batch = torch.from_numpy(rows)
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   batch[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += int(batch[:, 1:].numel())
    return {"loss": total / count, "tokens": count, "windows": len(starts)}


def _vocab_size(model: Any) -> int:
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "vocab_size"):
        return int(cfg.vocab_size)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        raise UserError("model.factory", "cannot tell the model's vocab size (no .cfg.vocab_size)")
    return int(emb.num_embeddings)


def read_export_config(export_dir: str | os.PathLike[str]) -> Any:
    """Rebuild the ModelConfig from an export's ``config.json``."""
    import dataclasses

    from kfp_nvrx.components.core.config import ModelConfig, config_from_dict

    path = Path(export_dir) / "config.json"
    raw = read_json(path, "model", what="export config.json")  # bounded, no NaN, depth-safe
    if not isinstance(raw, dict):
        raise UserError("model", f"{path} is not a JSON object")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return config_from_dict({"model": {k: v for k, v in raw.items() if k in known}}).model


def load_exported_model(export_dir: str | os.PathLike[str]) -> Any:
    """Build the model of an export and load ``model.safetensors`` into it (strict)."""
    from safetensors.torch import load_file

    from kfp_nvrx.components.training.model import build_model

    model = build_model(read_export_config(export_dir))
    weights = Path(export_dir) / "model.safetensors"
    if not weights.is_file():
        raise UserError("model", f"{export_dir} has no model.safetensors")
    model.load_state_dict(load_file(str(weights)), strict=True)
    return model


def evaluate_export(export_dir: str | os.PathLike[str], data_dir: str | os.PathLike[str], *,
                    seq_len: int | None = None, batch_size: int = 4,
                    batches: int = 8) -> dict[str, Any]:
    """Eval loss of an exported model directory on a dataset's val split.

    ``seq_len`` defaults to the one in the export's ``export.json`` (the training seq len), else
    the model's ``max_seq_len``.
    """
    model_cfg = read_export_config(export_dir)
    model = load_exported_model(export_dir)
    if seq_len is None:
        try:
            seq_len = int(read_json(Path(export_dir) / "export.json", "model")["seq_len"])
        except (UserError, ValueError, KeyError, TypeError):
            seq_len = int(model_cfg.max_seq_len)
    return eval_loss(model, data_dir, Windows(seq_len, batch_size, batches),
                     vocab_size=model_cfg.vocab_size)
