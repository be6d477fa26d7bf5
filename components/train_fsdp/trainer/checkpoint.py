"""DCP checkpoints written asynchronously with NVRx's async DCP writer, committed atomically.

Layout: ``<run_dir>/checkpoints/step_XXXXXXXX/`` holds a torch DCP checkpoint (reshardable to any
world size). It counts only once ``COMMITTED`` exists: rank 0 writes that marker (tmp + fsync +
rename) after every rank's write finished and the DCP metadata was written. Resume takes the newest
committed checkpoint whose files match the sizes recorded in its marker; torn ones are ignored.

One save is in flight at a time. The blocking part of a save is planning plus staging (GPU: D2H by
NVRx's persistent worker; CPU: a clone, because NVRx does not snapshot CPU tensors and later
in-place optimizer updates would leak into the file). Writing runs in NVRx's persistent worker
process; finalisation (gather write results, metadata, commit marker) is collective and happens at
a step boundary once every rank's write is done, bounded by ``checkpoint.finalize_timeout``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kfp_nvrx.components.train_fsdp.trainer.config import CheckpointConfig

COMMIT_MARKER = "COMMITTED"
_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A save that failed or did not finish in time (never swallowed)."""


def step_dir(root: Path, step: int) -> Path:
    """``<root>/step_XXXXXXXX``."""
    return root / f"{_PREFIX}{step:08d}"


def _dir_files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir())
            if p.is_file() and p.name != COMMIT_MARKER}


def committed_steps(root: Path) -> list[int]:
    """Steps with a commit marker, newest first."""
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        if p.name.startswith(_PREFIX) and (p / COMMIT_MARKER).is_file():
            try:
                steps.append(int(p.name[len(_PREFIX):]))
            except ValueError:
                continue
    return sorted(steps, reverse=True)


def verify(path: Path) -> str | None:
    """Checks a committed checkpoint's files against its marker; returns a problem or None."""
    try:
        marker = json.loads((path / COMMIT_MARKER).read_text())
    except (OSError, json.JSONDecodeError) as err:
        return f"unreadable commit marker ({err})"
    expected = marker.get("files", {})
    try:
        actual = _dir_files(path)
    except OSError as err:
        return f"cannot list files ({err})"
    for name, size in expected.items():
        if name not in actual:
            return f"missing file {name}"
        if actual[name] != size:
            return f"{name} is {actual[name]} bytes, expected {size} (truncated or corrupt)"
    return None


def select_checkpoint(root: Path, wanted: int = -1, log: Callable[[str], None] = print) -> int | None:
    """The newest intact committed step (or ``wanted``), logging any that are skipped."""
    for step in committed_steps(root):
        if wanted >= 0 and step != wanted:
            continue
        problem = verify(step_dir(root, step))
        if problem is None:
            return step
        log(f"checkpoint step {step} is damaged ({problem}); falling back to an older one")
    return None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _snapshot(obj: Any) -> Any:
    """Clones CPU tensors inside NVRx write buckets (the CPU path's staging)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, list):
        return [_snapshot(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_snapshot(x) for x in obj)
    return obj


@dataclass
class _InFlight:
    step: int
    path: Path
    started: float
    blocking_s: float
    finalize_fns: list[Callable[[], None]]
    local_done: bool = False


class Checkpointer:
    """Saves and loads the training state; every public method is collective.

    Args:
        run_dir: The run directory.
        cfg: The ``checkpoint`` config section.
        device: Training device (decides GPU staging vs CPU snapshot).
        on_commit: Called on rank 0 with (step, blocking_s, total_s, bytes) after each commit.
    """

    def __init__(self, run_dir: str | os.PathLike, cfg: CheckpointConfig, device: torch.device,
                 on_commit: Callable[[int, float, float, int], None] | None = None) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.cfg = cfg
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.on_commit = on_commit
        self.inflight: _InFlight | None = None
        self._caller = None  # NVRx PersistentAsyncCaller
        self._warming = False
        self.commits = 0  # saves committed by this incarnation
        self.last_commit_step = -1

    def warm_up(self) -> None:
        """Starts NVRx's persistent writer process now.

        The first save then does not pay for spawning a Python interpreter (seconds) inside the
        training loop.
        """
        if not self.cfg.async_save or self._caller is not None:
            return
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import (
            AsyncRequest,
            PersistentAsyncCaller,
        )

        # FT: NVRx persistent async checkpoint worker (spawned once, reused by every save).
        self._caller = PersistentAsyncCaller()
        self._caller.schedule_async_call(AsyncRequest(time.sleep, (0,), []))
        self._warming = True
        try:  # the writer's results queue is a multiprocessing Manager: another process to spawn
            from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

            filesystem_async._get_write_results_queue()
        except (ImportError, AttributeError):  # other NVRx versions: created on first save
            pass

    def _finish_warm_up(self) -> None:
        if self._warming:
            deadline = time.monotonic() + self.cfg.finalize_timeout
            while not self._caller.is_current_async_call_done(blocking=False, no_dist=True):
                if not self._caller.process.is_alive() or time.monotonic() > deadline:
                    raise CheckpointError("the NVRx checkpoint writer process did not start")
                time.sleep(0.01)
            self._warming = False

    # ---------------------------------------------------------------- save
    def save(self, step: int, state: dict[str, Any]) -> float:
        """Starts saving ``state`` as ``step``; returns the seconds this call blocked."""
        self.finalize(blocking=True)
        t0 = time.perf_counter()
        path = step_dir(self.root, step)
        if self.rank == 0:
            if path.exists():  # a torn leftover of an earlier incarnation
                shutil.rmtree(path)
            path.mkdir(parents=True)
        dist.barrier()
        if self.cfg.async_save:
            finalize_fns = self._save_async(path, state)
        else:
            dcp.save(state, checkpoint_id=str(path))
            finalize_fns = []
        blocking = time.perf_counter() - t0
        self.inflight = _InFlight(step, path, t0, blocking, finalize_fns,
                                  local_done=not self.cfg.async_save)
        if not self.cfg.async_save:
            self.finalize(blocking=True)
        return blocking

    def _save_async(self, path: Path, state: dict[str, Any]) -> list[Callable[[], None]]:
        # FT: NVRx async DCP writer: plan collectively, stage, write in a persistent worker.
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import (
            AsyncRequest,
            PersistentAsyncCaller,
        )
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
            FileSystemWriterAsync,
        )
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_finalize,
            save_state_dict_async_plan,
        )

        self._finish_warm_up()
        writer = FileSystemWriterAsync(str(path), thread_count=1)
        plan = save_state_dict_async_plan(state, writer)
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        if self.device.type != "cuda":
            # CPU: NVRx's staging assumes CUDA and would not copy CPU tensors: snapshot here.
            writer.write_buckets = _snapshot(writer.write_buckets)
            args = [args[0], writer.write_buckets, *args[2:]]
            preload_fn = None
        if save_fn is not None:
            if self._caller is None:
                self._caller = PersistentAsyncCaller()
            # Blocks until the worker staged the tensors (GPU D2H) or queued the snapshot.
            self._caller.schedule_async_call(AsyncRequest(save_fn, tuple(args), [],
                                                          preload_fn=preload_fn))
        return [lambda: save_state_dict_async_finalize(*plan)]

    def _poll_local(self, blocking_wait: float) -> bool:
        """Whether this rank's write finished (sticky), waiting at most ``blocking_wait`` s."""
        inf = self.inflight
        if inf.local_done:
            return True
        caller = self._caller
        deadline = time.monotonic() + blocking_wait
        while True:
            if caller is None or caller.is_current_async_call_done(blocking=False, no_dist=True):
                inf.local_done = True
                return True
            if caller.process is not None and not caller.process.is_alive():
                raise CheckpointError(f"checkpoint step {inf.step}: the NVRx writer process died "
                                      f"(exit code {caller.process.exitcode})")
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def _all(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32,
                         device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def finalize(self, blocking: bool) -> bool:
        """Commits the in-flight save once all ranks wrote it; True when nothing is pending.

        With ``blocking`` it waits up to ``checkpoint.finalize_timeout`` and raises
        :class:`CheckpointError` after that.
        """
        inf = self.inflight
        if inf is None:
            return True
        deadline = time.monotonic() + self.cfg.finalize_timeout
        while True:
            local = self._poll_local(0.05 if blocking else 0.0)
            if self._all(local):
                break
            if not blocking:
                return False
            if time.monotonic() >= deadline:
                raise CheckpointError(f"checkpoint step {inf.step} not written within "
                                      f"checkpoint.finalize_timeout={self.cfg.finalize_timeout:g}s")
        for fn in inf.finalize_fns:
            fn()  # gathers write results, coordinator writes .metadata; raises on worker errors
        dist.barrier()
        if self.rank == 0:
            files = _dir_files(inf.path)
            nbytes = sum(files.values())
            marker = {"step": inf.step, "world_size": self.world_size, "time": time.time(),
                      "bytes": nbytes, "files": files}
            _write_atomic(inf.path / COMMIT_MARKER, json.dumps(marker).encode())
            self._prune()
            if self.on_commit is not None:
                self.on_commit(inf.step, inf.blocking_s, time.perf_counter() - inf.started, nbytes)
        dist.barrier()
        self.commits += 1
        self.last_commit_step = inf.step
        self.inflight = None
        return True

    def _prune(self) -> None:
        """Keeps the newest ``checkpoint.keep`` committed checkpoints; drops older torn ones."""
        committed = committed_steps(self.root)
        for step in committed[self.cfg.keep:]:
            shutil.rmtree(step_dir(self.root, step), ignore_errors=True)
        if committed:
            oldest_kept = committed[: self.cfg.keep][-1]
            for p in self.root.glob(f"{_PREFIX}*"):
                if not (p / COMMIT_MARKER).exists() and p.name < step_dir(self.root, oldest_kept).name:
                    shutil.rmtree(p, ignore_errors=True)

    # ---------------------------------------------------------------- load
    def select(self, log: Callable[[str], None] = print) -> int | None:
        """Rank 0 picks the checkpoint to resume from; every rank gets the same answer."""
        choice = [select_checkpoint(self.root, self.cfg.load_step, log) if self.rank == 0 else None]
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def metadata_keys(self, step: int) -> set[str]:
        """Flattened keys stored in a checkpoint (e.g. to skip per-rank RNG of another world size)."""
        md = dcp.FileSystemReader(str(step_dir(self.root, step))).read_metadata()
        return set(md.state_dict_metadata)

    def load(self, step: int, state: dict[str, Any]) -> None:
        """Loads ``step`` into ``state`` in place (DCP reshards to this world size)."""
        dcp.load(state, checkpoint_id=str(step_dir(self.root, step)))

    def abort(self) -> None:
        """Error path: drops the pending save (it will never be committed) and kills the writer.

        NVRx's own shutdown joins its queue and would hang forever after a failed collective.
        """
        self.inflight = None
        caller, self._caller = self._caller, None
        if caller is not None and caller.process is not None:
            caller.process.kill()
            caller.process.join(timeout=10)
            caller.process = None

    def close(self) -> None:
        """Finishes the pending save (blocking) and stops the writer process."""
        try:
            self.finalize(blocking=True)
        finally:
            if self._caller is not None:
                self._caller.close()
                self._caller = None
