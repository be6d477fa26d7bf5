"""FSDP2 (``fully_shard``) per transformer block and at the root, plus activation checkpointing."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one (``model.layers`` by convention)."""
    layers = getattr(model, "layers", None)
    return list(layers) if isinstance(layers, (nn.ModuleList, nn.Sequential)) else []


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Wraps each block in non-reentrant activation checkpointing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = _blocks(model)
    layers = getattr(model, "layers", None)
    for i, block in enumerate(blocks):
        layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)  # type: ignore[index]


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` each block's forward (``train.compile``), as torchtitan does per block.

    Only the forward function is replaced, so parameter names, and with them checkpoints, are
    the same with compile on or off; FSDP's hooks stay outside the compiled region.
    """
    for block in _blocks(model):
        block.forward = torch.compile(block.forward)


def parallelize(model: nn.Module, device: torch.device, *, activation_checkpointing: bool,
                compile: bool = False) -> nn.Module:
    """Shards ``model`` in place with FSDP2 and returns it.

    bf16 parameters with fp32 gradient reduction on CUDA; fp32 everywhere on CPU (gloo has no
    bf16 reduce and the CPU path is for exactness tests).
    """
    if compile:
        compile_blocks(model)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    blocks = _blocks(model)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed right away by the root's backward: keep them.
        fully_shard(block, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mp_policy=mp)
    return model
