"""Bounded reads: every file or stream read on the user's behalf has a size cap and a clear error.

A path the user gives can name ``/dev/zero``, a FIFO nobody writes to, a 40 GB log or a JSON
document nested a million levels deep. Each of those once took all memory, hung or raised a
RecursionError. Every reader goes through here instead of ``Path.read_bytes``/``open().read()``:

- only regular files are read: a character device, FIFO, socket or directory is refused (the file
  is opened with ``O_NONBLOCK``, so opening a FIFO without a writer does not block);
- a whole-file read stops at ``limit`` bytes and refuses a larger file, naming the limit;
- a line-by-line read caps every line (``line_limit``) and the total;
- JSON is refused when it nests too deeply or holds ``NaN``/``Infinity`` (not JSON; Python's
  reader takes them and every writer after it emits invalid JSON).

Errors are :class:`UserError` naming the field (flag or setting) that named the file; this module
imports no torch.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from typing import Any

from kfp_nvrx.components.errors import UserError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: Caps per kind of input (bytes). Each is far above any legitimate file of its kind.
TOKEN_LIMIT = 64 * KiB  # a bearer token (service-account JWTs are ~1 KiB)
CONFIG_LIMIT = 1 * MiB  # a trainer --config YAML, --affinity @file, a run's config.yaml
JSON_LIMIT = 16 * MiB  # index.json, commit markers, export.json, CRC sidecars
TOKENIZER_LIMIT = 256 * MiB  # a tokenizer.json (large vocabularies are tens of MiB)
PACKAGE_LIMIT = 64 * MiB  # a compiled pipeline YAML
EVENTS_LIMIT = 2 * GiB  # events.jsonl of a long run (about 200 bytes per step)
EVENT_LINE_LIMIT = 64 * KiB  # one event
SOURCE_LINE_LIMIT = 64 * MiB  # one line of a prepare-data source (a JSONL document)
#: YAML nesting deeper than this is no config of ours (PyYAML's composer recurses per level).
MAX_DEPTH = 64


def _size(n: int) -> str:
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n} bytes"


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO (named pipe)"), for a refusal."""
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], field: str) -> int:
    """Opens ``path`` for reading and returns the descriptor; only a regular file is accepted.

    Raises:
        UserError: Naming ``field`` when it cannot be opened or is not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise UserError(field, f"cannot read {path}: {err.strerror or err}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UserError(field, f"{path} is {kind_of(mode)}, not a file; give a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str | os.PathLike[str], field: str, limit: int, what: str = "file") -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes.

    Reads at most ``limit + 1`` bytes whatever the file claims to be (``/proc`` files report 0,
    a file may grow while read), so memory stays bounded.

    Raises:
        UserError: Naming ``field``: unreadable, not a regular file, or larger than ``limit``.
    """
    fd = open_regular(path, field)
    chunks, total = [], 0
    try:
        while total <= limit:
            chunk = os.read(fd, min(limit + 1 - total, 1 << 20) or 1)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as err:
        raise UserError(field, f"cannot read {path}: {err.strerror or err}") from None
    finally:
        os.close(fd)
    if total > limit:
        raise UserError(field, f"{path} is larger than {_size(limit)}, the most a {what} may "
                        "hold; give the right file")
    return b"".join(chunks)


def read_text(path: str | os.PathLike[str], field: str, limit: int, what: str = "file") -> str:
    """A bounded UTF-8 text file (:func:`read_bytes`); not UTF-8 is a UserError naming ``field``."""
    data = read_bytes(path, field, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(field, f"{path} is not UTF-8 text (byte {err.start}); give a text "
                        f"{what}") from None


def iter_lines(path: str | os.PathLike[str], field: str, line_limit: int,
               limit: int | None = None, keep_ends: bool = False) -> Iterator[bytes | None]:
    """The lines of a regular file as bytes; ``None`` for a line over the cap.

    The newline is stripped unless ``keep_ends``.

    An over-long line is skipped to its end without holding it in memory; the caller decides
    whether that is an error (a source document) or a warning (an event). ``limit`` caps the
    bytes read in all.

    Raises:
        UserError: Naming ``field``: unreadable, not a regular file, or more than ``limit`` bytes.
    """
    fd = open_regular(path, field)
    total = 0
    with os.fdopen(fd, "rb", buffering=1 << 20) as fh:
        while True:
            try:
                line = fh.readline(line_limit + 1)
            except OSError as err:
                raise UserError(field, f"cannot read {path}: {err.strerror or err}") from None
            if not line:
                return
            total += len(line)
            too_long = len(line) > line_limit and not line.endswith(b"\n")
            while too_long and line and not line.endswith(b"\n"):  # skip the rest of the long line
                line = fh.readline(1 << 20)
                total += len(line)
            if limit is not None and total > limit:
                raise UserError(field, f"{path} is larger than {_size(limit)}; give the right "
                                "file")
            yield None if too_long else line if keep_ends else line.rstrip(b"\r\n")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(data: str | bytes, field: str, where: str | os.PathLike[str]) -> Any:
    """JSON text -> object: no NaN/Infinity, no nesting the reader cannot follow.

    Python's JSON reader raises RecursionError on deep nesting (a thousand levels, far past any
    file of ours); that is reported as a damaged file like any other JSON error.

    Raises:
        UserError: Naming ``field`` (and ``where`` the text came from) when it is no such JSON.
    """
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:
        raise UserError(field, f"{where} nests too deeply to be a file kfp-nvrx wrote; restore "
                        "or recreate it") from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError too
        raise UserError(field, f"{where} is not valid JSON ({' '.join(str(err).split())[:200]})"
                        ) from None


def read_json(path: str | os.PathLike[str], field: str, limit: int = JSON_LIMIT,
              what: str = "JSON file") -> Any:
    """A bounded JSON file (:func:`read_bytes` + :func:`parse_json`)."""
    return parse_json(read_bytes(path, field, limit, what), field, path)
