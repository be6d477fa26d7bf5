"""Everything checked before a process group exists: config, faults, dataset, run dir."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kfp_nvrx.components.core.ckpt_store import open_store
from kfp_nvrx.components.core.config import Config, load_config
from kfp_nvrx.components.core.elastic_env import env_int
from kfp_nvrx.components.core.events import EventLog, Start, read_events
from kfp_nvrx.components.core.faults import Fault, check_faults
from kfp_nvrx.components.core.rounds import current_budget, join_event
from kfp_nvrx.components.core.run_record import check_run_dir, record_config
from kfp_nvrx.components.core.safetensors_header import FLOAT_DTYPES, read_entries
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.trainer.job import give_up

if TYPE_CHECKING:  # data.py imports torch and numpy: imported where a dataset is opened
    from kfp_nvrx.components.training.trainer.data import TokenDataset
    from kfp_nvrx.components.training.trainer.job import Job


def validate_inputs(config: str, overrides: list[str], faults: list[str], *,
                    verify_data: bool = False) -> tuple[Config, list[Fault], TokenDataset]:
    """Loads the config, parses faults and opens the dataset; raises UserError on bad input.

    ``verify_data`` also checks the shards' sha256 when the split is small enough to read
    (the launcher does it once; every worker repeating it would multiply the reads).

    Returns:
        The config, the parsed faults and the opened dataset (the worker trains on it).
    """
    cfg = load_config(config, overrides)
    # The world size is not checked here: an elastic job may run with fewer workers than its
    # launcher allowed for (the launcher checks against the most it starts).
    parsed = check_faults(faults, cfg.train.steps, cfg.checkpoint.interval)
    check_in_process_timeouts(cfg)
    if not cfg.data.path:
        raise UserError("data.path", "not set; give the prepare-data directory with "
                        "`overrides=data.path=DIR`")
    from kfp_nvrx.components.training.trainer.data import TokenDataset

    dataset = TokenDataset(cfg.data.path, cfg.data.split)
    dataset.check_fits(cfg.data.seq_len, cfg.model.vocab_size)
    if verify_data:
        from kfp_nvrx.components.data.shards import check_checksums

        check_checksums(cfg.data.path, dataset.index, [cfg.data.split], "data.path")
    return cfg, parsed, dataset


def check_in_process_timeouts(cfg: Config) -> None:
    """In-process restart needs the collective timeout on the right side of ``hard_timeout``.

    NCCL: the wrapper aborts blocked collectives, and NCCL's own watchdog must not fire first, so
    ``pg_timeout > hard_timeout`` (NVRx rule). gloo: a blocked collective cannot be aborted, the
    survivors wait ``pg_timeout``, and the monitor kills them at ``hard_timeout``, so
    ``pg_timeout < soft_timeout`` keeps the restart in-process.
    """
    r = cfg.resilience
    if not r.in_process:
        return
    import torch

    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if cuda and r.pg_timeout <= r.hard_timeout:
        raise UserError("resilience.pg_timeout", f"must exceed resilience.hard_timeout "
                        f"({r.hard_timeout:g}) with NCCL and in-process restart")
    if not cuda and r.pg_timeout >= r.soft_timeout:
        raise UserError("resilience.pg_timeout", f"must be below resilience.soft_timeout "
                        f"({r.soft_timeout:g}) with gloo: blocked gloo collectives cannot be aborted")


#: What torchrun / ft_launcher give every worker; without them init_process_group fails deep down.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def check_launcher_env() -> None:
    """The worker was started by a launcher (raises UserError naming ``environment``)."""
    missing = [k for k in LAUNCHER_ENV if not os.environ.get(k)]
    if missing:
        raise UserError("environment", f"{', '.join(missing)} not set: the trainer runs under a "
                        "launcher (kfp-nvrx launch-local, ft_launcher or torchrun), not on its own")


def model_layout(cfg: Config) -> dict[str, tuple[tuple[int, ...], bool]] | None:
    """This config's model's state dict: each key's shape and whether it is floating point.

    Built on the meta device (no memory). None when the model factory cannot build there: the
    checks that compare them then leave the misfit to be reported where the weights are loaded.
    """
    import torch

    from kfp_nvrx.components.training.model import build_model

    try:
        with torch.device("meta"):
            return {k: (tuple(t.shape), t.dtype.is_floating_point)
                    for k, t in build_model(cfg.model).state_dict().items()}
    except Exception:  # noqa: BLE001 - a meta-unfriendly factory
        return None


def model_shapes(cfg: Config) -> dict[str, tuple[int, ...]] | None:
    """This config's model's state dict keys and shapes (see :func:`model_layout`)."""
    layout = model_layout(cfg)
    return None if layout is None else {k: shape for k, (shape, _) in layout.items()}


def check_checkpoint_model(cfg: Config, run_dir: Path) -> None:
    """The run dir's newest committed checkpoint must hold this config's model (names and shapes).

    Otherwise reusing a run dir with another model fails inside every worker, once per restart
    (and a same-named model of other sizes only at ``dcp.load``, with a traceback).
    """
    store = open_store(run_dir, cfg.checkpoint.store)
    root = store.where
    steps = [s for s in store.committed_steps()
             if cfg.checkpoint.load_step < 0 or s == cfg.checkpoint.load_step]
    if not steps:
        return
    if steps[0] > cfg.train.steps:
        raise UserError("train.steps", f"{cfg.train.steps} is below the newest committed "
                        f"checkpoint (step {steps[0]}) in {root}: the run would end at once "
                        "without training; raise train.steps or use a fresh `run_dir`")
    from kfp_nvrx.components.training.checkpoint.dcp_io import read_metadata

    try:
        md = read_metadata(store.location(steps[0]))
    except Exception:  # noqa: BLE001 - unreadable: resume falls back to an older one
        return
    ours = model_shapes(cfg)
    if ours is None:
        return
    theirs = {k[len("model."):]: tuple(m.size) for k, m in md.state_dict_metadata.items()
              if k.startswith("model.") and hasattr(m, "size")}
    for key in sorted(set(ours) | set(theirs)):
        if theirs and ours.get(key) != theirs.get(key):
            raise UserError("checkpoint", f"step {steps[0]} in {root} was written by a different "
                            f"model ({key}: checkpoint {theirs.get(key, 'none')}, this config "
                            f"{ours.get(key, 'none')}); use a fresh `run_dir` or the model.* "
                            "settings it was trained with")


def check_init_from(cfg: Config) -> None:
    """``checkpoint.init_from`` is a safetensors file whose tensors fit this config's model.

    Read from the header alone (a few bytes); otherwise every worker would fail at the warm start,
    once per restart.
    """
    if not cfg.checkpoint.init_from:
        return
    entries = read_entries("checkpoint.init_from", cfg.checkpoint.init_from)
    layout = model_layout(cfg)
    if layout is None:  # warm_start reports a misfit
        return
    shapes = {k: shape for k, (_, shape) in entries.items()}
    ours = {k: shape for k, (shape, _) in layout.items()}
    for key in sorted(set(ours) | set(shapes)):
        if ours.get(key) != shapes.get(key):
            raise UserError("checkpoint.init_from", f"{cfg.checkpoint.init_from} does not fit "
                            f"this config's model ({key}: file {shapes.get(key, 'none')}, model "
                            f"{ours.get(key, 'none')}); use the model.* settings it was "
                            "trained with")
    for key in sorted(ours):
        dtype, floating = entries[key][0], layout[key][1]
        if floating != (dtype in FLOAT_DTYPES):
            raise UserError("checkpoint.init_from", f"{cfg.checkpoint.init_from} holds {key} as "
                            f"{dtype}, but the model's {key} is "
                            f"{'floating point' if floating else 'an integer tensor'}: these "
                            "are not weights of this model (re-export them)")


def check_device(cfg: Config) -> None:
    """``train.device=cuda`` needs a GPU this process can see (else every worker fails in CUDA)."""
    if cfg.train.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise UserError("train.device", "is cuda but this process sees no CUDA GPU; use "
                        "`overrides=train.device=cpu` (or auto) or run on a GPU node")


def check_job(config: str, overrides: list[str], faults: list[str], run_dir: Path) -> int:
    """The launcher's preflight (``--check``): what :func:`prepare_job` checks, nothing written.

    Returns:
        0 when every check passes; else 2 after printing the UserError as one JSON line
        (``field``, ``message``) for the launcher to raise again.
    """
    import importlib.util

    # Most checks need no torch (the dataset's index and shards, the run dir's records); the
    # workers do: a missing install is said here, as the preflight's import error.
    if importlib.util.find_spec("torch") is None:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")
    try:
        cfg, _, _ = validate_inputs(config, overrides, faults, verify_data=True)
        check_device(cfg)
        check_init_from(cfg)
        check_run_dir(run_dir, cfg, crc=True)  # the launcher reads a load_step checkpoint once
        check_checkpoint_model(cfg, run_dir)
    except UserError as err:
        print(json.dumps({"field": err.field, "message": err.message}), flush=True)
        return UserError.exit_code
    return 0


def env_restart_count() -> int:
    """``TORCHELASTIC_RESTART_COUNT``: worker-group restarts so far (ft_launcher, torchrun)."""
    return env_int("TORCHELASTIC_RESTART_COUNT", or_default=True)


def join_round(cfg: Config, run_dir: Path) -> None:
    """Records this node's join of the rendezvous round; on rank 0, keeps the restart budget.

    Each node's first worker writes the :class:`~.events.Join` (the run's rounds say which
    layer restarted). ``resilience.max_restarts`` is the job's budget of in-job restarts, all
    nodes together (:mod:`.rounds`); ft_launcher only counts its own node's failures, so rank 0
    judges it for the job: when this round is one restart too many, it says so in one line
    and stops its agent, which stops this node's workers and gives up (the pod's exit 1 ends
    the job under both job APIs; ft_launcher's own count stays a backstop).
    """
    if env_int("LOCAL_RANK", or_default=True) != 0:
        return
    mine = EventLog(run_dir).emit(join_event())
    if env_int("RANK", or_default=True) != 0:
        return
    res = cfg.resilience
    used = current_budget(run_dir, mine, res.max_restarts, wait_s=res.barrier_timeout)
    if not used.spent:
        return
    give_up(used.line(), res.workers_stop_timeout)


def launch_started(run_dir: Path) -> bool:
    """Whether this launch started before: this worker's start is a restart's.

    An in-job restart (``TORCHELASTIC_RESTART_COUNT``), or a new agent (a recreated pod) of a
    launch whose rank 0 already recorded a ``start`` under this rendezvous id: the same test
    the trainer's ``Recovery`` applies (``first_start``), so the two never disagree.
    """
    if env_restart_count() > 0:
        return True
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return bool(run_id) and any(isinstance(e, Start) and e.run_id == run_id and e.iteration == 0
                                for e in read_events(run_dir))


def first_start_pins_dropped(cfg: Config) -> Config:
    """``cfg`` as a restart checks it: without ``checkpoint.load_step``.

    The pin is the launch's first start's only: the run trained on from that step and may have
    pruned it since; a restart resumes from the newest intact step (``Recovery``), so re-checking
    the pin would fail every restarted worker with "no committed checkpoint".
    """
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load_step=-1))


def prepare_job(config: str, overrides: list[str], faults: list[str], run_dir: Path) -> Job:
    """Validates everything, then creates the run dir and the per-worker Job."""
    t0 = time.time()
    cfg, parsed, data = validate_inputs(config, overrides, faults)
    check_device(cfg)
    check_init_from(cfg)
    restart = launch_started(run_dir)
    check_run_dir(run_dir, first_start_pins_dropped(cfg) if restart else cfg)
    if not restart:
        # A restarted worker group (ft_launcher's in-job restart, or a recreated pod) resumes
        # from checkpoints this job wrote with this config, after the first group checked the
        # run dir: building the model on the meta device and reading the DCP metadata again
        # cost a second per restart.
        check_checkpoint_model(cfg, run_dir)
    check_launcher_env()
    from kfp_nvrx.components.training.trainer.job import Job
    from kfp_nvrx.components.training.trainer.resilience import Monitor
    from kfp_nvrx.components.training.trainer.train import pg_backend, pick_device

    record_config(cfg, run_dir)
    join_round(cfg, run_dir)
    t_checked = time.time()
    device = pick_device(cfg)
    t_device = time.time()
    monitor = Monitor(cfg.resilience, pg_backend(device))
    boot = {"checks": t_checked - t0, "cuda_context": t_device - t_checked,
            "nvrx_client": time.time() - t_device}
    return Job(cfg=cfg, run_dir=run_dir, faults=parsed, data=data, device=device, monitor=monitor,
               boot=boot)
