"""Reading a run's config record (``<run_dir>/config.yaml``), flattened to dotted keys.

Below the checkpoint store and the run record: :func:`.ckpt_store.open_store` reads the store
kind a run records here, and :mod:`.run_record` (which writes the record and checks a resume
against it) reads it through here too. Imports no torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.bounded import CONFIG_LIMIT, read_text
from kfp_nvrx.components.core.config_text import load_yaml
from kfp_nvrx.components.core.dataset_record import unreadable_record
from kfp_nvrx.components.core.rundir import CONFIG_FILE
from kfp_nvrx.components.errors import UserError


def flat_keys(raw: Any, prefix: str = "") -> dict[str, Any]:
    """``raw``'s nested mappings as one mapping of dotted keys (not a mapping: empty)."""
    if not isinstance(raw, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_recorded_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's config.yaml record as ``{dotted key: value}``; None when there is none.

    Raises:
        UserError: Naming ``--run-dir`` when the record exists but is no config mapping.
    """
    path = run_dir / CONFIG_FILE
    if not os.path.lexists(path):
        return None
    try:
        raw = load_yaml(read_text(path, "run_dir", CONFIG_LIMIT, "run config"), "run_dir", path)
    except UserError as err:
        raise unreadable_record(err) from None
    if not isinstance(raw, dict):
        raise UserError("run_dir", f"{path} is not a config record (not a mapping); restore "
                        "it or use a fresh `run_dir`")
    return flat_keys(raw)
