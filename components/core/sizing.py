"""Resource sizes derived from a trainer config, without torch (the launcher side uses them).

The export step loads one full copy of the model's weights from the checkpoint, builds the model
and copies them in, then writes ``model.safetensors``: about three copies of the weights at once,
plus the interpreter, torch and the eval batches.
"""

from __future__ import annotations

import math

from kfp_nvrx.components.core.config import Config, ModelConfig, load_config

#: Bytes per parameter of the checkpointed weights (fp32 master weights).
WEIGHT_BYTES = 4
#: Copies of the weights the export holds at its peak (checkpoint tensors, model, safetensors).
EXPORT_COPIES = 3
#: Interpreter, torch, DCP metadata and eval batches.
EXPORT_OVERHEAD_GIB = 2
#: What a ``model.factory`` model (whose size is unknown here) gets; raise it with export_memory.
UNKNOWN_MODEL_GIB = 16


def ffn_hidden(cfg: ModelConfig) -> int:
    """Llama's SwiGLU width (the trainer's ``model.ffn_hidden_dim``)."""
    hidden = int(2 * 4 * cfg.dim / 3 * cfg.ffn_dim_multiplier)
    return cfg.ffn_multiple_of * math.ceil(hidden / cfg.ffn_multiple_of)


def param_count(cfg: ModelConfig) -> int | None:
    """Parameters of the built-in decoder; ``None`` for a ``model.factory`` model."""
    if cfg.factory:
        return None
    head_dim = cfg.dim // cfg.n_heads
    kv = (cfg.n_kv_heads or cfg.n_heads) * head_dim
    attention = 2 * cfg.dim * cfg.n_heads * head_dim + 2 * cfg.dim * kv
    block = attention + 3 * cfg.dim * ffn_hidden(cfg) + 2 * cfg.dim
    return 2 * cfg.vocab_size * cfg.dim + cfg.n_layers * block + cfg.dim


def export_memory_gib(cfg: Config) -> int:
    """Memory (GiB, rounded up) the export step needs for this config's model."""
    params = param_count(cfg.model)
    if params is None:
        return UNKNOWN_MODEL_GIB
    return math.ceil(params * WEIGHT_BYTES * EXPORT_COPIES / 2**30) + EXPORT_OVERHEAD_GIB


def export_memory(config: str, overrides: list[str] | tuple[str, ...] = (),
                  requested: str = "") -> str:
    """The export step's memory request and limit: ``requested``, else sized from the config.

    Raises:
        UserError: A bad config or override (the same errors as training).
    """
    if requested.strip():
        return requested.strip()
    return f"{export_memory_gib(load_config(config, list(overrides)))}Gi"
