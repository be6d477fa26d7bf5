"""What a replication round costs the steps of a run that trains beside it (issue 36).

Two processes on this machine, each a node of its own (``KFP_NVRX_HOST_NODE``): the *trainer*
trains the preset's model with the shipped model, optimizer and step (one GPU), and the *partner*
stands for the peer node. Both hold a sealed bank of ``--gb`` GB (the 1b state per rank is 13.25
GB) and run the shipped :class:`~kfp_nvrx.components.training.checkpoint.replication.Round`
against each other, as two nodes of a job do after every sealed snapshot: each sends its bank
and receives the other's, which it keeps only once every piece matched its CRC32. The trainer
times every step: quiet steps before, steps while a round is in flight, quiet steps after.

One GPU cannot hold a second training rank, so the copy does not travel in a group of the
training's world: the two processes share a gloo group of their own (a TCPStore and a
``ProcessGroupGloo``, registered so the shipped ``send_copy``/``recv_copy`` address it by rank).
What it leaves out: the loop's one small collective per step while a round runs (the trainer's
``replica`` events report it as ``loop_s``).

    python -m bench.replica_cost --preset 1b --gb 13.25 --rounds 3 --out peer_round_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import log, machine_info, median, write_json
from bench.peer_transfer import node_run, sealed_bank, spawn_nodes

#: Steps before the first quiet step is timed (compile-free eager warm-up, allocator).
WARM = 8


def peer_group(rank: int, port: int) -> Any:
    """A two-process gloo group outside either process's world, addressable by rank 0/1."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=300))
    group = dist.ProcessGroupGloo(dist.PrefixStore("peer", store), rank, 2,
                                  timedelta(seconds=300))
    # dist.isend/recv map a rank through the group's registration; the group's ranks are 0 and 1.
    _world.pg_group_ranks[group] = {0: 0, 1: 1}
    return group


def _peers(rank: int, port: int, home: Any) -> Any:
    from kfp_nvrx.components.training.checkpoint.peers import Peers
    from kfp_nvrx.components.training.checkpoint.replicas import Replicas

    other = 1 - rank
    return Peers(rank, 2, [other], [other], peer_group(rank, port), Replicas(home), 2)


def _round(peers: Any, home: Any, bank: Any, view: Any, step: int) -> Any:
    """Publishes the bank as ``step``'s snapshot and starts the shipped round on it."""
    from kfp_nvrx.components.training.checkpoint.replication import Round

    home.publish(0, step=step, nbytes=view.numel(), slots=[], objects={}, crc32=bank.crc32)
    return Round(peers, step, home.manifest_path(0).read_bytes(), view)


def _init_trainer_world() -> Any:
    import torch
    import torch.distributed as dist

    from bench.common import init_single_gpu, single_process_env

    if torch.cuda.is_available():
        return init_single_gpu()
    for k, v in single_process_env().items():
        os.environ.setdefault(k, v)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def trainer(port: int, run_dir: str, nbytes: int, out: str, plan: dict[str, Any]) -> None:
    """Rank 0: trains and times its steps, quiet and beside each round.

    Args:
        port: The peer group's TCPStore port.
        run_dir: The run both processes' host-memory folders belong to.
        nbytes: Bytes of each bank.
        out: Where the step times go (JSON).
        plan: ``preset``, ``rounds`` and ``quiet`` (steps timed before the rounds).
    """
    preset, rounds, quiet = plan["preset"], plan["rounds"], plan["quiet"]
    import torch.distributed as dist

    from bench.ckpt_stall import _trainer
    from kfp_nvrx.components.training.checkpoint.hostcopy import HostCopyDir

    device = _init_trainer_world()
    *_, step, _fwd, _opt = _trainer(preset, device)
    home = HostCopyDir(run_dir, 0, 2)
    home.ensure()
    bank, view = sealed_bank(home, nbytes, 1)
    peers = _peers(0, port, home)

    def timed(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()  # ends in loss.item(): the step's GPU work is done
            times.append(time.perf_counter() - t0)
        return times

    timed(WARM)
    before, beside, after, round_s = timed(quiet), [], [], []
    for r in range(1, rounds + 1):
        dist.barrier(peers.group)  # the rounds of a job start from one collective
        rnd = _round(peers, home, bank, view, r)
        while not rnd.finished():
            beside.extend(timed(1))
        rnd.join()
        if not rnd.ok:
            raise RuntimeError(f"round {r}: {rnd.error}")
        round_s.append(rnd.seconds)
        after.extend(timed(quiet // 2))
    dist.barrier(peers.group)
    Path(out).write_text(json.dumps({"before": before, "beside": beside, "after": after,
                                     "round_s": round_s}))
    home.remove_rank_files()


def partner(port: int, run_dir: str, nbytes: int, rounds: int) -> None:
    """Rank 1: the peer node; sends its bank and keeps rank 0's, round after round."""
    import torch.distributed as dist

    from kfp_nvrx.components.training.checkpoint.hostcopy import HostCopyDir

    home = HostCopyDir(run_dir, 1, 2)
    home.ensure()
    bank, view = sealed_bank(home, nbytes, 2)
    peers = _peers(1, port, home)
    for r in range(1, rounds + 1):
        dist.barrier(peers.group)
        rnd = _round(peers, home, bank, view, r)
        rnd.join()
        if not rnd.ok:
            raise RuntimeError(f"round {r}: {rnd.error}")
    dist.barrier(peers.group)
    home.remove_rank_files()


def summarize(times: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    """Quiet step, steps beside a round, and the round's cost as a share of its steps."""
    quiet = median(times["before"] + times["after"])
    beside = times["beside"]
    excess = sum(t - quiet for t in beside)
    rounds = times["round_s"]
    return {
        "quiet_step_s": round(quiet, 4),
        "steps_beside": len(beside),
        "beside_step_s": {"median": round(median(beside), 4) if beside else None,
                          "worst": round(max(beside), 4) if beside else None},
        "excess_per_round_s": round(excess / max(1, len(rounds)), 3),
        # Rounds back to back (a snapshot sealed whenever the last round ends): the worst share.
        "share_beside_rounds": round(excess / (len(beside) * quiet), 4) if beside else None,
        "round_s": [round(s, 2) for s in rounds],
        "gb_per_s_each_way": [round(nbytes / 1e9 / s, 2) for s in rounds],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--gb", type=float, default=13.25, help="each rank's bank in GB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quiet", type=int, default=30, help="quiet steps timed before the rounds")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    nbytes = int(args.gb * 1e9)
    with node_run() as (run, port, tmp):
        out = tmp / "times.json"
        plan = {"preset": args.preset, "rounds": args.rounds, "quiet": args.quiet}
        calls = [f"trainer({port}, {str(run)!r}, {nbytes}, {str(out)!r}, {plan!r})",
                 f"partner({port}, {str(run)!r}, {nbytes}, {args.rounds})"]
        codes = spawn_nodes("bench.replica_cost", calls)
        if codes != [0, 0]:
            log(f"replica_cost: processes exited {codes}")
            return 1
        times = json.loads(out.read_text())
    result = {"bench": "replica_cost", "preset": args.preset, "gb": nbytes / 1e9,
              **summarize(times, nbytes),
              "what": "the shipped replication Round (send the sealed bank, receive and "
                      "CRC-check the peer's) between two processes over loopback gloo, while "
                      "the first trains the preset on the GPU",
              "steps": {k: [round(t, 4) for t in v] for k, v in times.items()},
              "machine": machine_info()}
    print(json.dumps({k: v for k, v in result.items() if k not in ("steps", "machine")}, indent=1))
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
