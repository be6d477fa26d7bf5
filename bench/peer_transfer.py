"""The peer copy of one rank's snapshot between two processes: seconds and GB/s (issue 36).

Two processes on this machine, each a node of its own (``KFP_NVRX_HOST_NODE``: a host-memory
folder each): rank 0 holds a sealed bank of ``--gb`` GB (random bytes, CRC32 per piece, its
manifest published as a snapshot's is), rank 1 receives it the way a round or a restore does
(:func:`~kfp_nvrx.components.training.checkpoint.peers.send_copy` /
:func:`~kfp_nvrx.components.training.checkpoint.peers.recv_copy` over a gloo group, kept only
after every piece matched its CRC32). The copy travels over loopback TCP here; between nodes it
is the pod network's. What it does not measure: the step-time cost of a round beside training
(bench.snapshots with replication on two GPUs does).

    python -m bench.peer_transfer --gb 13.25 --repeat 3 --out docs/benchmarks/peer_restore.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

WORKER = "bench.peer_transfer"


def sealed_bank(home: Any, nbytes: int, fill: int | None) -> tuple[Any, Any]:
    """A bank of ``nbytes`` with its CRC32s taken, as a sealed snapshot's; (bank, its bytes).

    ``fill``: the value of every byte; None: random bytes.
    """
    import torch

    from kfp_nvrx.components.training.checkpoint.bank import _Bank, _pin_ranges, layout_of
    from kfp_nvrx.components.training.checkpoint.integrity import CRC_CHUNK, piece_crcs

    slots = layout_of({"state": torch.empty(nbytes, dtype=torch.uint8, device="meta")})
    bank = _Bank(0, home.bank_path(0))
    bank.map(nbytes, create=True)
    view = bank.buffer[:nbytes]
    if fill is None:
        view.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    else:
        view.fill_(fill)
    bank.crc32 = piece_crcs(view, _pin_ranges(slots, nbytes, CRC_CHUNK))
    return bank, view


def _worker(rank: int, port: int, run_dir: str, nbytes: int, repeat: int, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from kfp_nvrx.components.training.checkpoint.hostcopy import HostCopyDir
    from kfp_nvrx.components.training.checkpoint.peers import recv_copy, send_copy
    from kfp_nvrx.components.training.checkpoint.replicas import Replicas, check_manifest

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
    home = HostCopyDir(run_dir, rank, 2)
    home.ensure()
    times = []
    if rank == 0:
        bank, buffer = sealed_bank(home, nbytes, None)
        home.publish(0, step=1, nbytes=nbytes, slots=[], objects={}, crc32=bank.crc32)
        manifest = home.manifest_path(0).read_bytes()
        for _ in range(repeat):
            dist.barrier(group)
            for work in send_copy(group, 1, manifest, buffer):
                work.wait()
            dist.barrier(group)
    else:
        files = Replicas(home)

        def take(m, fill):
            check_manifest(m, home, 0, 1)
            return files.receive(m, fill, 0)

        for _ in range(repeat):
            dist.barrier(group)
            t0 = time.perf_counter()
            recv_copy(group, 0, take)
            times.append(time.perf_counter() - t0)
            dist.barrier(group)
        Path(out).write_text(json.dumps(times))
    home.remove_rank_files()
    dist.destroy_process_group()


def _versions() -> dict:
    from importlib.metadata import version

    import torch

    return {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "nvidia-resiliency-ext": version("nvidia-resiliency-ext")}


@contextlib.contextmanager
def node_run() -> Iterator[tuple[Path, int, Path]]:
    """A run dir two node processes share (with its record), a free port and a temp folder."""
    from kfp_nvrx.components.launch.local.run import free_port

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        (run / "config.yaml").write_text("model: {}\n")
        yield run, free_port(), Path(tmp)


def spawn_nodes(module: str, calls: list[str]) -> list[int]:
    """Runs ``module.<calls[r]>`` as node ``r``'s process (a host-memory folder each); exit codes."""
    from kfp_nvrx.components.core.host_copy import NODE_ENV

    procs = [subprocess.Popen([sys.executable, "-c", f"import {module} as m; m.{call}"],
                              env={**os.environ, NODE_ENV: str(r)})
             for r, call in enumerate(calls)]
    return [p.wait() for p in procs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="size of the rank's state in GB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, help="JSON of the result")
    args = ap.parse_args(argv)
    nbytes = int(args.gb * 1e9)
    with node_run() as (run, port, tmp):
        out = tmp / "times.json"
        codes = spawn_nodes(WORKER, [f"_worker({r}, {port}, {str(run)!r}, {nbytes}, "
                                     f"{args.repeat}, {str(out)!r})" for r in range(2)])
        if codes != [0, 0]:
            print(f"peer_transfer: workers exited {codes}", file=sys.stderr)
            return 1
        times = json.loads(out.read_text())
    result = {"gb": nbytes / 1e9, "seconds": [round(t, 3) for t in times],
              "gb_per_s": [round(nbytes / 1e9 / t, 3) for t in times],
              "what": "one rank's sealed bank copied to a second process over gloo (loopback "
                      "TCP), CRC32-checked by the receiver before it is kept",
              "versions": _versions(), "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
