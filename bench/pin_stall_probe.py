"""What stalls a training step while a staging bank is set up in the background (issue 29).

A restarted 1b worker's steps 10 and 20 after its start took 4-5 s (0.28 s usual) while its two
13 GB banks were allocated and pinned on a background thread. This probe runs a step-like GPU loop
(bf16 matmuls, one host sync per iteration) on the main thread and, one at a time with a quiet
window before each, the background work a bank's set-up and sealing does: ``posix_fallocate`` of
the tmpfs file, touching its pages, ``cudaHostRegister`` in the trainer's pieces and in smaller
paced ones, the CRC32 of the whole bank on 8 threads, unpinning and deleting it, then the
trainer's own bank path (``_Bank.map`` + ``pin``), paced and then in the loop's waits for the
GPU. The loop also allocates a few MB of host memory per iteration, as a training step does. Per
phase: its seconds and the loop's median and worst iteration against the quiet baseline.

``python -m bench.pin_stall_probe --out pin_stall.json [--gb 13.25]``
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import machine_info, write_json
from kfp_nvrx.components.training.checkpoint.bank import PIN_CHUNK, _host_register
from kfp_nvrx.components.training.checkpoint.gpu_waits import GpuWaits
from kfp_nvrx.components.training.checkpoint.integrity import crc_of


def _loop(stop: threading.Event, times: list[tuple[float, float]], waits: GpuWaits) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        t0 = time.perf_counter()
        c = a
        for _ in range(20):
            c = (c @ b) * 1e-4
        with waits.waiting():  # as the trainer's loss.item()
            c.sum().item()
        # Host buffers of a few MB each step (a batch, a pickled request): glibc maps them, which
        # needs the memory-map lock that populating and pinning pages hold.
        torch.empty(4 << 20, dtype=torch.uint8).fill_(1)
        times.append((t0, time.perf_counter() - t0))


def _phase(name: str, fn, times: list, out: dict, quiet: float = 2.0) -> None:
    time.sleep(quiet)
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    time.sleep(0.5)
    inside = [d for t, d in times if t0 - 0.05 <= t <= t1 + 0.5]
    base = [d for t, d in times if t0 - quiet <= t < t0]
    out[name] = {"seconds": round(t1 - t0, 3), "iterations": len(inside),
                 "median": round(statistics.median(inside), 4) if inside else None,
                 "worst": round(max(inside), 4) if inside else None,
                 "baseline_median": round(statistics.median(base), 4) if base else None}
    print(name, out[name], flush=True)


def trainer_bank(nbytes: int, state: dict, waits: GpuWaits | None = None) -> None:
    """The trainer's own path: a bank file allocated, mapped and pinned (paced, or in ``waits``)."""
    from kfp_nvrx.components.training.checkpoint.bank import _Bank

    bank = _Bank(0, Path(f"/dev/shm/pin-stall-probe-bank-{os.getpid()}"))
    bank.map(nbytes, create=True)
    bank.path.unlink()  # the mapping keeps the pages; nothing is left behind
    bank.pin([(o, min(PIN_CHUNK, nbytes - o)) for o in range(0, nbytes, PIN_CHUNK)], waits)
    state["bank"] = bank


class _ProbeBank:
    """The background work on one probe bank, a phase each (its state kept between phases).

    Args:
        nbytes: The bank's size.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.path = f"/dev/shm/pin-stall-probe-{os.getpid()}"
        self.state: dict = {}
        self.register = _host_register()
        self.cudart = torch.cuda.cudart()

    def falloc(self) -> None:
        nbytes, state = self.nbytes, self.state
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.posix_fallocate(fd, 0, nbytes)
        state["mm"] = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        state["buf"] = torch.frombuffer(state["mm"], dtype=torch.uint8)

    def pin(self, chunk: int, pause: float) -> None:
        nbytes, state = self.nbytes, self.state
        base = state["buf"].data_ptr()
        state["pinned"] = []
        for off in range(0, nbytes, chunk):
            t0 = time.perf_counter()
            assert self.register(base + off, min(chunk, nbytes - off), 1) == 0
            state["pinned"].append(base + off)
            if pause:
                time.sleep(pause * (time.perf_counter() - t0))

    def unpin(self) -> None:
        for ptr in self.state.pop("pinned"):
            self.cudart.cudaHostUnregister(ptr)

    def crc(self) -> None:
        nbytes, state = self.nbytes, self.state
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(crc_of, [state["buf"][o:o + PIN_CHUNK] for o in range(0, nbytes, PIN_CHUNK)]))

    def delete(self) -> None:
        self.state.pop("buf")
        self.state.pop("mm").close()
        os.unlink(self.path)


def main(argv: list[str] | None = None) -> int:
    """Runs every phase once and writes one JSON file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gb", type=float, default=13.25)
    args = p.parse_args(argv)
    nbytes = int(args.gb * 1e9) // 4096 * 4096
    times: list[tuple[float, float]] = []
    stop = threading.Event()
    waits = GpuWaits()
    loop = threading.Thread(target=_loop, args=(stop, times, waits), daemon=True)
    loop.start()
    time.sleep(3.0)  # warm-up
    out: dict = {"bench": "pin stall probe", "gb": args.gb, "machine": machine_info()}
    bank = _ProbeBank(nbytes)
    state = bank.state
    try:
        _phase("fallocate", bank.falloc, times, out)
        _phase("pin_256MiB", lambda: bank.pin(PIN_CHUNK, 0), times, out)
        _phase("crc32_8_threads", bank.crc, times, out)
        _phase("unpin", bank.unpin, times, out)
        _phase("pin_32MiB_paced", lambda: bank.pin(32 << 20, 1.0), times, out)
        _phase("unpin_again", bank.unpin, times, out)
        _phase("delete", bank.delete, times, out)
        _phase("trainer_bank_map_and_pin", lambda: trainer_bank(nbytes, state), times, out)
        _phase("trainer_bank_release", lambda: state.pop("bank").unmap(), times, out)
        _phase("trainer_bank_pin_in_gpu_waits", lambda: trainer_bank(nbytes, state, waits), times,
               out)
        _phase("trainer_bank_release_again", lambda: state.pop("bank").unmap(), times, out)
    finally:
        stop.set()
        loop.join()
        if os.path.exists(bank.path):
            os.unlink(bank.path)
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
