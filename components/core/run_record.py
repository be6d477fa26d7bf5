"""The run's config record: what a resume in an existing run dir must keep.

``<run_dir>/config.yaml`` is written by the run's first start and never replaced. A later start
is a resume of the checkpoints beside it, so it must train the same model on the same data in the
same order: model.*, data.path and train.seed must equal the record, unless the user names the
key in ``checkpoint.allow_changes`` (a documented, explicit override). ``checkpoint.load_step=N``
must name a committed step. Everything else (more steps, another learning rate) may change; the
newest differing config is kept in ``config.resumed.yaml``. Next to it, ``dataset.json`` records
the data by content (:mod:`.dataset_record`): the same ``data.path`` may hold other data later.

The records are what makes checkpoints resumable: a run dir holding committed checkpoints whose
config.yaml is missing or cut down (or whose dataset.json is missing) is refused with the fix,
never given a new record written from the config of the start that found it so. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

from kfp_nvrx.components.core.atomic import write_atomic
from kfp_nvrx.components.core.ckpt_store import CheckpointStore, open_store
from kfp_nvrx.components.core.config import GUARDED_KEYS, Config, check_allow_changes
from kfp_nvrx.components.core.dataset_record import (
    check_dataset,
    record_dataset,
)
from kfp_nvrx.components.core.ownership import check_run_dir_owned, claim_run_dir
from kfp_nvrx.components.core.recorded_config import flat_keys, read_recorded_config
from kfp_nvrx.components.core.rundir import (
    CONFIG_FILE,
    RESUMED_CONFIG_FILE,
    check_run_dir_links,
    link_in,
    refuse_link,
)
from kfp_nvrx.components.core.store_kinds import DEFAULT_KIND, STORE_KEY
from kfp_nvrx.components.errors import UserError


def _same(key: str, recorded: Any, wanted: Any) -> bool:
    if recorded == wanted:
        return True
    if key == "data.path" and isinstance(recorded, str) and isinstance(wanted, str) \
            and recorded and wanted:
        return os.path.realpath(recorded) == os.path.realpath(wanted)
    return False


def _check_load_step(cfg: Config, store: CheckpointStore, crc: bool) -> None:
    """``checkpoint.load_step=N`` must name a committed, intact step."""
    want = cfg.checkpoint.load_step
    if want < 0:
        return
    steps = store.committed_steps()
    if want not in steps:
        have = ", ".join(map(str, sorted(steps))) or "none"
        raise UserError("checkpoint.load_step", f"{want} is no committed checkpoint in "
                        f"{store.where} (committed: {have}); give one of those, or -1 for the "
                        "newest")
    problem = store.problem(want, crc=crc)
    if problem:
        raise UserError("checkpoint.load_step", f"step {want} is damaged: {problem}; give "
                        "another step, or -1 for the newest intact one")


def _with_store(recorded: dict[str, Any]) -> dict[str, Any]:
    """``recorded`` with the store a record from before ``checkpoint.store`` means: the volume."""
    return {STORE_KEY: DEFAULT_KIND, **recorded}


def _check_store(cfg: Config, run_dir: Path) -> None:
    """``checkpoint.store`` must be the recorded one: the run's checkpoints are in that store.

    Not a key ``checkpoint.allow_changes`` may name: a resume in another store would find none
    of them and train from scratch beside them.
    """
    recorded = read_recorded_config(run_dir)
    if recorded is None:
        return
    was, wanted = _with_store(recorded)[STORE_KEY], cfg.checkpoint.store
    if was != wanted:
        raise UserError(STORE_KEY, f"is {wanted!r}, but {run_dir / CONFIG_FILE} records {was!r}: "
                        f"this run's checkpoints are in that store; use `overrides={STORE_KEY}="
                        f"{was}`, or a fresh `run_dir`")


def _allowed(key: str, allowed: list[str]) -> bool:
    return any(key == a or key.startswith(f"{a}.") for a in allowed)


def _check_record(cfg: Config, run_dir: Path, steps: list[int], allowed: list[str]) -> None:
    """The guarded keys must equal a readable, complete config.yaml record.

    A run dir with committed checkpoints and no record, or a record missing guarded keys, is
    refused: without it nothing says what the checkpoints were trained with, and the start would
    write the new values as the record. Unless every guarded key is allowed to change.
    """
    wanted = flat_keys(cfg.to_dict())
    guarded = [k for k in sorted(wanted) if k.startswith(GUARDED_KEYS) and not _allowed(k, allowed)]
    recorded = read_recorded_config(run_dir)
    if not guarded:
        return
    path = run_dir / CONFIG_FILE
    if recorded is None:
        if steps:
            raise UserError("run_dir", f"{path} is missing, but the run dir holds committed "
                            f"checkpoints (newest: step {steps[0]}) and the record says what they "
                            "were trained with; restore it, use a fresh `run_dir`, or `overrides="
                            "checkpoint.allow_changes=model,data.path,train.seed` to resume "
                            "without it")
        return
    missing = [k for k in guarded if k not in recorded]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UserError("run_dir", f"{path} is cut down: it records no {', '.join(missing[:3])}"
                        f"{more}, so a resume cannot be checked against it; restore it, or use a "
                        "fresh `run_dir`")
    for key in guarded:
        if not _same(key, recorded[key], wanted[key]):
            raise UserError(key, f"is {wanted[key]!r}, but {path} records "
                            f"{recorded[key]!r} for this run's checkpoints; use "
                            f"`overrides={key}={recorded[key]}`, a fresh `run_dir`, or "
                            f"`overrides=checkpoint.allow_changes={key}` to change it on purpose")


def check_resume(cfg: Config, run_dir: Path, crc: bool = False) -> None:
    """A start in an existing run dir must be the resume it claims to be.

    - ``checkpoint.load_step=N`` needs a committed, intact step N (sizes checked; CRC32s too
      with ``crc``, else when it is loaded);
    - model.*, data.path and train.seed must equal the run's config.yaml record, except the keys
      ``checkpoint.allow_changes`` names (e.g. ``data.path,train.seed``; ``model`` for every
      model key): the checkpoints were trained with the recorded values;
    - the data at ``data.path`` must be the data recorded in dataset.json (by content), unless
      ``data.path`` may change (:mod:`.dataset_record`);
    - committed checkpoints need both records, complete: a missing or cut-down one is refused,
      never written anew over them;
    - ``checkpoint.store`` must be the recorded store (a record without it: ``volume``); no
      ``checkpoint.allow_changes`` changes it.

    Raises:
        UserError: Naming the key, before anything is written.
    """
    _check_store(cfg, run_dir)  # first: every other check looks in the store
    store = open_store(run_dir, cfg.checkpoint.store)
    _check_load_step(cfg, store, crc)
    allowed = check_allow_changes(cfg.checkpoint.allow_changes)
    steps = store.committed_steps()
    _check_record(cfg, run_dir, steps, allowed)
    check_dataset(cfg.data.path, run_dir, bool(steps), _allowed("data.path", allowed))


def record_config(cfg: Config, run_dir: Path) -> None:
    """Records the resolved config; every rank writes the same bytes, atomically.

    ``config.yaml`` is written once, by the run's first start, and never replaced: it is the
    record :func:`check_resume` compares against; so is ``dataset.json`` (the data's
    fingerprint). A later start whose config differs (more steps,
    an allowed change) writes ``config.resumed.yaml`` instead.
    """
    claim_run_dir(run_dir)
    record_dataset(cfg.data.path, run_dir)
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    target = run_dir / CONFIG_FILE
    if os.path.lexists(target):
        recorded = read_recorded_config(run_dir)
        # A record from before checkpoint.store is the same config when the store is the volume.
        if recorded is not None and _with_store(recorded) == flat_keys(cfg.to_dict()):
            resumed = run_dir / RESUMED_CONFIG_FILE  # ours; it would describe an older start
            if os.path.lexists(resumed) and link_in(resumed, run_dir) is None:
                resumed.unlink(missing_ok=True)
            return
        target = run_dir / RESUMED_CONFIG_FILE
    refuse_link(target, run_dir)
    write_atomic(target, text)  # a full disk leaves no temp file behind


def check_run_dir(run_dir: Path, cfg: Config | None = None, crc: bool = False) -> Path:
    """A usable run directory: no ``..``, not a file, new, empty or a run dir of ours, no links.

    We write config.yaml and checkpoints into it, and never into a stranger's folder. With
    ``cfg``, also :func:`.run_record.check_resume`: a resume that cannot be the one asked for
    stops here (``crc``: a ``checkpoint.load_step`` checkpoint's CRC32s are checked too).
    """
    if not str(run_dir).strip():
        raise UserError("run_dir", "is empty; give the run directory (e.g. runs/r1)")
    if ".." in Path(run_dir).parts:
        raise UserError("run_dir", f"{run_dir} must not contain '..'")
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError("run_dir", f"{run_dir} exists and is not a directory")
    check_run_dir_owned(run_dir, [f.name for f in dataclasses.fields(Config)])
    check_run_dir_links(run_dir)
    if cfg is not None:
        check_resume(cfg, run_dir, crc=crc)
    return run_dir
