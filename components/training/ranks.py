"""What every rank agrees on: the collectives the trainer and the checkpointer combine ranks with.

Each is one small collective that every rank must call, in the same order; they reduce on the
training device (NCCL has no CPU tensors; gloo has no CUDA ones). Kept in one place, so what a
decision takes from every rank reads the same everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _on(device: torch.device) -> torch.device | str:
    return device if device.type == "cuda" else "cpu"


def all_ranks(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_on(device))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest ``value`` of all ranks."""
    t = torch.tensor([value], dtype=torch.int32, device=_on(device))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum of ``values`` over every rank (float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=_on(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def gather(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (what the others pass is ignored)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
