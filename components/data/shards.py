"""Token shards on disk: the writer used by ``prepare-data`` and a small reader.

Format (``kfp-nvrx-tokens/1``): a directory with ``index.json`` and, per split, raw little-endian
arrays of token ids named ``<split>_<NNNNN>.bin`` in the index's ``dtype`` (``np.memmap``-able).
``index.json`` is written last; a directory without it is not a dataset.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kfp_nvrx.components.core.atomic import AtomicFile, write_atomic
from kfp_nvrx.components.core.bounded import read_json
from kfp_nvrx.components.errors import UserError

FORMAT = "kfp-nvrx-tokens/1"
INDEX_NAME = "index.json"
#: Upper bound of one shard file.
SHARD_BYTES = 64 * 1024 * 1024
#: Token dtypes prepare-data writes (the smallest that holds the vocabulary).
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
#: Shard names prepare-data writes; an index naming anything else is not ours.
_SHARD_NAME = re.compile(r"(train|val)_\d{5,}\.bin")
#: Splits up to this size are checksummed before training and evaluation (reading 2 GiB takes
#: seconds); larger ones are checked for presence and size only.
VERIFY_BYTES = 2 << 30


def write_json_atomic(path: Path, obj: Any) -> None:
    """``json.dumps`` (indented, sorted) written with :func:`write_atomic`."""
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


@dataclass
class ShardWriter:
    """Appends token ids to ``<split>_NNNNN.bin`` files of at most ``shard_bytes`` each.

    Each shard is written to a temporary name and renamed when complete; its sha256 is computed
    while writing.
    """

    out_dir: Path
    split: str
    dtype: str
    shard_bytes: int = SHARD_BYTES
    shards: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    _out: AtomicFile | None = None
    _hash: Any = None
    _count: int = 0

    @property
    def _cap(self) -> int:
        return max(1, self.shard_bytes // np.dtype(self.dtype).itemsize)

    def write(self, ids: np.ndarray) -> None:
        """Append ``ids`` (any integer array; values must fit ``dtype``)."""
        arr = np.ascontiguousarray(ids, dtype=np.dtype(self.dtype).newbyteorder("<"))
        while arr.size:
            out = self._out if self._out is not None else self._open()
            take = min(arr.size, self._cap - self._count)
            chunk = arr[:take].tobytes()
            out.write(chunk)
            self._hash.update(chunk)
            self._count += take
            self.tokens += take
            arr = arr[take:]
            if self._count >= self._cap:
                self._close(out)

    def _open(self) -> AtomicFile:
        self._out = AtomicFile(self.out_dir / f"{self.split}_{len(self.shards):05d}.bin")
        self._hash = hashlib.sha256()
        self._count = 0
        return self._out

    def _close(self, out: AtomicFile) -> None:
        name = out.commit().name
        self.shards.append({"file": name, "tokens": self._count, "sha256": self._hash.hexdigest()})
        self._out = self._hash = None
        self._count = 0

    def finish(self) -> dict[str, Any]:
        """Close the open shard; return the split's index entry ``{"tokens", "shards"}``."""
        if self._out is not None:
            self._close(self._out)
        return {"tokens": self.tokens, "shards": list(self.shards)}

    def abort(self) -> None:
        """Close and remove a half-written shard (the caller removes the directory)."""
        if self._out is not None:
            self._out.abort()
            self._out = None


def read_index(data_dir: str | os.PathLike[str], field_name: str = "data") -> dict[str, Any]:
    """Load and check ``<data_dir>/index.json`` (format, dtype, splits and shard entries).

    Raises:
        UserError: (naming ``field_name``) when the directory is not a dataset of this format.

    """
    path = Path(data_dir) / INDEX_NAME
    if not os.path.lexists(path):  # anything else there (a FIFO, /dev/zero): read_json says what
        raise UserError(field_name, f"{data_dir} is not a dataset (no {INDEX_NAME}); "
                        "create one with kfp-nvrx prepare-data")
    index = read_json(path, field_name, what="dataset index")  # bounded, depth-safe
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        got = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise UserError(field_name, f"{path} has format {got!r}, expected {FORMAT!r}")
    problem = _index_problem(index)
    if problem:
        raise UserError(field_name, f"{path}: {problem}; re-run prepare-data")
    return index


def _index_problem(index: dict[str, Any]) -> str | None:
    """What is wrong with an index's fields (None: nothing), so readers never trip over it."""
    dtype, vocab = index.get("dtype"), index.get("vocab_size")
    if dtype not in TOKEN_DTYPES:
        return f"dtype {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}"
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        return f"vocab_size {vocab!r} is not an integer >= 1"
    if vocab - 1 > np.iinfo(dtype).max:
        return f"vocab_size {vocab} does not fit its dtype {dtype}"
    splits = index.get("splits")
    if not isinstance(splits, dict) or not splits:
        return "no splits"
    for split, entry in splits.items():
        problem = _split_problem(split, entry)
        if problem:
            return problem
    return None


def _split_problem(split: str, entry: Any) -> str | None:
    """What is wrong with one split's entry of an index (None: nothing)."""
    shards = entry.get("shards") if isinstance(entry, dict) else None
    if not isinstance(shards, list):
        return f"split {split!r} has no shard list"
    for shard in shards:
        name = shard.get("file") if isinstance(shard, dict) else None
        if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name):
            return f"split {split!r} names a shard {name!r} that prepare-data never writes"
        tokens = shard.get("tokens")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            return f"shard {name} has a token count {tokens!r}"
        if not isinstance(shard.get("sha256"), str):
            return f"shard {name} has no sha256"
    if entry.get("tokens") != sum(s["tokens"] for s in shards):
        return f"split {split!r} token count does not add up over its shards"
    return None


def check_files(data_dir: Path, index: dict[str, Any]) -> str | None:
    """Check cheaply that every shard is present with its size; return the problem or None."""
    itemsize = np.dtype(index["dtype"]).itemsize
    for split, entry in index["splits"].items():
        for shard in entry["shards"]:
            path = data_dir / shard["file"]
            if not path.is_file():
                return f"{split} shard {shard['file']} is missing"
            if path.stat().st_size != shard["tokens"] * itemsize:
                return f"{split} shard {shard['file']} has the wrong size"
    return None


def verify_checksums(data_dir: str | os.PathLike[str], splits: Collection[str] | None = None,
                     index: dict[str, Any] | None = None) -> list[str]:
    """Recompute the shards' sha256 (of ``splits``, default all); return the files that differ."""
    data_dir = Path(data_dir)
    index = index if index is not None else read_index(data_dir)
    bad = []
    for split, entry in index["splits"].items():
        if splits is not None and split not in splits:
            continue
        for shard in entry["shards"]:
            digest = hashlib.sha256()
            try:
                with open(data_dir / shard["file"], "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):  # noqa: B023
                        digest.update(block)
            except OSError:
                bad.append(shard["file"])
                continue
            if digest.hexdigest() != shard["sha256"]:
                bad.append(shard["file"])
    return bad


def check_checksums(data_dir: str | os.PathLike[str], index: dict[str, Any], splits: Collection[str],
                    field_name: str, limit_bytes: int = VERIFY_BYTES) -> bool:
    """Verify the shards of ``splits`` when they total at most ``limit_bytes``.

    Returns:
        True when verified, False when skipped as too large to read before every run (then only
        presence and sizes are checked, by the readers).

    Raises:
        UserError: (naming ``field_name``) when a shard's content no longer matches its sha256.

    """
    itemsize = np.dtype(index["dtype"]).itemsize
    size = sum(s["tokens"] * itemsize for split in splits
               for s in index["splits"].get(split, {}).get("shards", []))
    if size > limit_bytes:
        return False
    bad = verify_checksums(data_dir, splits, index)
    if bad:
        raise UserError(field_name, f"{data_dir}: shard {bad[0]} no longer matches the sha256 in "
                        f"{INDEX_NAME} ({len(bad)} shard(s) differ); re-create the dataset with "
                        "prepare-data")
    return True


class SplitTokens:
    """Read-only view of one split as a single token sequence over memory-mapped shards.

    Args:
        data_dir: The dataset directory.
        split: ``train`` or ``val``.
        index: The loaded index (read from ``data_dir`` when omitted).

    """

    def __init__(self, data_dir: str | os.PathLike[str], split: str,
                 index: dict[str, Any] | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.index = index if index is not None else read_index(self.data_dir)
        if split not in self.index["splits"]:
            raise UserError("split", f"{data_dir} has no split {split!r}")
        dtype = np.dtype(self.index["dtype"]).newbyteorder("<")
        shards = [s for s in self.index["splits"][split]["shards"] if s["tokens"]]
        problem = check_files(self.data_dir, self.index)
        if problem:
            raise UserError("data", f"{data_dir}: {problem}; re-run prepare-data")
        self._maps = [np.memmap(self.data_dir / s["file"], dtype=dtype, mode="r",
                                shape=(s["tokens"],)) for s in shards]
        self._starts = np.cumsum([0] + [m.size for m in self._maps])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Read tokens ``[start, start + length)`` as int64 (may cross shard boundaries)."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"range [{start}, {start + length}) outside 0..{len(self)}")
        out = np.empty(length, dtype=np.int64)
        pos = 0
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while pos < length:
            off = start + pos - int(self._starts[i])
            take = min(length - pos, self._maps[i].size - off)
            out[pos:pos + take] = self._maps[i][off:off + take]
            pos += take
            i += 1
        return out


def dataset_files(index: dict[str, Any]) -> set[str]:
    """The names a dataset's index accounts for: itself and every shard."""
    names = {INDEX_NAME}
    for entry in (index.get("splits") or {}).values():
        names.update(str(s.get("file")) for s in entry.get("shards", []))
    return names


def publish_dir(tmp: Path, out: Path, ours: Collection[str], last: str = INDEX_NAME,
                field: str = "out_dir") -> None:
    """Move the finished directory ``tmp`` to ``out``, replacing what is there.

    Only a directory holding nothing but ``ours`` (the files an earlier run wrote) is replaced;
    anything else in it is refused (checked again here, right before the move). The normal path
    is one rename (``out`` missing or empty) or two (``out`` moved aside and removed after). When
    ``out`` cannot be renamed (a mount point, e.g. a volume or an artifact directory), only
    ``ours`` are replaced one by one: the old ``last`` file (the index) is removed first and the
    new one is moved in last, so ``out`` is never taken for a complete dataset early.
    """
    from kfp_nvrx.components.core.ownership import refuse_foreign

    refuse_foreign(out, ours, field, "output")
    try:
        if out.is_dir() and any(out.iterdir()):
            old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:12]}")  # pids repeat in pods
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        return
    except OSError as err:
        if err.errno not in (errno.EBUSY, errno.EXDEV, errno.EPERM, errno.EACCES):
            raise
    (out / last).unlink(missing_ok=True)
    for child in list(out.iterdir()):
        if child.name in ours:
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    for name in sorted((p.name for p in tmp.iterdir()), key=lambda n: (n == last, n)):
        shutil.move(str(tmp / name), str(out / name))
    tmp.rmdir()
