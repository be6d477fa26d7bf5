"""Everything checked before a process group exists: config, faults, dataset, run dir."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.train_fsdp.trainer.config import Config, load_config
from kfp_nvrx.components.train_fsdp.trainer.faults import Fault, parse_fault

CONFIG_FILE = "config.yaml"


def validate_inputs(config: str, overrides: list[str], faults: list[str]) -> tuple[Config, list[Fault]]:
    """Loads the config, parses faults and opens the dataset; raises UserError on bad input."""
    cfg = load_config(config, overrides)
    parsed = [parse_fault(f) for f in faults]
    interval = cfg.checkpoint.interval
    for f in parsed:
        if f.step > cfg.train.steps:
            raise UserError("--fault", f"{f.kind}@{f.step} is after the last step ({cfg.train.steps})")
        if f.kind == "kill-in-ckpt" and (not interval or f.step % interval):
            raise UserError("--fault", f"kill-in-ckpt@{f.step} needs a checkpoint step "
                            f"(a multiple of checkpoint.interval={interval})")
    check_in_process_timeouts(cfg)
    if not cfg.data.path:
        raise UserError("data.path", "not set; pass --set data.path=DIR (from prepare-data)")
    from kfp_nvrx.components.train_fsdp.trainer.data import TokenDataset

    TokenDataset(cfg.data.path, cfg.data.split).check_fits(cfg.data.seq_len, cfg.model.vocab_size)
    return cfg, parsed


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


def check_run_dir(run_dir: Path) -> Path:
    """A usable run directory: no ``..`` components, not a file."""
    if ".." in Path(run_dir).parts:
        raise UserError("--run-dir", f"{run_dir} must not contain '..'")
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError("--run-dir", f"{run_dir} exists and is not a directory")
    return run_dir


def check_checkpoint_model(cfg: Config, run_dir: Path) -> None:
    """The run dir's newest committed checkpoint must hold this config's model (names and shapes).

    Otherwise reusing a run dir with another model fails inside every worker, once per restart
    (and a same-named model of other sizes only at ``dcp.load``, with a traceback).
    """
    from kfp_nvrx.components.train_fsdp.trainer.checkpoint.files import committed_steps, step_dir

    root = run_dir / "checkpoints"
    steps = [s for s in committed_steps(root)
             if cfg.checkpoint.load_step < 0 or s == cfg.checkpoint.load_step]
    if not steps:
        return
    import torch
    import torch.distributed.checkpoint as dcp

    from kfp_nvrx.components.train_fsdp.trainer.model import build_model

    try:
        md = dcp.FileSystemReader(str(step_dir(root, steps[0]))).read_metadata()
        with torch.device("meta"):
            model = build_model(cfg.model)
    except Exception:  # noqa: BLE001 - unreadable (resume falls back) or a meta-unfriendly factory
        return
    theirs = {k[len("model."):]: tuple(m.size) for k, m in md.state_dict_metadata.items()
              if k.startswith("model.") and hasattr(m, "size")}
    ours = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    for key in sorted(set(ours) | set(theirs)):
        if theirs and ours.get(key) != theirs.get(key):
            raise UserError("checkpoint", f"step {steps[0]} in {root} was written by a different "
                            f"model ({key}: checkpoint {theirs.get(key, 'none')}, this config "
                            f"{ours.get(key, 'none')}); use a fresh --run-dir or the model.* "
                            "settings it was trained with")


def write_config(cfg: Config, run_dir: Path) -> None:
    """Writes the resolved config (atomically; every rank writes the same bytes)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{CONFIG_FILE}.{os.getpid()}.tmp"
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, run_dir / CONFIG_FILE)


def prepare_job(config: str, overrides: list[str], faults: list[str], run_dir: Path):
    """Validates everything, then creates the run dir and the per-worker Job."""
    cfg, parsed = validate_inputs(config, overrides, faults)
    check_run_dir(run_dir)
    check_checkpoint_model(cfg, run_dir)
    check_launcher_env()
    from kfp_nvrx.components.train_fsdp.trainer.data import TokenDataset
    from kfp_nvrx.components.train_fsdp.trainer.resilience import Monitor
    from kfp_nvrx.components.train_fsdp.trainer.train import Job, pick_device

    write_config(cfg, run_dir)
    return Job(cfg=cfg, run_dir=run_dir, faults=parsed,
               data=TokenDataset(cfg.data.path, cfg.data.split), device=pick_device(cfg),
               monitor=Monitor(cfg.resilience))
