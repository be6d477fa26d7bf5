"""Model promotion on the shared volume: compare a candidate export with the promoted model.

Layout under ``<workspace>/models/<model_name>/``::

    versions/<UTC time>-<sha256[:12]>/   model.safetensors, config.json, export.json, promotion.json
    promoted -> versions/<...>           a relative symlink, swapped atomically on promotion

Both models are evaluated on the same val split with the same windows, so the comparison is fair
even when the data changed since the promoted model was trained. A candidate is promoted when
there is no promoted model yet, or when its eval loss beats the promoted one by more than
``min_improvement``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.bounded import read_json
from kfp_nvrx.components.errors import UserError

#: Files an export consists of (``export_checkpoint``); all are copied on promotion.
MODEL_FILES = ("model.safetensors", "config.json", "export.json")
PROMOTE, KEEP = "promote", "keep"


def current_model(promoted_dir: str | os.PathLike[str]) -> Path | None:
    """Return the promoted model directory, or None when nothing was promoted yet."""
    path = Path(promoted_dir)
    return path if (path / "model.safetensors").is_file() else None


def _json(path: Path) -> dict[str, Any]:
    try:
        value = read_json(path, "promoted_dir")  # bounded, no NaN, depth-safe
    except UserError:
        return {}
    return value if isinstance(value, dict) else {}


def compare(candidate_dir: str | os.PathLike[str], data_dir: str | os.PathLike[str],
            promoted_dir: str | os.PathLike[str], *, min_improvement: float = 0.0,
            eval_batches: int = 8, batch_size: int = 4) -> dict[str, Any]:
    """Evaluate candidate and promoted model on ``data_dir``'s val split and decide.

    Args:
        candidate_dir: The new export (``model.safetensors``, ``config.json``, ``export.json``).
        data_dir: Dataset whose val split both models are scored on.
        promoted_dir: The promoted model (may not exist yet).
        min_improvement: Loss margin the candidate must beat the promoted model by (>= 0).
        eval_batches: Batches of ``batch_size`` windows per model.
        batch_size: Windows per batch.

    Returns:
        ``decision`` (``promote``/``keep``), ``reason``, ``candidate_eval_loss``,
        ``promoted_eval_loss`` (None without a promoted model), ``improvement``, ``seq_len``.

    Raises:
        UserError: On bad arguments or a dataset the models cannot read.

    """
    from kfp_nvrx.components.training.export.evaluate import evaluate_export, read_export_config

    if min_improvement < 0:
        raise UserError("min_improvement", f"must be >= 0, got {min_improvement}")
    if eval_batches < 1 or batch_size < 1:
        raise UserError("eval_batches", "eval_batches and batch_size must be >= 1")
    cand = Path(candidate_dir)
    current = current_model(promoted_dir)
    seq_len = int(_json(cand / "export.json").get("seq_len")
                  or read_export_config(cand).max_seq_len)
    if current is not None:
        seq_len = min(seq_len, int(read_export_config(current).max_seq_len))

    def score(model_dir: Path) -> float:
        return float(evaluate_export(model_dir, data_dir, seq_len=seq_len, batch_size=batch_size,
                                     batches=eval_batches)["loss"])

    out: dict[str, Any] = {"candidate_eval_loss": score(cand), "promoted_eval_loss": None,
                           "improvement": None, "seq_len": seq_len,
                           "min_improvement": float(min_improvement)}
    if current is None:
        out.update(decision=PROMOTE, reason="no promoted model yet")
        return out
    out["promoted_eval_loss"] = score(current)
    out["promoted_version"] = current.resolve().name
    out["improvement"] = out["promoted_eval_loss"] - out["candidate_eval_loss"]
    if out["improvement"] > min_improvement:
        out.update(decision=PROMOTE, reason=f"eval loss {out['candidate_eval_loss']:.4f} beats "
                   f"{out['promoted_eval_loss']:.4f} by {out['improvement']:.4f}")
    else:
        out.update(decision=KEEP, reason=f"eval loss {out['candidate_eval_loss']:.4f} does not "
                   f"beat {out['promoted_eval_loss']:.4f} by more than {min_improvement:g}")
    return out


def promote(candidate_dir: str | os.PathLike[str], promoted_dir: str | os.PathLike[str],
            record: dict[str, Any] | None = None) -> Path:
    """Copy the candidate into a new version and point ``promoted`` at it atomically.

    Args:
        candidate_dir: The export to promote.
        promoted_dir: The ``promoted`` link to (re)point; its parent holds ``versions/``.
        record: Extra facts stored in the version's ``promotion.json`` (decision, run id, ...).

    Returns:
        The new version directory.

    Raises:
        UserError: When the candidate is incomplete or ``promoted`` is a real directory.

    """
    cand, link = Path(candidate_dir), Path(promoted_dir)
    missing = [f for f in MODEL_FILES if not (cand / f).is_file()]
    if missing:
        raise UserError("candidate", f"{cand} lacks {', '.join(missing)}; is it an export?")
    if link.exists() and not link.is_symlink():
        raise UserError("promoted_dir", f"{link} is a real directory, not the link this "
                        "component manages; move it into versions/ or choose another model_name")
    info = _json(cand / "export.json")
    now = dt.datetime.now(dt.timezone.utc)
    version = f"{now.strftime('%Y%m%dT%H%M%S%fZ')}-{str(info.get('sha256', 'unknown'))[:12]}"
    versions = link.parent / "versions"
    versions.mkdir(parents=True, exist_ok=True)
    work = versions / f".tmp-{version}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.mkdir()
        for name in MODEL_FILES:
            shutil.copy2(cand / name, work / name)
        (work / "promotion.json").write_text(json.dumps(
            {"promoted_at": now.isoformat(timespec="seconds"), "source": str(cand),
             **(record or {})}, indent=1, default=str))
        final = versions / version
        os.replace(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tmp_link = link.parent / f".promoted.tmp-{uuid.uuid4().hex}"
    os.symlink(os.path.join("versions", version), tmp_link)
    os.replace(tmp_link, link)
    return final
