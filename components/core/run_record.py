"""The run's config record: what a resume in an existing run dir must keep.

``<run_dir>/config.yaml`` is written by the run's first start and never replaced. A later start
is a resume of the checkpoints beside it, so it must train the same model on the same data in the
same order: model.*, data.path and train.seed must equal the record, unless the user names the
key in ``checkpoint.allow_changes`` (a documented, explicit override). ``checkpoint.load_step=N``
must name a committed step. Everything else (more steps, another learning rate) may change; the
newest differing config is kept in ``config.resumed.yaml``. Imports no torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kfp_nvrx.components.core.atomic import write_atomic
from kfp_nvrx.components.core.rundir import (
    CONFIG_FILE,
    RESUMED_CONFIG_FILE,
    checkpoints_dir,
    committed_steps,
    link_in,
    refuse_link,
    step_dir,
    verify,
)
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.ownership import claim_run_dir

if TYPE_CHECKING:
    from kfp_nvrx.components.core.config import Config

#: Keys of the recorded config a resume must keep (they decide the weights and the data order);
#: ``checkpoint.allow_changes`` lists the ones a user changes on purpose. ``model.`` = all.
GUARDED_KEYS = ("model.", "data.path", "train.seed")


def _flat(raw: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(raw, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_recorded_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's config.yaml record as ``{dotted key: value}``; None when there is none.

    Raises:
        UserError: Naming ``--run-dir`` when the record exists but is no config mapping.
    """
    from kfp_nvrx.components.core.bounded import CONFIG_LIMIT, read_text
    from kfp_nvrx.components.core.config_text import load_yaml

    path = run_dir / CONFIG_FILE
    if not os.path.lexists(path):
        return None
    raw = load_yaml(read_text(path, "--run-dir", CONFIG_LIMIT, "run config"), "--run-dir", path)
    if not isinstance(raw, dict):
        raise UserError("--run-dir", f"{path} is not a config record (not a mapping); restore "
                        "it or use a fresh --run-dir")
    return _flat(raw)


def _same(key: str, recorded: Any, wanted: Any) -> bool:
    if recorded == wanted:
        return True
    if key == "data.path" and isinstance(recorded, str) and isinstance(wanted, str) \
            and recorded and wanted:
        return os.path.realpath(recorded) == os.path.realpath(wanted)
    return False


def check_allow_changes(text: str) -> list[str]:
    """The keys ``checkpoint.allow_changes`` names; each must be a guarded key (or ``model``).

    Raises:
        UserError: Naming ``checkpoint.allow_changes`` and the key that is no guarded key.
    """
    keys = [k.strip() for k in text.split(",") if k.strip()]
    for key in keys:
        if not (key == "model" or key.startswith(GUARDED_KEYS) or key in GUARDED_KEYS):
            raise UserError("checkpoint.allow_changes", f"{key!r} is not a key a resume guards; "
                            "name model, model.<key>, data.path or train.seed (comma-separated)")
    return keys


def check_resume(cfg: Config, run_dir: Path, crc: bool = False) -> None:
    """A start in an existing run dir must be the resume it claims to be.

    - ``checkpoint.load_step=N`` needs a committed, intact step N (sizes checked; CRC32s too
      with ``crc``, else when it is loaded);
    - model.*, data.path and train.seed must equal the run's config.yaml record, except the keys
      ``checkpoint.allow_changes`` names (e.g. ``data.path,train.seed``; ``model`` for every
      model key): the checkpoints were trained with the recorded values.

    Raises:
        UserError: Naming the key, before anything is written.
    """
    root = checkpoints_dir(run_dir)
    want = cfg.checkpoint.load_step
    if want >= 0:
        steps = committed_steps(root)
        if want not in steps:
            have = ", ".join(map(str, sorted(steps))) or "none"
            raise UserError("checkpoint.load_step", f"{want} is no committed checkpoint in {root} "
                            f"(committed: {have}); give one of those, or -1 for the newest")
        problem = verify(step_dir(root, want), crc=crc)
        if problem:
            raise UserError("checkpoint.load_step", f"step {want} in {root} is damaged "
                            f"({problem}); give another step, or -1 for the newest intact one")
    recorded = read_recorded_config(run_dir)
    if not recorded:
        return
    allowed = check_allow_changes(cfg.checkpoint.allow_changes)
    wanted = _flat(cfg.to_dict())
    for key in sorted(wanted):
        if not key.startswith(GUARDED_KEYS) or key not in recorded:
            continue
        if any(key == a or key.startswith(f"{a}.") for a in allowed):
            continue
        if not _same(key, recorded[key], wanted[key]):
            raise UserError(key, f"is {wanted[key]!r}, but {run_dir}/{CONFIG_FILE} records "
                            f"{recorded[key]!r} for this run's checkpoints; use --set "
                            f"{key}={recorded[key]}, a fresh --run-dir, or --set "
                            f"checkpoint.allow_changes={key} to change it on purpose")


def record_config(cfg: Config, run_dir: Path) -> None:
    """Records the resolved config; every rank writes the same bytes, atomically.

    ``config.yaml`` is written once, by the run's first start, and never replaced: it is the
    record :func:`check_resume` compares against. A later start whose config differs (more steps,
    an allowed change) writes ``config.resumed.yaml`` instead.
    """
    claim_run_dir(run_dir)
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    target = run_dir / CONFIG_FILE
    if os.path.lexists(target):
        if read_recorded_config(run_dir) == _flat(cfg.to_dict()):
            resumed = run_dir / RESUMED_CONFIG_FILE  # ours; it would describe an older start
            if os.path.lexists(resumed) and link_in(resumed, run_dir) is None:
                resumed.unlink(missing_ok=True)
            return
        target = run_dir / RESUMED_CONFIG_FILE
    refuse_link(target, run_dir)
    write_atomic(target, text)  # a full disk leaves no temp file behind
