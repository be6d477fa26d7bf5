"""Which GPUs each local "node" gets: a worker pod sees only its own GPUs, so do local agents.

Torch-free: the GPUs are read from ``CUDA_VISIBLE_DEVICES`` when set, else from the NVIDIA
driver's ``/proc/driver/nvidia/gpus`` (one entry per GPU), the way the device plugin would
count them.
"""

from __future__ import annotations

import os
from pathlib import Path

from kfp_nvrx.components.errors import UserError

_DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")


def visible_gpus(environ: dict[str, str] | None = None, driver_dir: Path = _DRIVER_GPUS) -> list[str]:
    """The GPU ids this process may use, in order (empty on a host without NVIDIA GPUs)."""
    env = os.environ if environ is None else environ
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [d.strip() for d in listed.split(",") if d.strip()]
        # CUDA stops at the first invalid entry ("-1", "" mean "no GPU").
        out = []
        for d in ids:
            if d.startswith("-"):
                break
            out.append(d)
        return out
    try:
        count = sum(1 for _ in driver_dir.iterdir())
    except OSError:
        return []
    return [str(i) for i in range(count)]


def uses_cuda(device: str, gpus: list[str]) -> bool:
    """Whether workers will train on CUDA (``train.device``: auto takes CUDA when present)."""
    return device == "cuda" or (device == "auto" and bool(gpus))


def slice_gpus(nodes: int, nproc_per_node: int, device: str,
               gpus: list[str] | None = None) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` for each local node, or None per node when training on the CPU.

    Raises:
        UserError: CUDA training asks for more GPUs than the host shows, or for CUDA on a host
            without GPUs.
    """
    gpus = visible_gpus() if gpus is None else gpus
    if not uses_cuda(device, gpus):
        return [None] * nodes
    want = nodes * nproc_per_node
    if not gpus:
        raise UserError("train.device", "is cuda but this host shows no NVIDIA GPU; use "
                        "`overrides=train.device=cpu` or run on a GPU host")
    if want > len(gpus):
        raise UserError("nproc_per_node", f"{nodes} node(s) x {nproc_per_node} proc need {want} "
                        f"GPUs, this host has {len(gpus)}; lower `nodes`/`nproc_per_node` or use "
                        "`overrides=train.device=cpu`")
    return [",".join(gpus[i * nproc_per_node:(i + 1) * nproc_per_node]) for i in range(nodes)]
