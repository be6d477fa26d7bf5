"""Export a committed DCP checkpoint as model.safetensors + config.json + export.json.

Checkpoints live in the run's checkpoint store (:mod:`kfp_nvrx.components.core.ckpt_store`, torch
DCP) and count only once committed, when every rank finished. Only the ``model.*``
tensors are read, in one process without a process group: DCP metadata gives each tensor's global
shape, so the result does not depend on the world size that wrote the checkpoint. The export is
built in a temporary directory and moved into place whole; the run directory is only read.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.ckpt_store import open_store
from kfp_nvrx.components.core.disk import disk_full, free_bytes
from kfp_nvrx.components.core.ownership import check_output_dir, refuse_foreign
from kfp_nvrx.components.core.rundir import CONFIG_FILE, RESUMED_CONFIG_FILE
from kfp_nvrx.components.data.shards import publish_dir, write_json_atomic
from kfp_nvrx.components.errors import UserError

# Re-exported: the checkpoint a run's export reads, and reading it, live in .checkpoint_read.
from kfp_nvrx.components.training.export.checkpoint_read import (  # noqa: F401
    MODEL_PREFIX,
    Checkpoint,
    list_checkpoints,
    load_model_state,
    read_newest,
    select_checkpoint,
)

EXPORT_FORMAT = "kfp-nvrx-export/1"
ARCHITECTURE = "kfp-nvrx-llama"
#: Bytes beyond the tensors an export writes (safetensors header, config.json, export.json).
EXPORT_SLACK = 1 << 20


def read_run_config(run_dir: str | os.PathLike[str]) -> Any:
    """Rebuild the trainer Config of the run's newest start.

    That is ``config.resumed.yaml`` when a later start changed the config, else the run's
    ``config.yaml`` record (:mod:`kfp_nvrx.components.core.run_record`).
    """
    from kfp_nvrx.components.core.bounded import CONFIG_LIMIT, read_text
    from kfp_nvrx.components.core.config import config_from_dict
    from kfp_nvrx.components.core.config_text import load_yaml

    path = Path(run_dir) / RESUMED_CONFIG_FILE
    if not path.is_file():
        path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise UserError("run_dir", f"{run_dir} has no {CONFIG_FILE}; is it a kfp-nvrx run dir?")
    raw = load_yaml(read_text(path, "run_dir", CONFIG_LIMIT, "run config"), "run_dir", path,
                    typed=True) or {}
    if not isinstance(raw, dict):
        raise UserError("run_dir", f"{path} must hold a mapping of sections")
    return config_from_dict(raw)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


#: Everything an export folder holds; only a folder of exactly these may be replaced.
EXPORT_FILES = ("model.safetensors", "config.json", "export.json")


def _check_out(out: Path, run_dir: Path) -> None:
    real_out, real_run = Path(os.path.realpath(out)), Path(os.path.realpath(run_dir))
    if real_out == real_run:
        raise UserError("out_dir", f"{out} is the run dir itself; export to a folder of its own "
                        "(e.g. models/<run>)")
    if real_out.is_relative_to(real_run):
        ckpts = Path(os.path.realpath(open_store(run_dir).where))
        where = "the run's checkpoints" if real_out.is_relative_to(ckpts) else "the run dir"
        raise UserError("out_dir", f"{out} is inside {where} ({run_dir}); export to a folder "
                        "outside it (e.g. models/<run>)")
    check_output_dir(out, "out_dir", [run_dir])
    if out.exists():
        if not out.is_dir():
            raise UserError("out_dir", f"{out} exists and is not a directory")
        if any(out.iterdir()) and not (out / "export.json").is_file():
            raise UserError("out_dir", f"{out} is not empty and holds no earlier export; "
                            "choose an empty or new directory")
        refuse_foreign(out, EXPORT_FILES, "out_dir", "earlier export")


def _work_dir(out: Path) -> tuple[Path, list[Path]]:
    """The temporary folder the export is built in, next to ``out`` (created now).

    Returns:
        The folder and the parents of ``out`` created for it (removed again on failure).

    Raises:
        UserError: Naming ``out_dir`` (``out`` itself, not the temporary name) when its folder
            cannot be created or written: a read-only mount, no permission, a full disk.
    """
    created = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)), created
    except OSError as err:
        raise UserError("out_dir", f"cannot write {out}: {err.strerror or err} (in "
                        f"{out.parent}); choose a writable folder") from None


def model_config_json(model_cfg: Any, dtype: str) -> dict[str, Any]:
    """Return config.json content: the model section plus architecture and dtype."""
    return {**dataclasses.asdict(model_cfg), "architecture": model_cfg.factory or ARCHITECTURE,
            "torch_dtype": dtype, "format": EXPORT_FORMAT}


def _size(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} bytes"


def _room_check(out: Path, log: Callable[[str], None]) -> Callable[[Any, dict[str, Any]], None]:
    """``before_read`` for :func:`read_newest`: refuses an ``out`` without room for the export.

    Asked before gigabytes are read, of the file system ``out`` is on (the export is built
    next to it), with the sizes the checkpoint's metadata gives.
    """
    def check(ckpt: Any, state: dict[str, Any]) -> None:
        need = sum(t.numel() * t.element_size() for t in state.values()) + EXPORT_SLACK
        free = free_bytes(out.parent)
        if free is not None and free < need:
            raise UserError("out_dir", f"not enough room for the export on the file system of "
                            f"{out}: it needs about {_size(need)}, {_size(free)} is free; free "
                            "space there or export to another folder")
        log(f"loading model tensors of {ckpt.location}")
    return check


def _full(out: Path) -> UserError:
    """The error for a file system that filled up while the export was written."""
    free = free_bytes(out.parent)
    left = f" ({_size(free)} free now)" if free is not None else ""
    return UserError("out_dir", f"the file system of {out} filled up while the export was "
                     f"written{left}; free space there or export to another folder")


def _write_export(work: Path, state: dict[str, Any], cfg: Any, ckpt: Any,
                  run: Path) -> dict[str, Any]:
    """model.safetensors and config.json into ``work``; returns export.json's first entries."""
    from safetensors.torch import save_file

    from kfp_nvrx.components.training.model import build_model

    model = build_model(cfg.model)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        msg = " ".join(str(err).split())[:300]
        raise UserError("run_dir", f"{ckpt.location} does not match config.yaml's model: {msg}"
                        ) from None
    del model
    os.chmod(work, 0o755)
    weights = work / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    dtype = Counter(str(t.dtype).removeprefix("torch.") for t in state.values()).most_common(1)
    write_json_atomic(work / "config.json", model_config_json(cfg.model, dtype[0][0]))
    return {
        "format": EXPORT_FORMAT, "source_step": ckpt.step, "source_dir": str(ckpt.location),
        "run_dir": str(run), "sha256": _file_sha256(weights),
        "num_params": sum(t.numel() for t in state.values()),
        "world_size": (ckpt.commit or {}).get("world_size"),
        "seq_len": cfg.data.seq_len,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _check_args(run: Path, run_dir: Any, step: Any, eval_batches: Any) -> None:
    if not run.is_dir():
        raise UserError("run_dir", f"{run_dir} is not a directory")
    if isinstance(eval_batches, bool) or not isinstance(eval_batches, int) or eval_batches < 0:
        raise UserError("eval_batches", f"must be an integer >= 0, got {eval_batches!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UserError("step", f"must be an integer >= 0, got {step!r}")


def _eval_data(cfg: Any, data: str | None, eval_batches: int) -> str | None:
    """The dataset the eval loss reads (None: no eval), checked against the model."""
    from kfp_nvrx.components.training.export.evaluate import check_dataset

    if not eval_batches:
        return None
    data_dir = data or cfg.data.path
    if not data_dir:
        raise UserError("data", "config.yaml has no data.path; give the dataset as `data`, or "
                        "`eval_batches=0`")
    try:
        check_dataset(data_dir, cfg.model.vocab_size, cfg.data.seq_len)
    except UserError as err:
        if data:
            raise
        # Not given: it is the run's own data.path (on /fsx for a cluster run), not a --data.
        raise UserError("data.path", f"the run's data.path (from its config) cannot be read "
                        f"here for the eval loss: {err.message}; give `data` (the dataset on "
                        "this machine) or `eval_batches=0`") from None
    return data_dir


def export_checkpoint(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                      step: int | None = None, data: str | None = None, eval_batches: int = 8,
                      log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Consolidate a committed checkpoint into ``out_dir`` and (optionally) measure eval loss.

    Args:
        run_dir: The training run directory (``config.yaml`` + ``checkpoints/``).
        out_dir: Directory to create with ``model.safetensors``, ``config.json``, ``export.json``.
        step: Export this step instead of the newest committed one.
        data: Dataset directory for the eval loss (default: ``data.path`` of config.yaml).
        eval_batches: Batches of ``data.batch_size`` windows of the val split; 0 skips eval.
        log: Progress callback.

    Returns:
        The content of export.json plus ``path`` (the export directory).

    Raises:
        UserError: On bad arguments, naming the field (``run_dir``, ``out_dir``, ``step``, ``data``,
            ``eval_batches``); ``out_dir`` when its file system has no room for the export.

    """
    log = log or (lambda _msg: None)
    run, out = Path(run_dir).absolute(), Path(out_dir).absolute()
    _check_args(run, run_dir, step, eval_batches)
    cfg = read_run_config(run)
    first = select_checkpoint(run, step, log)  # said before the data's and the output's errors
    data_dir = _eval_data(cfg, data, eval_batches)
    _check_out(out, run)
    # Before reading gigabytes: a read-only --out fails here, naming it.
    work, created = _work_dir(out)
    done = False
    try:
        ckpt, state = read_newest(run, step, _room_check(out, log), log, first)
        try:
            info = _write_export(work, state, cfg, ckpt, run)
        except Exception as err:  # safetensors' writer reports ENOSPC as its own error type
            raise _full(out) if disk_full(err) else err from None
        del state
        if data_dir:
            log(f"evaluating on the val split of {data_dir}")
            info.update(_eval_info(work, data_dir, cfg, eval_batches))
        _publish(work, out, info)
        done = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for parent in [] if done else created:  # nearest first; only the empty ones we made
            try:
                parent.rmdir()
            except OSError:
                break
    return {**info, "path": str(out)}


def _eval_info(work: Path, data_dir: str, cfg: Any, eval_batches: int) -> dict[str, Any]:
    """The export's eval loss fields: the model written to ``work`` on ``data_dir``'s val split."""
    from kfp_nvrx.components.training.export.evaluate import (
        Windows,
        eval_loss,
        load_exported_model,
    )

    windows = Windows(cfg.data.seq_len, cfg.data.batch_size, eval_batches)
    result = eval_loss(load_exported_model(work), data_dir, windows,
                       vocab_size=cfg.model.vocab_size)
    return {"eval_loss": result["loss"], "eval_tokens": result["tokens"],
            "eval_data": str(Path(data_dir).resolve())}


def _publish(work: Path, out: Path, info: dict[str, Any]) -> None:
    """Writes ``export.json`` and moves the export from ``work`` to ``out``, that file last."""
    try:
        write_json_atomic(work / "export.json", info)
        for name in EXPORT_FILES:  # readable by the serving side of a shared volume
            os.chmod(work / name, 0o644)
        publish_dir(work, out, EXPORT_FILES, last="export.json")
    except OSError as err:
        raise _full(out) if disk_full(err) else err from None


def summary(info: dict[str, Any]) -> str:
    """One line for the CLI and logs."""
    loss = f" eval_loss={info['eval_loss']:.4f}" if info.get("eval_loss") is not None else ""
    return (f"exported step {info['source_step']} (world size {info.get('world_size')}) -> "
            f"{info['path']}/model.safetensors params={info['num_params']:,}{loss} "
            f"sha256={info['sha256'][:12]}")
