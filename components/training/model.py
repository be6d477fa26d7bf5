"""The built-in Llama-style decoder (RMSNorm, RoPE, SwiGLU, SDPA) and the user factory hook."""

from __future__ import annotations

import importlib
import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kfp_nvrx.components.core.config import ModelConfig
from kfp_nvrx.components.errors import UserError


def ffn_hidden_dim(cfg: ModelConfig) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim, scaled, rounded up to ``ffn_multiple_of``."""
    hidden = int(2 * 4 * cfg.dim / 3 * cfg.ffn_dim_multiplier)
    return cfg.ffn_multiple_of * math.ceil(hidden / cfg.ffn_multiple_of)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim // 2)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs of channels of x (B, H, T, D) by the position angles."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    """Grouped-query attention with RoPE and SDPA."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over x (B, T, dim)."""
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = ffn_hidden_dim(cfg)
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """w2(silu(w1 x) * w3 x)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention and MLP, each with a residual."""
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model: tokens (B, T) -> logits (B, T, vocab)."""

    # Buffers (register_buffer): declared, as nn.Module types attribute access loosely.
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self) -> None:
        """Deterministic init under the caller's RNG (call after ``to_empty`` for meta models)."""
        cos, sin = rope_tables(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len,
                               self.cfg.rope_theta)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for block in cast("list[Block]", list(self.layers)):  # Blocks until parallelize wraps them
            for lin in (block.attention.wq, block.attention.wk, block.attention.wv,
                        block.feed_forward.w1, block.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, std=std)
            for lin in (block.attention.wo, block.feed_forward.w2):
                nn.init.trunc_normal_(lin.weight, std=out_std)
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, std=self.cfg.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for every position."""
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))


def num_params(model: nn.Module) -> int:
    """Parameter count (global, also for sharded models)."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (6N + attention), as in the PaLM/torchtitan MFU formula."""
    n = (cfg.vocab_size * cfg.dim * 2
         + cfg.n_layers * (4 * cfg.dim * cfg.dim + 3 * cfg.dim * ffn_hidden_dim(cfg)))
    kv = cfg.n_kv_heads or cfg.n_heads
    n -= cfg.n_layers * 2 * cfg.dim * (cfg.dim - cfg.dim * kv // cfg.n_heads)
    return 6 * n + 12 * cfg.n_layers * cfg.dim * seq_len


def build_model(cfg: ModelConfig) -> nn.Module:
    """The built-in Transformer, or ``fn(cfg)`` from ``model.factory = "pkg.module:fn"``."""
    if not cfg.factory:
        return Transformer(cfg)
    module_name, _, fn_name = cfg.factory.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as err:
        raise UserError("model.factory", f"cannot load {cfg.factory!r}: {err}") from None
    model = fn(cfg)
    if not isinstance(model, nn.Module):
        raise UserError("model.factory", f"{cfg.factory!r} returned {type(model).__name__}, "
                        "expected a torch.nn.Module")
    return model
