"""``prepare_dataset``: source text -> tokenized train/val shards + ``index.json``.

The one library call behind ``kfp-nvrx prepare-data`` and the KFP ``prepare_dataset`` component.
The dataset is built in a temporary directory next to ``out_dir`` and moved into place when
complete, so an interrupted or failed run never leaves partial files; a directory whose
``index.json`` carries the same fingerprint is reused without work.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kfp_nvrx.components.core.ownership import check_output_dir, refuse_foreign
from kfp_nvrx.components.data.sample import write_sample_corpus
from kfp_nvrx.components.data.shards import (
    FORMAT,
    INDEX_NAME,
    SHARD_BYTES,
    ShardWriter,
    check_files,
    dataset_files,
    publish_dir,
    read_index,
    verify_checksums,
    write_json_atomic,
)
from kfp_nvrx.components.data.sources import file_sha256, iter_documents, resolve_sources
from kfp_nvrx.components.data.tokenize import dtype_for_vocab, load_tokenizer
from kfp_nvrx.components.errors import UserError

#: ``source`` scheme for the bundled sample corpus: ``sample:`` or ``sample:<n_docs>``.
SAMPLE_SCHEME = "sample:"
#: Most documents ``sample:N`` writes (about 400 MB of text): it is a demo corpus, and a typo
#: such as ``sample:99999999999`` would fill the temporary disk.
MAX_SAMPLE_DOCS = 1_000_000
SPLITS = ("train", "val")
#: Documents handed to the tokenizer at once.
ENCODE_BATCH = 256


@dataclass(frozen=True)
class Recipe:
    """How a dataset is made from its sources; all but ``shard_bytes`` decide its fingerprint.

    Attributes:
        tokenizer: ``byte`` or a path to a ``tokenizer.json``.
        eos_token: End-of-document token of a tokenizer.json (default: a known one it has).
        text_field: The JSON field holding the text in ``.jsonl`` sources.
        val_fraction: Share of documents held out for validation, in (0, 1).
        seed: Chooses which documents go to val.
        shard_bytes: Maximum shard file size.
    """

    tokenizer: str = "byte"
    eos_token: str | None = None
    text_field: str = "text"
    val_fraction: float = 0.05
    seed: int = 0
    shard_bytes: int = SHARD_BYTES


def fingerprint(source_hashes: list[str], tokenizer_id: str, eos_id: int, text_field: str,
                val_fraction: float, seed: int) -> str:
    """sha256 identifying a dataset: same inputs and settings -> same tokens on disk."""
    key = {"format": FORMAT, "sources": source_hashes, "tokenizer": tokenizer_id, "eos_id": eos_id,
           "text_field": text_field, "val_fraction": float(val_fraction), "seed": int(seed)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _check_args(source: str, out_dir: str | os.PathLike[str], seq_len: Any, recipe: Recipe) -> None:
    val_fraction, text_field, seed = recipe.val_fraction, recipe.text_field, recipe.seed
    if not isinstance(source, str) or not source.strip():
        raise UserError("source", "is required: a file, glob or directory of .txt/.jsonl, or "
                        f"'{SAMPLE_SCHEME}' for the bundled sample corpus")
    if not str(out_dir).strip():
        raise UserError("out_dir", "is required")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise UserError("seq_len", f"must be an integer > 0, got {seq_len!r}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) \
            or not 0 < val_fraction < 1:
        raise UserError("val_fraction", f"must be within (0, 1), got {val_fraction!r}")
    if not isinstance(text_field, str) or not text_field:
        raise UserError("text_field", "must be a non-empty field name, e.g. 'text'")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserError("seed", f"must be an integer >= 0, got {seed!r}")


def _sample_source(source: str, stack: ExitStack) -> str:
    """``sample:[N]`` -> a temporary directory holding the sample corpus (removed on exit)."""
    arg = source[len(SAMPLE_SCHEME):].strip()
    if arg and not arg.isdigit():
        raise UserError("source", f"expected '{SAMPLE_SCHEME}' or '{SAMPLE_SCHEME}<n_docs>', "
                        f"got {source!r}")
    n_docs = int(arg) if arg else 1600
    if not 2 <= n_docs <= MAX_SAMPLE_DOCS:
        raise UserError("source", f"the sample corpus needs at least 2 documents and at most "
                        f"{MAX_SAMPLE_DOCS:,} (about 400 bytes each), got {n_docs:,}; use your "
                        "own files for more")
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kfp-nvrx-sample-"))
    write_sample_corpus(tmp, n_docs=n_docs, seed=0)
    return tmp


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _val_mask(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Which documents go to val: exactly round(n * fraction) (at least 1), chosen by ``seed``."""
    if n_docs < 2:
        raise UserError("source", f"has {n_docs} document(s); at least 2 are needed to split into "
                        "train and val")
    n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
    mask = np.zeros(n_docs, dtype=bool)
    mask[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True
    return mask


def _check_sizes(index: dict[str, Any], seq_len: int) -> None:
    need = seq_len + 1
    if index["splits"]["val"]["tokens"] < need:
        raise UserError("val_fraction", f"the val split has {index['splits']['val']['tokens']} "
                        f"tokens, fewer than seq_len + 1 = {need}; raise val_fraction or add data")
    if index["splits"]["train"]["tokens"] < need:
        raise UserError("source", f"the train split has {index['splits']['train']['tokens']} "
                        f"tokens, fewer than seq_len + 1 = {need}; add data or lower val_fraction")


def _existing(out: Path, fp: str, overwrite: bool) -> tuple[dict[str, Any] | None, set[str]]:
    """Return (the reusable index in ``out`` or None, the names in ``out`` that are ours).

    Only our own dataset is ever replaced (a damaged one, or another one with ``overwrite``), and
    only when the folder holds nothing else; any other non-empty folder is refused.
    """
    if not out.exists():
        return None, set()
    if not out.is_dir():
        raise UserError("out_dir", f"{out} exists and is not a directory")
    if not any(out.iterdir()):
        return None, set()
    index = None
    if (out / INDEX_NAME).is_file():
        try:
            index = read_index(out, "out_dir")
        except UserError:
            index = None
    if index is None:
        raise UserError("out_dir", f"{out} is not empty and is not a dataset made by "
                        "prepare-data (no readable index.json); only our own datasets are "
                        "replaced: choose a new or empty directory")
    ours = dataset_files(index)
    if index.get("fingerprint") == fp:
        # Reuse is checked byte for byte: the sources were just read in full to fingerprint
        # them, so reading the shards once more is of the same cost.
        if check_files(out, index) is None and not verify_checksums(out, index=index):
            return index, ours
        refuse_foreign(out, ours, "out_dir", "damaged dataset being rebuilt")
        return None, ours  # our dataset, damaged: rebuild it
    if not overwrite:
        have = str(index.get("fingerprint", "unknown"))[:12]
        raise UserError("out_dir", f"{out} holds a different dataset (fingerprint {have}, "
                        f"wanted {fp[:12]}); pass `overwrite` or choose another directory")
    refuse_foreign(out, ours, "out_dir", "dataset being replaced")
    return None, ours


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_splits(files: list[Path], tok: Any, recipe: Recipe, work: Path, dtype: str,
                  log: Callable[[str], None]) -> dict[str, Any]:
    text_field = recipe.text_field
    n_docs = sum(1 for f in files for _ in iter_documents(f, text_field))
    in_val = _val_mask(n_docs, recipe.val_fraction, recipe.seed)
    writers = {s: ShardWriter(work, s, dtype, recipe.shard_bytes) for s in SPLITS}
    eos = np.array([tok.eos_id], dtype=np.int64)
    i = 0
    try:
        for f in files:
            for docs in _batched(iter_documents(f, text_field), ENCODE_BATCH):
                for ids in tok.encode_batch(docs):
                    writers["val" if in_val[i] else "train"].write(np.concatenate([ids, eos]))
                    i += 1
            log(f"tokenized {f} ({i}/{n_docs} documents)")
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    splits = {s: writers[s].finish() for s in SPLITS}
    for s in SPLITS:
        splits[s]["docs"] = int((in_val if s == "val" else ~in_val).sum())
    return splits


def prepare_dataset(source: str, out_dir: str | os.PathLike[str], recipe: Recipe = Recipe(), *,
                    seq_len: int = 64, overwrite: bool = False,
                    log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Tokenizes ``source`` into train/val shards under ``out_dir`` (or reuses them).

    Args:
        source: A file, glob or directory of ``.txt`` / ``.jsonl`` / ``.json`` (JSON lines), or
            ``sample:`` / ``sample:<n_docs>`` for the bundled sample corpus.
        out_dir: The dataset directory to create.
        recipe: Tokenizer, text field, val split and shard size.
        seq_len: The sequence length the data is for; each split needs ``seq_len + 1`` tokens.
        overwrite: Replace ``out_dir`` when it holds another dataset made by this function
            (a folder holding anything else is never replaced).
        log: Progress callback (one line per source file).

    Returns:
        The index (as written to ``index.json``) plus ``status`` (``written`` or ``skipped``)
        and ``path``; those two keys are not stored in the file.

    Raises:
        UserError: On bad arguments or inputs, naming the field.

    """
    _check_args(source, out_dir, seq_len, recipe)
    log = log or (lambda _msg: None)
    out = Path(out_dir).absolute()
    with ExitStack() as stack:
        if source.strip().startswith(SAMPLE_SCHEME):
            source = _sample_source(source.strip(), stack)
        files = resolve_sources(source)
        tok = load_tokenizer(recipe.tokenizer, recipe.eos_token)
        dtype = dtype_for_vocab(tok.vocab_size)
        fp = fingerprint([file_sha256(f) for f in files], tok.id, tok.eos_id, recipe.text_field,
                         recipe.val_fraction, recipe.seed)
        check_output_dir(out, "out_dir", files)
        index, ours = _existing(out, fp, overwrite)
        if index is not None:
            _check_sizes(index, seq_len)
            return {**index, "status": "skipped", "path": str(out)}
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            os.chmod(work, 0o777 & ~_umask())  # mkdtemp makes 0700; the dataset is shared
        except OSError as err:
            raise UserError("out_dir", f"cannot create {out}: {err.strerror or err}") from None
        try:
            splits = _write_splits(files, tok, recipe, work, dtype, log)
            index = {"format": FORMAT, "tokenizer": tok.id, "vocab_size": tok.vocab_size,
                     "eos_id": tok.eos_id, "dtype": dtype, "seq_len": seq_len,
                     "fingerprint": fp, "text_field": recipe.text_field,
                     "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     "splits": splits}
            _check_sizes(index, seq_len)
            write_json_atomic(work / INDEX_NAME, index)
            publish_dir(work, out, ours)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return {**index, "status": "written", "path": str(out)}


def summary(result: dict[str, Any]) -> str:
    """One line for the CLI and logs: tokens per split, vocab, dtype, fingerprint prefix, status."""
    splits = " ".join(f"{s}={result['splits'][s]['tokens']:,} tokens" for s in SPLITS)
    return (f"dataset {result['status']}: {result.get('path', '')} {splits} "
            f"vocab={result['vocab_size']} dtype={result['dtype']} tokenizer="
            f"{result['tokenizer'].split('@')[0]} fingerprint={result['fingerprint'][:12]}")
