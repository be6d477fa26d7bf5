"""Shared helpers: environment, machine facts, one-process NCCL group, timing, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kfp_nvrx.components.launch.local.run import free_port

#: NVLink multicast stays off everywhere (it can take a shared host's GPUs out of service).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
#: Dense bf16 peak of an H100/H200 SXM by the datasheet (MFU denominator).
PEAK_BF16_FLOPS = 989.4e12

os.environ.update(SAFE_ENV)


def single_process_env() -> dict[str, str]:
    """The torchrun-style environment of a one-process job."""
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def init_single_gpu():
    """A one-process group on cuda:0 (NCCL, plus gloo for torch's async save); returns the device."""
    import torch
    import torch.distributed as dist

    for k, v in single_process_env().items():
        os.environ.setdefault(k, v)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    return device


def _cmd(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict[str, Any]:
    """GPU, driver, CUDA, torch, NVRx and host facts for the record."""
    from importlib import metadata

    import torch

    def version(dist_name: str) -> str:
        try:
            return metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            return "not installed"

    smi = _cmd(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                "--format=csv,noheader"])
    info = {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "nvidia_smi": smi,
        "gpu_count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "",
        "nvidia_resiliency_ext": version("nvidia-resiliency-ext"),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if smi:
        parts = [p.strip() for p in smi.splitlines()[0].split(",")]
        info["driver"] = parts[1] if len(parts) > 1 else ""
    return info


def median(xs: list[float]) -> float:
    """Median (0.0 for an empty list)."""
    return statistics.median(xs) if xs else 0.0


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or zero."""
    return a / b if a and b else None


def newest_step_done(events: list[dict[str, Any]], t: float) -> int:
    """The newest step an events.jsonl records as ended by time ``t`` (0: none).

    Steps redone by a restart are counted from it: a fault "at step N" lands before N runs.
    """
    return max((e["step"] for e in events if e["type"] == "step" and e["end"] <= t), default=0)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Writes ``obj`` as indented JSON (creating parent directories)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def log(msg: str) -> None:
    """A progress line on stderr (flushed: benches run as subprocesses)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_bench(name: str, preset: str) -> tuple[Path, str, dict[str, Any]]:
    """A bench's working folder (a temp dir), its dataset for ``preset`` and its result record."""
    import tempfile

    from kfp_nvrx.components.core.config import load_config

    work = Path(tempfile.mkdtemp(prefix="kfp-nvrx-bench-"))
    data = make_dataset(work, load_config(preset).data.seq_len)
    return work, data, {"bench": name, "preset": preset,
                        "machine": {**machine_info(), "date": time.strftime("%Y-%m-%d")},
                        "runs": {}}


def make_dataset(root: str | os.PathLike, seq_len: int) -> str:
    """The bundled sample corpus, byte-tokenized, for trainer runs (no download)."""
    from kfp_nvrx.components.data.prepare import prepare_dataset

    out = Path(root) / f"sample_{seq_len}"
    prepare_dataset("sample:", out, seq_len=seq_len)
    return str(out)
