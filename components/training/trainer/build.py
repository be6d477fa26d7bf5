"""Builds the model, optimizer and schedule, and their checkpointable state dict (TrainState)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from kfp_nvrx.components.core.config import Config
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.model import build_model
from kfp_nvrx.components.training.trainer.parallelize import parallelize


def build(cfg: Config, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Model (initialised from ``train.seed`` and sharded), AdamW and warmup+cosine schedule."""
    torch.manual_seed(cfg.train.seed)
    if device.type == "cuda":
        with torch.device("meta"):
            model = build_model(cfg.model)
        parallelize(model, device, activation_checkpointing=cfg.train.activation_checkpointing,
                    compile=cfg.train.compile)
        model.to_empty(device=device)
        with torch.no_grad():
            _init(model)
    else:
        model = build_model(cfg.model)
        _init(model)
        parallelize(model, device, activation_checkpointing=cfg.train.activation_checkpointing,
                    compile=cfg.train.compile)
    t = cfg.train
    # CUDA: the fused AdamW kernel (one pass over param/grad/moments: a shorter step than foreach,
    # bench.step_profile; figures in docs/benchmarks/NOTES.md). It is deterministic; on CPU (gloo,
    # the exactness tests) foreach stays.
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                            weight_decay=t.weight_decay, **impl)

    def lr_lambda(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    return model, opt, sched


def _init(model: nn.Module) -> None:
    init = getattr(model, "init_weights", None)
    if callable(init):
        init()


class TrainState:
    """Step counter and tokens seen: the data position is the step (sampling is stateless)."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens = 0

    def state_dict(self) -> dict[str, int]:
        """Plain ints (DCP stores them as bytes entries)."""
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restores the counters."""
        self.step, self.tokens = int(sd["step"]), int(sd["tokens"])


def rng_key(rank: int) -> str:
    """Per-rank RNG entry (ranks draw different dropout masks)."""
    return f"rng_rank{rank}"


def full_state(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, train: TrainState,
               ft_state: dict, rank: int) -> dict[str, Any]:
    """Everything a resume needs, in the layout export and resume expect."""
    msd, osd = get_state_dict(model, opt)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    return {"model": msd, "optim": osd, "sched": sched.state_dict(), "train": train.state_dict(),
            "ft": ft_state, rng_key(rank): rng}


def apply_state(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, train: TrainState,
                state: dict[str, Any], rank: int) -> None:
    """Puts a loaded state back into the live objects."""
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["sched"])
    train.load_state_dict(state["train"])
    rng = state.get(rng_key(rank))
    if rng:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def check_compatible(model: nn.Module, stored_keys: set[str], step: int) -> None:
    """A checkpoint of another model must fail with one line, not a DCP traceback."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    ours = {f"model.{k}" for k in get_model_state_dict(model)}
    theirs = {k for k in stored_keys if k.startswith("model.")}
    if theirs and ours != theirs:
        missing = sorted(ours - theirs)[:3]
        raise UserError("checkpoint", f"step {step} was written by a different model "
                        f"(e.g. missing {missing}); use a fresh `run_dir` or matching model.* keys")


def warm_start(model: nn.Module, path: str) -> None:
    """Loads full weights from ``model.safetensors`` (or an export dir holding one)."""
    from safetensors.torch import load_file

    file = Path(path)
    if file.is_dir():
        file = file / "model.safetensors"
    if not file.is_file():
        raise UserError("checkpoint.init_from", f"{path!r} has no model.safetensors")
    sd: dict[str, Any] = load_file(str(file))
    try:
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, strict=True))
    except (RuntimeError, KeyError, ValueError) as err:
        raise UserError("checkpoint.init_from", f"weights do not fit the model: "
                        f"{' '.join(str(err).split())[:200]}") from None
