"""Tokenizers for ``prepare-data``: the built-in byte tokenizer and a ``tokenizer.json`` file.

The byte tokenizer maps text to its UTF-8 bytes (vocab 256) and uses NUL (0) as end-of-document;
NUL bytes in the input are dropped so that 0 only ever marks a document boundary. A
``tokenizer.json`` (Hugging Face ``tokenizers`` format) is loaded with the ``tokenizers`` package,
imported lazily so the byte path works without it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import numpy as np

from kfp_nvrx.components.core.bounded import TOKENIZER_LIMIT, read_bytes
from kfp_nvrx.components.errors import UserError

#: Special tokens tried, in order, when a tokenizer.json is given without ``--eos-token``.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]", "<|im_end|>")


class Tokenizer(Protocol):
    """What the dataset writer needs from a tokenizer."""

    #: Recorded in index.json and the fingerprint: ``byte`` or ``<file name>@sha256:<hex>``.
    id: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> np.ndarray:
        """Encode ``text`` to token ids (no eos appended), as int64."""
        ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Encode several texts (same result as :meth:`encode` on each)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; eos = 0 (NUL bytes of the input are dropped)."""

    id = "byte"
    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> np.ndarray:
        """Encode ``text`` as its UTF-8 bytes without NULs."""
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return raw[raw != 0].astype(np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Encode several texts."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Decode bytes back to text (eos/NUL dropped, invalid UTF-8 replaced)."""
        data = bytes(int(i) for i in ids if int(i) != 0)
        return data.decode("utf-8", errors="replace")


class JsonTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package.

    Args:
        path: The tokenizer.json file.
        eos_token: The end-of-document token; by default the first of :data:`EOS_CANDIDATES`
            that the tokenizer knows.

    """

    def __init__(self, path: Path, eos_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise UserError(
                "tokenizer",
                "a tokenizer.json needs the 'tokenizers' package: pip install 'kfp-nvrx[launcher]' "
                "(or pip install tokenizers), or use `tokenizer=byte`",
            ) from None
        data = read_bytes(path, "tokenizer", TOKENIZER_LIMIT, "tokenizer.json")
        try:
            self._tok = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception subclasses
            msg = " ".join(str(err).split())[:200]
            raise UserError("tokenizer", f"{path} is not a valid tokenizer.json ({msg})") from None
        self.id = f"{path.name}@sha256:{hashlib.sha256(data).hexdigest()}"
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._find_eos(eos_token)

    def _find_eos(self, eos_token: str | None) -> int:
        if eos_token:
            tid = self._tok.token_to_id(eos_token)
            if tid is None:
                raise UserError("eos_token", f"{eos_token!r} is not in the tokenizer's vocabulary")
            return int(tid)
        for cand in EOS_CANDIDATES:
            tid = self._tok.token_to_id(cand)
            if tid is not None:
                return int(tid)
        raise UserError(
            "eos_token",
            f"the tokenizer has none of {', '.join(EOS_CANDIDATES)}; name its end-of-text token "
            "with `eos_token`",
        )

    def encode(self, text: str) -> np.ndarray:
        """Encode ``text`` to token ids without special tokens added by a post-processor."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Encode several texts at once (the Rust tokenizer runs them in parallel)."""
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Decode ids back to text."""
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str, eos_token: str | None = None) -> ByteTokenizer | JsonTokenizer:
    """Load ``"byte"`` or a path to a ``tokenizer.json`` as a tokenizer.

    Raises:
        UserError: When the path does not exist or is not a tokenizer.json (field ``tokenizer``).

    """
    if spec in ("", "byte"):
        if eos_token:
            raise UserError("eos_token", "the byte tokenizer's eos is fixed (0); drop `eos_token`")
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise UserError("tokenizer", f"{spec!r} is neither 'byte' nor an existing tokenizer.json")
    return JsonTokenizer(path, eos_token)


def dtype_for_vocab(vocab_size: int) -> str:
    """Return the smallest unsigned dtype name that holds ids ``0 .. vocab_size - 1``."""
    for name in ("uint8", "uint16", "uint32"):
        if vocab_size - 1 <= np.iinfo(name).max:
            return name
    raise UserError("tokenizer", f"vocab_size {vocab_size} does not fit in uint32")
