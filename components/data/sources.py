"""Source text for ``prepare-data``: files, globs and directories of .txt / .jsonl / .json.

Documents:
- ``.txt``: paragraphs separated by one or more blank lines (a file without blank lines is one
  document).
- ``.jsonl`` / ``.json``: one JSON object per line; the document is its ``text_field`` string.
  Blank lines are skipped.

Files are read as strict UTF-8; every problem is a :class:`UserError` naming the file (and line).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from kfp_nvrx.components.core.bounded import SOURCE_LINE_LIMIT, iter_lines, open_regular
from kfp_nvrx.components.errors import UserError

TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".jsonl", ".json")
SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES


def resolve_sources(source: str) -> list[Path]:
    """Resolve a file, glob or directory to the sorted list of source files.

    Raises:
        UserError: (field ``source``) when nothing matches or a named file has another suffix.

    """
    if not source or not source.strip():
        raise UserError("source", "is empty; give a file, glob or directory of .txt/.jsonl")
    if any(ch in source for ch in "*?["):
        files = sorted({Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file()})
        files = [p for p in files if p.suffix.lower() in SUFFIXES]
        if not files:
            raise UserError("source", f"glob {source!r} matches no {'/'.join(SUFFIXES)} file")
        return files
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise UserError("source", f"directory {source} holds no {'/'.join(SUFFIXES)} file")
        return files
    if path.exists() and not path.is_dir():
        if not path.is_file():  # /dev/zero, a FIFO: refused before anything reads it
            open_regular(path, "source")
        if path.suffix.lower() not in SUFFIXES:
            raise UserError("source", f"{source}: unsupported file type; use {'/'.join(SUFFIXES)}")
        return [path]
    raise UserError("source", f"{source} does not exist")


def file_sha256(path: Path) -> str:
    """Return the sha256 of a source file's bytes (UserError ``source`` when unreadable)."""
    digest = hashlib.sha256()
    try:
        with os.fdopen(open_regular(path, "source"), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except OSError as err:
        raise UserError("source", f"cannot read {path}: {err.strerror or err}") from None
    return digest.hexdigest()


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """The lines of a source file with their newline; a line over SOURCE_LINE_LIMIT is an error."""
    offset = 0
    for lineno, raw in enumerate(iter_lines(path, "source", SOURCE_LINE_LIMIT, keep_ends=True),
                                 start=1):
        if raw is None:
            raise UserError("source", f"{path}:{lineno}: a line longer than "
                            f"{SOURCE_LINE_LIMIT >> 20} MiB; split the document into lines or "
                            "paragraphs")
        try:
            yield lineno, raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError("source", f"{path} is not UTF-8 text (bad byte at offset "
                            f"{offset + err.start})") from None
        offset += len(raw)


def _text_documents(path: Path) -> Iterator[str]:
    para: list[str] = []
    for _, line in _lines(path):
        if line.strip():
            para.append(line)
        elif para:
            yield "".join(para).rstrip("\n")
            para = []
    if para:
        yield "".join(para).rstrip("\n")


def _json_documents(path: Path, text_field: str) -> Iterator[str]:
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError("source", f"{path}:{lineno}: not valid JSON ({err.msg}); expected one "
                            "JSON object per line") from None
        if not isinstance(obj, dict):
            raise UserError("source", f"{path}:{lineno}: expected a JSON object, got "
                            f"{type(obj).__name__}")
        text = obj.get(text_field)
        if not isinstance(text, str):
            keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
            what = "missing" if text_field not in obj else f"a {type(text).__name__}, not a string"
            raise UserError("text_field", f"{path}:{lineno}: field {text_field!r} is {what} "
                            f"(keys: {keys}); set text_field to the field holding the text")
        yield text


def iter_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """Yield the documents of one source file, in order (whitespace-only documents skipped)."""
    docs = (_text_documents(path) if path.suffix.lower() in TEXT_SUFFIXES
            else _json_documents(path, text_field))
    for doc in docs:
        if doc.strip():
            yield doc
