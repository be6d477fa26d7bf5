"""Checkpoint load speed against the disk's own read bandwidth, from cold page cache.

Used by :mod:`bench.ckpt_stall` after the shipped saves: the same files are read raw (sequential,
large reads), then loaded by ``Checkpointer.load`` (the path resume uses), each after evicting them
from the page cache; plus the warm load and, with ``profile``, a cProfile of it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def _evict(files: list[Path]) -> None:
    """Drops the files' pages from the page cache, so the next read comes from the disk."""
    import os

    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _profiled(fn, top: int = 18) -> tuple[float, str]:
    """Runs ``fn`` under cProfile; returns its seconds and the top functions by cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(fn)
    dt = time.perf_counter() - t0
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    return dt, buf.getvalue()


def _read(f: Path) -> None:
    """Reads one file raw, in 64 MiB reads."""
    buf = bytearray(64 << 20)
    with open(f, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass


def _raw_read(files: list[Path], parallel: bool) -> float:
    """Seconds to read ``files`` from disk (evicted first): one after another, or one thread each."""
    from concurrent.futures import ThreadPoolExecutor

    _evict(files)
    t0 = time.perf_counter()
    if parallel:
        with ThreadPoolExecutor(len(files)) as pool:
            list(pool.map(_read, files))
    else:
        for f in files:
            _read(f)
    return time.perf_counter() - t0


def cold_load(ckpt, step: int, state: dict, profile: bool = False) -> dict[str, Any]:
    """Disk read bandwidth of the checkpoint's own files vs ``Checkpointer.load`` of them, cold.

    Both read the same bytes after evicting them from the page cache; the disk's bandwidth is the
    faster of a sequential and a one-thread-per-file raw read. Also the in-memory restore (the
    staging buffer, when it holds this step).
    """
    import subprocess

    import torch

    from kfp_nvrx.components.core.volume_store import VolumeStore

    store = VolumeStore(ckpt.run_dir)  # the bench reads the volume's files itself
    path, files = store.location(step), store.files(step)
    nbytes = sum(f.stat().st_size for f in files)
    raw = min(_raw_read(files, parallel=False), _raw_read(files, parallel=True))
    out: dict[str, Any] = {"bytes": nbytes, "files": len(files), "raw_read_s": raw,
                           "raw_gb_per_s": nbytes / raw / 1e9}
    staging, ckpt.staging = ckpt.staging, None  # the disk path (what an in-job restart takes)
    try:
        for label in ("cold", "warm"):
            if label == "cold":
                _evict(files)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if profile and label == "warm":
                _, out["warm_profile"] = _profiled(lambda: ckpt.load(step, state))
            else:
                ckpt.load(step, state)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            out[f"{label}_load_s"] = dt
            out[f"{label}_load_gb_per_s"] = nbytes / dt / 1e9
            if not profile:
                break
    finally:
        ckpt.staging = staging
    if staging is not None and staging.valid_step == step:  # what an in-process restart takes
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ckpt.load(step, state)
        torch.cuda.synchronize()
        out["memory_restore_s"] = time.perf_counter() - t0
        out["memory_restored"] = ckpt.restored_from_memory
    out["load_over_disk_read"] = out["cold_load_gb_per_s"] / out["raw_gb_per_s"]
    df = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout
    out["filesystem"] = " ".join(df.splitlines()[-1].split()[:2]) if df else ""
    return out


def reader_vs_stock(path: str | os.PathLike, state_dict: dict[str, Any], process_group: Any = None,
                    **reader_kwargs: Any) -> dict[str, Any]:
    """Cold read bandwidth: raw sequential read vs stock ``dcp.load`` vs ``load``, same run.

    Each measurement starts from an evicted page cache. Not a test: the numbers depend on the disk.

    Args:
        path: The checkpoint directory.
        state_dict: The state to load into (both loads fill it; it ends holding the checkpoint).
        process_group: Passed to ``dcp.load``.
        **reader_kwargs: ``FastFileSystemReader`` options.

    Returns:
        Bytes, seconds and GB/s of each, and ``stock_over_raw`` / ``fast_over_raw`` ratios.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from kfp_nvrx.components.training.checkpoint.reader import load

    files = sorted(p for p in Path(path).iterdir() if p.is_file())
    nbytes = sum(f.stat().st_size for f in files)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    out: dict[str, Any] = {"bytes": nbytes}
    for label, fn in (("raw", lambda: [_read(f) for f in files]),
                      ("stock", lambda: dcp.load(state_dict, storage_reader=FileSystemReader(path),
                                                 process_group=process_group)),
                      ("fast", lambda: load(state_dict, path, process_group, **reader_kwargs))):
        _evict(files)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out[f"{label}_s"] = time.perf_counter() - t0
        out[f"{label}_gb_per_s"] = nbytes / out[f"{label}_s"] / 1e9
    out["stock_over_raw"] = out["stock_gb_per_s"] / out["raw_gb_per_s"]
    out["fast_over_raw"] = out["fast_gb_per_s"] / out["raw_gb_per_s"]
    return out
