"""One rank of a small gloo job whose ranks sit on different simulated nodes (peer copies).

Run as ``python -m support.peer_ranks PHASE RANK WORLD PORT RUN_DIR OUT [KEY=VALUE ...]`` from
tests/, with ``KFP_NVRX_HOST_NODE`` naming the rank's node (its host memory folder):

* ``snapshot``: trains 2 steps of the tiny preset, snapshots step 2 (no durable write), waits
  until every rank's copy is held by its peer, saves its tensors to ``OUT`` and dies with its
  files left behind (a worker that is killed).
* ``restore``: a restarted worker: resumes, and saves what it loaded, the step and where each
  rank's state came from to ``OUT``.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from kfp_nvrx.components.training.checkpoint import Checkpointer
from kfp_nvrx.components.training.checkpoint.staging import flat_state
from kfp_nvrx.components.training.ranks import all_ranks
from kfp_nvrx.components.training.trainer.build import full_state


def _tensors(state):
    return {k: (v.to_local() if hasattr(v, "to_local") else v).clone()
            for k, v in flat_state(state).items() if isinstance(v, torch.Tensor)}


def main(argv: list[str]) -> None:
    """``PHASE RANK WORLD PORT RUN_DIR OUT [KEY=VALUE ...]`` (see the module docstring)."""
    phase, rank_text, world_text, port, run_dir, out, *overrides = argv
    rank, world = int(rank_text), int(world_text)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    # unit/test_staging.py's tiny CPU trainer (tests/ is the working directory).
    from unit.test_staging import _trainer

    cfg, model, opt, sched, train, step = _trainer(["checkpoint.staging=blocking",
                                                    "train.deterministic=true", *overrides])

    def state():
        return full_state(model, opt, sched, train, {"note": "ft"}, 0)

    ckpt = Checkpointer(run_dir, cfg.checkpoint, torch.device("cpu"))
    notes: list[str] = []
    ckpt.log = notes.append
    if phase == "snapshot":
        step()
        step()
        current = state()
        ckpt.save(train.step, current)
        held = False
        for _ in range(400):  # ticks are collective: every rank runs the same number
            if ckpt.replicator is not None:
                ckpt.replicator.tick()
            held = all_ranks(ckpt.replicator is not None
                             and ckpt.replicator.replicated == train.step, torch.device("cpu"))
            if held:
                break
            time.sleep(0.02)
        torch.save({"tensors": _tensors(current), "held": held, "notes": notes}, out)
        dist.barrier()
        os._exit(0)  # killed: no close, no clean-up; the banks and copies stay
    step, loaded = ckpt.resume(state)
    torch.save({"step": step, "tensors": _tensors(loaded) if loaded is not None else None,
                "sources": ckpt.sources, "peer_bytes": ckpt.peer_bytes, "notes": notes}, out)
    ckpt.abort()
    ckpt.discard_host_copy()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
