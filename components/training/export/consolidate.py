"""Export a committed DCP checkpoint as model.safetensors + config.json + export.json.

Checkpoints live in ``<run_dir>/checkpoints/step_XXXXXXXX/`` (torch DCP) and count only once they
hold the ``COMMITTED`` marker the trainer writes when every rank finished. Only the ``model.*``
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
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.ownership import check_output_dir, refuse_foreign
from kfp_nvrx.components.core.rundir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    RESUMED_CONFIG_FILE,
    checkpoints_dir,
    parse_step,
    read_commit_marker,
    verify,
)
from kfp_nvrx.components.data.shards import publish_dir, write_json_atomic
from kfp_nvrx.components.errors import UserError

EXPORT_FORMAT = "kfp-nvrx-export/1"
ARCHITECTURE = "kfp-nvrx-llama"
MODEL_PREFIX = "model."


@dataclass(frozen=True)
class Checkpoint:
    """One ``step_XXXXXXXX`` directory, its commit marker and what is wrong with it, if anything.

    ``commit`` is None for a torn checkpoint (no marker: crashed or still being written);
    ``problem`` is set when a committed checkpoint's files no longer match its marker.
    """

    step: int
    path: Path
    commit: dict[str, Any] | None
    problem: str | None = None

    @property
    def committed(self) -> bool:
        """Whether the checkpoint is complete, intact and may be loaded."""
        return self.commit is not None and self.problem is None


def _inspect(step: int, path: Path) -> Checkpoint:
    try:
        commit = read_commit_marker(path)
    except ValueError as err:
        return Checkpoint(step, path, {}, str(err))
    if commit is None:
        return Checkpoint(step, path, None)
    return Checkpoint(step, path, commit, verify(path))  # the one check trainer and drills use


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Checkpoint]:
    """Return every ``step_*`` directory under ``<run_dir>/checkpoints``, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = parse_step(child.name)
        if step is not None and child.is_dir():
            found.append(_inspect(step, child))
    return sorted(found, key=lambda c: c.step)


def select_checkpoint(run_dir: str | os.PathLike[str], step: int | None = None,
                      log: Callable[[str], None] | None = None) -> Checkpoint:
    """Pick the newest intact committed checkpoint, or the one at ``step``.

    Raises:
        UserError: ``step`` when that checkpoint is missing, torn or damaged; ``run_dir`` when
            there is no intact committed checkpoint at all.

    """
    ckpts = list_checkpoints(run_dir)
    committed = [c for c in ckpts if c.committed]
    steps = ", ".join(str(c.step) for c in committed) or "none"
    if step is not None:
        for c in ckpts:
            if c.step != step:
                continue
            if c.committed:
                return c
            why = c.problem or "not committed (torn or still being written)"
            raise UserError("step", f"checkpoint {c.path.name} is {why}; committed steps: {steps}")
        raise UserError("step", f"no checkpoint for step {step} in {run_dir}; committed: {steps}")
    for c in ckpts:
        if c.commit is not None and c.problem and (not committed or c.step > committed[-1].step):
            (log or (lambda _m: None))(f"skipping damaged checkpoint {c.path.name}: {c.problem}")
    if not committed:
        raise UserError("run_dir", f"no committed checkpoint under {checkpoints_dir(run_dir)}")
    return committed[-1]


def load_model_state(ckpt_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the ``model.*`` tensors of a DCP checkpoint, full-size, on CPU, without a process group.

    Returns:
        ``{fqn: tensor}`` with the ``model.`` prefix stripped.

    Raises:
        UserError: (``step``) when the checkpoint cannot be read or holds no model tensors.

    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = str(ckpt_dir)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 - any read/unpickle failure means a bad checkpoint
        raise UserError("step", f"cannot read DCP metadata of {path}: {err}") from None
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise UserError("step", f"{path} holds no '{MODEL_PREFIX}*' tensors")
    try:
        with warnings.catch_warnings():
            # "torch.distributed is disabled ... assuming ... a single process": the intent here.
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    except Exception as err:  # noqa: BLE001
        msg = " ".join(str(err).split())[:300]
        raise UserError("step", f"cannot load model tensors from {path}: {msg}") from None
    return {key[len(MODEL_PREFIX):]: t.contiguous() for key, t in state.items()}


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
        where = ("the run's checkpoints" if real_out.is_relative_to(real_run / CHECKPOINTS_DIR)
                 else "the run dir")
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
            ``eval_batches``).

    """
    from safetensors.torch import save_file

    from kfp_nvrx.components.training.export.evaluate import (
        check_dataset,
        eval_loss,
        load_exported_model,
    )
    from kfp_nvrx.components.training.model import build_model

    log = log or (lambda _msg: None)
    run = Path(run_dir).absolute()
    out = Path(out_dir).absolute()
    if not run.is_dir():
        raise UserError("run_dir", f"{run_dir} is not a directory")
    if isinstance(eval_batches, bool) or not isinstance(eval_batches, int) or eval_batches < 0:
        raise UserError("eval_batches", f"must be an integer >= 0, got {eval_batches!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UserError("step", f"must be an integer >= 0, got {step!r}")
    cfg = read_run_config(run)
    ckpt = select_checkpoint(run, step, log)
    data_dir = None
    if eval_batches:
        data_dir = data or cfg.data.path
        if not data_dir:
            raise UserError("data", "config.yaml has no data.path; pass --data DIR or "
                            "--eval-batches 0")
        check_dataset(data_dir, cfg.model.vocab_size, cfg.data.seq_len)
    _check_out(out, run)
    # Before reading gigabytes: a read-only --out fails here, naming it.
    work, created = _work_dir(out)
    done = False
    try:
        log(f"loading model tensors of {ckpt.path}")
        state = load_model_state(ckpt.path)
        model = build_model(cfg.model)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            msg = " ".join(str(err).split())[:300]
            raise UserError("run_dir", f"{ckpt.path} does not match config.yaml's model: {msg}"
                            ) from None
        del model
        os.chmod(work, 0o755)
        weights = work / "model.safetensors"
        save_file(state, str(weights), metadata={"format": "pt"})
        dtype = Counter(str(t.dtype).removeprefix("torch.") for t in state.values()).most_common(1)
        write_json_atomic(work / "config.json", model_config_json(cfg.model, dtype[0][0]))
        info: dict[str, Any] = {
            "format": EXPORT_FORMAT, "source_step": ckpt.step, "source_dir": str(ckpt.path),
            "run_dir": str(run), "sha256": _file_sha256(weights),
            "num_params": sum(t.numel() for t in state.values()),
            "world_size": (ckpt.commit or {}).get("world_size"),
            "seq_len": cfg.data.seq_len,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        del state
        if data_dir:
            log(f"evaluating on the val split of {data_dir}")
            result = eval_loss(load_exported_model(work), data_dir, seq_len=cfg.data.seq_len,
                               batch_size=cfg.data.batch_size, batches=eval_batches,
                               vocab_size=cfg.model.vocab_size)
            info.update(eval_loss=result["loss"], eval_tokens=result["tokens"],
                        eval_data=str(Path(data_dir).resolve()))
        write_json_atomic(work / "export.json", info)
        for name in EXPORT_FILES:  # readable by the serving side of a shared volume
            os.chmod(work / name, 0o644)
        publish_dir(work, out, EXPORT_FILES, last="export.json")
        done = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for parent in [] if done else created:  # nearest first; only the empty ones we made
            try:
                parent.rmdir()
            except OSError:
                break
    return {**info, "path": str(out)}


def summary(info: dict[str, Any]) -> str:
    """One line for the CLI and logs."""
    loss = f" eval_loss={info['eval_loss']:.4f}" if info.get("eval_loss") is not None else ""
    return (f"exported step {info['source_step']} (world size {info.get('world_size')}) -> "
            f"{info['path']}/model.safetensors params={info['num_params']:,}{loss} "
            f"sha256={info['sha256'][:12]}")
