"""The run's dataset record: which data a run's checkpoints were trained on, by content.

``config.yaml`` records ``data.path``, a name. prepare-data run again into the same folder (another
source, seed or ``val_fraction``) keeps the name and changes the tokens, and a resume on them would
go on training the restored weights on other data, in an order the run never had. So the run's
first start also writes ``<run_dir>/dataset.json``: the dataset's content fingerprint
(:func:`content_fingerprint`: every shard's sha256 from the dataset's index), where it was and its
token counts. Like config.yaml it is never replaced, and a resume must find the same fingerprint
at ``data.path`` unless ``checkpoint.allow_changes`` names ``data.path`` (:func:`check_dataset`).

The fingerprint is read from the index (no shard is read here); that the shards still match their
index is checked where the data is opened (the launcher's preflight checksums a split of up to
2 GiB). Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.atomic import write_atomic
from kfp_nvrx.components.core.bounded import read_json
from kfp_nvrx.components.core.rundir import DATASET_FILE, refuse_link
from kfp_nvrx.components.errors import UserError

#: The dataset's index, as prepare-data names it (``components/data/shards.py``).
INDEX_NAME = "index.json"

__all__ = ["DATASET_FILE", "check_dataset", "content_fingerprint", "describe_dataset",
           "read_dataset_record", "record_dataset", "unreadable_record"]
_HEX = frozenset("0123456789abcdef")


def unreadable_record(err: UserError) -> UserError:
    """The bounded reader's refusal of a run record, with the fix for a record (not an input)."""
    what = re.sub(r"; (give|restore) [^;]*$", "", err.message)
    return UserError("run_dir", f"{what}; this run's record cannot be read: restore it, or use a "
                     "fresh `run_dir`")


def content_fingerprint(index: dict[str, Any]) -> str:
    """sha256 of what decides the tokens a run reads from a dataset with this index.

    The token dtype, the vocabulary and every split's shards in order: name, token count and
    sha256. Two datasets with the same fingerprint hold the same tokens in the same places;
    prepare-data run again with another source, seed or ``val_fraction`` into the same folder
    gives another one. (The index's own ``fingerprint`` is of prepare-data's *inputs*, and a
    hand-made or older index may lack it.)

    Raises:
        KeyError, TypeError: The index lacks those fields (not one prepare-data wrote).
    """
    key = {"format": index.get("format"), "dtype": index["dtype"],
           "vocab_size": index["vocab_size"],
           "splits": {split: [[s["file"], s["tokens"], s["sha256"]] for s in entry["shards"]]
                      for split, entry in index["splits"].items()}}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def describe_dataset(data_path: str) -> dict[str, Any]:
    """The record of the dataset at ``data_path``: ``path`` (resolved), ``fingerprint``, ``tokens``.

    Its ``index.json`` is read here (bounded), not through the data package: the core imports
    no other room. The trainer has opened and checked the dataset before this is asked.

    Raises:
        UserError: Naming ``data.path`` when it holds no readable dataset index.
    """
    path = Path(data_path) / INDEX_NAME
    if not os.path.lexists(path):
        raise UserError("data.path", f"{data_path} is not a dataset (no {INDEX_NAME}); create "
                        "one with kfp-nvrx prepare-data")
    index = read_json(path, "data.path", what="dataset index")
    try:
        return {"path": os.path.realpath(data_path), "fingerprint": content_fingerprint(index),
                "tokens": {split: entry["tokens"] for split, entry in index["splits"].items()}}
    except (KeyError, TypeError, AttributeError):
        raise UserError("data.path", f"{path} is not an index prepare-data wrote; re-run "
                        "prepare-data") from None


def read_dataset_record(run_dir: Path) -> dict[str, Any] | None:
    """The run's dataset record; None when there is none.

    Raises:
        UserError: Naming ``run_dir`` when the record is there but unreadable or not one of ours.
    """
    path = run_dir / DATASET_FILE
    if not os.path.lexists(path):
        return None
    try:
        raw = read_json(path, "run_dir", what="dataset record")  # bounded; a FIFO is refused
    except UserError as err:
        raise unreadable_record(err) from None
    fingerprint = raw.get("fingerprint") if isinstance(raw, dict) else None
    if not (isinstance(fingerprint, str) and len(fingerprint) == 64 and set(fingerprint) <= _HEX):
        raise UserError("run_dir", f"{path} is no dataset record (no sha256 fingerprint); "
                        "restore it, or use a fresh `run_dir`")
    return raw


def check_dataset(data_path: str, run_dir: Path, has_checkpoints: bool, allowed: bool) -> None:
    """A resume must read the data its checkpoints were trained on.

    Args:
        data_path: The config's ``data.path``.
        run_dir: The run directory.
        has_checkpoints: Whether the run dir holds committed checkpoints (then a missing record
            is refused: nothing would say what they were trained on).
        allowed: ``checkpoint.allow_changes`` names ``data.path``: any data is accepted (and a
            missing record is written anew by :func:`record_dataset`).

    Raises:
        UserError: Naming ``data.path`` for other data, ``run_dir`` for a missing record.
    """
    if allowed:
        return
    record = read_dataset_record(run_dir)
    if record is None:
        if has_checkpoints:
            raise UserError("run_dir", f"{run_dir}/{DATASET_FILE} is missing, so nothing says "
                            "which data this run's checkpoints were trained on; restore it, use "
                            "a fresh `run_dir`, or `overrides=checkpoint.allow_changes=data.path` "
                            f"to resume on the data at {data_path} (it is recorded then)")
        return
    now = describe_dataset(data_path)
    if now["fingerprint"] != record["fingerprint"]:
        was = record.get("path")
        raise UserError("data.path", f"{data_path} holds other data (fingerprint "
                        f"{now['fingerprint'][:12]}) than this run's checkpoints were trained on "
                        f"({record['fingerprint'][:12]}"
                        + (f", then at {was}" if isinstance(was, str) else "")
                        + f", recorded in {run_dir}/{DATASET_FILE}); give that dataset, a "
                        "fresh `run_dir`, or `overrides=checkpoint.allow_changes=data.path` to "
                        "change it on purpose")


def record_dataset(data_path: str, run_dir: Path) -> None:
    """Writes the dataset record unless there is one (every rank writes the same bytes).

    Never replaced: it is what :func:`check_dataset` compares against. Nothing is written when
    ``data_path`` holds no readable index (the trainer refuses that before this is called).
    """
    target = run_dir / DATASET_FILE
    if os.path.lexists(target):
        return
    try:
        record = describe_dataset(data_path)
    except UserError:
        return
    refuse_link(target, run_dir)
    write_atomic(target, json.dumps(record, indent=2, sort_keys=True) + "\n")
