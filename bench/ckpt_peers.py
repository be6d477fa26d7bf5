"""The peers of the checkpoint-stall benchmark: torch's own sync and async savers.

Used by :mod:`bench.ckpt_stall`; every figure is taken in the same process and state as ours.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import median


def _tensors(obj: Any) -> list:
    """Local tensors of a (nested) state dict; DTensors contribute their local shard."""
    import torch
    from torch.distributed.tensor import DTensor

    out = []
    if isinstance(obj, DTensor):
        out.append(obj.to_local())
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            out.extend(_tensors(v))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(_tensors(v))
    return out


def _plain(obj: Any) -> Any:
    """The state with DTensors replaced by their local tensors (what torch.save can pickle)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def torch_async(state: dict, root: Path, reps: int, stager_opts: bool, fwd_bwd, opt_step) -> dict:
    """torch ``dcp.async_save``: default stager (thread), or DefaultStager + process checkpointer.

    Per save: seconds until the call returns, seconds until staging is complete (the state may
    only change after that) and seconds until the upload finished. With the stager, the second
    save runs the next forward/backward before waiting for staging, as a loop would.
    """
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    out: dict[str, Any] = {"runs": [], "errors": []}
    stager = None
    kwargs: dict[str, Any] = {}
    if stager_opts:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(True, True, True, True))
        kwargs = {"async_checkpointer_type": AsyncCheckpointerType.PROCESS}
    for i in range(reps):
        path = root / f"torch_async_{i}"
        shutil.rmtree(path, ignore_errors=True)
        overlap = stager_opts and i > 0
        for attempt in ("reused", "fresh"):
            try:
                save_kwargs = {**({"async_stager": stager} if stager else {}), **kwargs}
                run = _timed_async_save(state, path, save_kwargs, overlap, fwd_bwd, opt_step)
                out["runs"].append({**run, "stager": attempt})
                break
            except Exception as err:  # recorded: torch 2.11's reused stager failed here before
                out["errors"].append(f"save {i} ({attempt} stager): {type(err).__name__}: "
                                     f"{str(err)[:300]}")
                if not stager_opts or attempt == "fresh":
                    break
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                stager = DefaultStager(StagingOptions(True, True, True, True))
        shutil.rmtree(path, ignore_errors=True)
    if stager is not None:
        stager.close()
    rets = [r["return_s"] for r in out["runs"]]
    out["first_s"] = rets[0] if rets else None
    out["steady_s"] = median(rets[1:]) if len(rets) > 1 else out["first_s"]
    return out


def _timed_async_save(state: dict, path: Path, save_kwargs: dict[str, Any], overlap: bool,
                      fwd_bwd, opt_step) -> dict[str, Any]:
    """One ``dcp.async_save`` timed: call return, staging done, upload done (see torch_async)."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = dcp.async_save(state, checkpoint_id=str(path), **save_kwargs)
    ret = time.perf_counter() - t0
    staged_fut = getattr(res, "staging_completion", None)
    upload = getattr(res, "upload_completion", res)
    fb = 0.0
    if overlap:
        t1 = time.perf_counter()
        fwd_bwd()
        torch.cuda.synchronize()
        fb = time.perf_counter() - t1
    t2 = time.perf_counter()
    if staged_fut is not None:
        staged_fut.result()
    wait = time.perf_counter() - t2
    staged = time.perf_counter() - t0
    if overlap:
        opt_step()
    upload.result()
    return {"return_s": ret, "staged_s": staged, "wait_after_fwd_bwd_s": wait if overlap else None,
            "fwd_bwd_s": fb if overlap else None, "upload_done_s": time.perf_counter() - t0}


def torch_sync(state: dict, root: Path, kind: str) -> dict[str, float]:
    """Sync ``dcp.save`` or ``torch.save`` (GPU tensors, as a naive loop would call it)."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = root / f"sync_{kind}"
    shutil.rmtree(path, ignore_errors=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if kind == "dcp":
        dcp.save(state, checkpoint_id=str(path))
    else:
        path.mkdir(parents=True)
        torch.save(_plain(state), path / "model.pt")
    dt = time.perf_counter() - t0
    shutil.rmtree(path, ignore_errors=True)
    return {"blocking_s": dt}
