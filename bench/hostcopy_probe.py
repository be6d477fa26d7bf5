"""What the node-local host copy costs on this machine: allocate, pin, map again, copy to the GPU.

Measures, for one buffer of ``--gb`` GB in ``/dev/shm`` (a 1b rank's state is 13.25 GB): the
page allocation (``posix_fallocate``), pinning in the staging code's pieces while the GPU runs a
matmul loop (how much the loop's iterations slow down), H2D from the pinned and the pageable
mapping, a second process mapping and pinning the same (resident) file, as an in-job restart
does, and zlib's CRC32 rate (the file check the host copy skips).

``python -m bench.hostcopy_probe --out probe.json [--gb 13.25]``
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import threading
import time
import zlib

import torch

from bench.common import machine_info, write_json
from kfp_nvrx.components.training.checkpoint.bank import PIN_CHUNK


def _ranges(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    return [(o, min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)]


def _map(path: str, nbytes: int, create: bool) -> tuple[mmap.mmap, torch.Tensor, float]:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0), 0o600)
    if create:
        os.posix_fallocate(fd, 0, nbytes)
    mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8), time.perf_counter() - t0


def _pin(buf: torch.Tensor, chunk: int) -> float:
    t0 = time.perf_counter()
    for off, n in _ranges(buf.numel(), chunk):
        assert int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr() + off, n, 1)) == 0
    return time.perf_counter() - t0


def _unpin(buf: torch.Tensor, chunk: int) -> None:
    for off, _ in _ranges(buf.numel(), chunk):
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr() + off)


def _h2d(buf: torch.Tensor, dev: torch.Tensor, pinned: bool, step: int) -> float:
    """GB/s of H2D copies of ``step`` bytes (a copy may not span two registrations)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for off in range(0, buf.numel(), step):
        n = min(step, buf.numel() - off)
        dev[off:off + n].copy_(buf[off:off + n], non_blocking=pinned)
    torch.cuda.synchronize()
    return buf.numel() / (time.perf_counter() - t0) / 1e9


def _loop_while(fn, seconds_quiet: float = 2.0) -> dict[str, float]:
    """Max/median iteration of a GPU matmul loop, quiet and while ``fn`` runs in a thread."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def it() -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    quiet = []
    t_end = time.perf_counter() + seconds_quiet
    while time.perf_counter() < t_end:
        quiet.append(it())
    result: dict[str, float] = {}
    th = threading.Thread(target=lambda: result.setdefault("fn_s", fn()))
    busy = []
    th.start()
    while th.is_alive():
        busy.append(it())
    th.join()
    quiet.sort()
    busy.sort()
    return {"fn_s": result.get("fn_s"), "quiet_median_s": quiet[len(quiet) // 2],
            "busy_median_s": busy[len(busy) // 2] if busy else None,
            "busy_max_s": busy[-1] if busy else None, "busy_iterations": len(busy)}


def child(path: str, nbytes: int) -> None:
    """The restarted worker: map the resident file, pin it, copy it to the GPU."""
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    mm, buf, t_map = _map(path, nbytes, create=False)
    t_pin = _pin(buf, PIN_CHUNK)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    gbps = _h2d(buf, dev, pinned=True, step=PIN_CHUNK)
    _unpin(buf, PIN_CHUNK)
    # What the trainer does instead: bounce buffers, the bank pinned later.
    from kfp_nvrx.components.training.checkpoint.bank import Slot
    from kfp_nvrx.components.training.checkpoint.restore import restore_bounced

    n = 64 << 20
    slots = {str(i): Slot(o, n, (n,), torch.uint8) for i, o in enumerate(range(0, nbytes - n, n))}
    flat = {k: dev[s.offset:s.offset + n] for k, s in slots.items()}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    restore_bounced(buf, slots, nbytes, flat)
    bounced = time.perf_counter() - t0
    moved = len(slots) * n
    print(json.dumps({"map_s": t_map, "pin_s": t_pin, "h2d_pinned_gb_per_s": gbps,
                      "pin_then_copy_s": t_pin + nbytes / gbps / 1e9,
                      "bounced_s": bounced, "bounced_gb_per_s": moved / bounced / 1e9,
                      "bounced_equal": bool(torch.equal(dev[:moved].cpu(), buf[:moved]))}))


def main(argv: list[str] | None = None) -> int:
    """Runs every measurement once and writes one JSON file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gb", type=float, default=13.25)
    p.add_argument("--child", default="")
    args = p.parse_args(argv)
    nbytes = int(args.gb * 1e9) // 4096 * 4096
    if args.child:
        child(args.child, nbytes)
        return 0
    path = f"/dev/shm/kfp-nvrx-probe-{os.getpid()}"
    res = {"bench": "hostcopy_probe", "machine": machine_info(), "bytes": nbytes,
           "shm": os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize}
    try:
        torch.zeros(1, device="cuda")
        mm, buf, res["alloc_s"] = _map(path, nbytes, create=True)
        res["pin_chunked_while_matmul"] = _loop_while(lambda: _pin(buf, PIN_CHUNK))
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        res["h2d_pinned_gb_per_s"] = _h2d(buf, dev, pinned=True, step=PIN_CHUNK)
        _unpin(buf, PIN_CHUNK)
        res["h2d_pageable_gb_per_s"] = _h2d(buf, dev, pinned=False, step=1 << 30)
        res["pin_whole_while_matmul"] = _loop_while(lambda: _pin(buf, nbytes))
        _unpin(buf, nbytes)
        del dev
        torch.cuda.empty_cache()
        out = subprocess.run([sys.executable, "-m", "bench.hostcopy_probe", "--out", "-",
                              "--gb", str(args.gb), "--child", path],
                             capture_output=True, text=True, timeout=300)
        res["restarted_worker"] = (json.loads(out.stdout.strip().splitlines()[-1])
                                   if out.returncode == 0 else {"error": out.stderr[-2000:]})
        block = bytes(buf[: 1 << 30].numpy())
        t0 = time.perf_counter()
        zlib.crc32(block)
        res["crc32_gb_per_s"] = len(block) / (time.perf_counter() - t0) / 1e9
    finally:
        if os.path.exists(path):
            os.unlink(path)
    print(json.dumps(res, indent=1, default=str))
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
