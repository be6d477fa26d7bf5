"""Replacing a file so that a reader sees the old bytes or the new ones, never a part.

Every file kfp-nvrx writes over (commit markers, the run's config record, the dataset index and
shards, rendered jobs, compiled pipelines, reports) goes through :class:`AtomicFile`: a temporary
file in the target's own directory (a rename is atomic only within one file system), fsync'd,
renamed over the target with ``os.replace``, then the directory fsync'd so the rename itself
survives a power cut. A crash at any point leaves the old file (or none) under the target's name;
any other failure (a full disk, an exception while writing) also removes the temporary file.

Only a regular file (or nothing) is ever replaced. A symbolic link, FIFO, device node, socket or
directory at the target is refused (:func:`refuse_replacing`), before anything is written and
again just before the rename: ``os.replace`` would swap any of them for our file, and as root
``--out /dev/null`` once replaced the machine's /dev/null with a 0600 regular file. The temporary
file gets a fresh name and is created exclusively (``O_EXCL | O_NOFOLLOW``), so a link planted
under its name is never written through. ``inside=`` asks for more: no link may lie between that
directory and the target (the run dir's rule, see :func:`refuse_link`).

Every error names the target, never the temporary file: the user named the target (a flag's
value), and the CLI maps that path back to the flag. Imports no torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from types import TracebackType

from kfp_nvrx.components.core.bounded import kind_of

StrPath = str | os.PathLike[str]


def link_in(path: StrPath, top: StrPath) -> Path | None:
    """The first symbolic link among ``path`` and its parents below ``top``; None when none is.

    ``top`` itself (the run dir the user named) may be a link; nothing inside it may.
    """
    path, top = Path(path), Path(top)
    try:
        rel = path.relative_to(top)
    except ValueError:
        rel = Path(os.path.relpath(path, top))
    cur = top
    for part in rel.parts:
        cur = cur / part
        if part == ".." or cur.is_symlink():
            return cur
    return None


def refuse_link(path: StrPath, top: StrPath, field: str = "run_dir") -> Path:
    """``path``, after checking that no link lies between it and ``top`` (:func:`link_in`).

    Raises:
        UserError: Naming ``field`` and the link.
    """
    from kfp_nvrx.components.errors import UserError

    link = link_in(path, top)
    if link is not None:
        raise UserError(field, f"{link} is a symbolic link (to {os.readlink(link)!r}); kfp-nvrx "
                        "never writes or deletes through a link inside a run dir: replace it "
                        "with a real directory or use a fresh `run_dir`")
    return Path(path)


def refuse_replacing(path: StrPath) -> None:
    """Raises when ``path`` holds something a written output must never replace.

    Nothing or a regular file is fine; anything else stays as it is.

    Raises:
        OSError: Naming ``path``: ``ELOOP`` for a symbolic link, ``EISDIR`` for a directory,
            ``EEXIST`` for a FIFO, device node or socket; or what ``lstat`` raised.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    if stat.S_ISLNK(mode):
        code, what = errno.ELOOP, "a symbolic link"
    else:
        code, what = (errno.EISDIR if stat.S_ISDIR(mode) else errno.EEXIST), kind_of(mode)
    raise OSError(code, f"{what} is there, and an output never replaces one; give the path of "
                  "a regular file", str(path))


def _naming(err: OSError, path: Path, tmp: Path) -> OSError:
    """``err`` about ``path`` where it named the temporary file ``tmp`` (or no file at all)."""
    if err.filename not in (None, str(tmp)):
        return err
    return OSError(err.errno, err.strerror or str(err), str(path))


def fsync_dir(directory: Path) -> None:
    """Makes a rename in ``directory`` durable.

    A file system that cannot fsync a directory (some FUSE and network mounts answer EINVAL)
    has the rename done all the same, so that answer is not an error.
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


class AtomicFile:
    """A binary file written under a temporary name that :meth:`commit` renames to ``path``.

    As a context manager it commits when the block ends normally and aborts when it raises::

        with AtomicFile(path) as out:
            out.write(data)

    Args:
        path: The file to create or replace.
        perms: Permission bits of the new file (the umask applies, as for any created file).
        inside: A directory no link may lie below on the way to ``path``.
        suffix: How the temporary file's name ends (a writer that picks its format by the
            name, such as KFP's compiler, wants ``.yaml``).

    Raises:
        OSError: Naming ``path`` (never the temporary file): what :func:`refuse_replacing`
            refuses; ``ELOOP`` when ``inside`` is given and a link lies between it and
            ``path``; whatever creating the temporary file raises (``ENOENT`` for a missing
            directory, ``EACCES``).
    """

    def __init__(self, path: StrPath, *, perms: int = 0o644, inside: StrPath | None = None,
                 suffix: str = ".tmp") -> None:
        self.path = Path(path)
        if inside is not None:
            link = link_in(self.path, inside)
            if link is not None:
                raise OSError(errno.ELOOP, f"a symbolic link inside {inside} is on the way; "
                              "nothing is written through it", str(link))
        # pid + random: ranks and retried pods writing the same target never share a temp file.
        name = f".{self.path.name[:200]}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"
        self.tmp = self.path.with_name(name)
        refuse_replacing(self.path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.tmp, flags, perms)
        except OSError as err:
            raise _naming(err, self.path, self.tmp) from None
        self.file = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> int:
        """Appends ``data`` to the temporary file."""
        return self.file.write(data)

    def commit(self) -> Path:
        """Flushes and fsyncs the temporary file and renames it to ``path`` (aborts on failure).

        What lies at ``path`` is checked again just before the rename: a FIFO or link put there
        while the file was written is refused all the same.
        """
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            refuse_replacing(self.path)
            os.replace(self.tmp, self.path)
        except OSError as err:
            self.abort()
            raise _naming(err, self.path, self.tmp) from None
        except BaseException:
            self.abort()
            raise
        fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Closes and removes the temporary file; ``path`` keeps what it held."""
        with contextlib.suppress(OSError):  # a full disk can fail the close's flush
            self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if typ is None:
            self.commit()
        else:
            self.abort()


def write_atomic(path: StrPath, data: bytes | str, *, perms: int = 0o644,
                 inside: StrPath | None = None) -> Path:
    """Writes ``data`` (a str as UTF-8) to ``path`` with :class:`AtomicFile`; returns ``path``."""
    with AtomicFile(path, perms=perms, inside=inside) as out:
        out.write(data.encode("utf-8") if isinstance(data, str) else data)
    return out.path


def check_output(path: StrPath, field: str) -> None:
    """Refuses, before any work is done, an output path that could not or must not be written.

    A command checks its output flags first, so that a bad one costs nothing (not a whole
    training run before ``--result`` is found unwritable) and the error names the flag.

    Args:
        path: The file the command will write (its folder may not exist yet).
        field: What named it, for the error.

    Raises:
        UserError: Naming ``field``: :func:`refuse_replacing` refuses what is there, or the
            nearest existing folder on the way is no folder or cannot be written to.
    """
    from kfp_nvrx.components.errors import UserError

    try:
        refuse_replacing(path)
    except OSError as err:
        if err.errno != errno.ENOTDIR:  # a file on the way: said below, in words
            raise UserError(field, f"{path}: {err.strerror}") from None
    _creatable(path, field)


def _creatable(path: StrPath, field: str) -> None:
    """Refuses ``path`` when the nearest existing folder on its way is none, or not writable."""
    from kfp_nvrx.components.errors import UserError

    parent = Path(os.path.abspath(path)).parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(field, f"{parent} is not a folder, so {path} cannot be created; give "
                        "another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(field, f"cannot create files in {parent} (permission denied); give a "
                        "path you can write to")


def check_output_folder(path: StrPath, field: str) -> None:
    """Refuses, before any work, an output folder that is something else or cannot be made.

    ``--out /dev/null`` for a command that writes a folder ran a whole pipeline into errors.

    Raises:
        UserError: Naming ``field``: ``path`` is a file, FIFO or device (a link to a folder is
            a folder), or :func:`check_output` would refuse its parent.
    """
    from kfp_nvrx.components.errors import UserError

    if os.path.isdir(path):
        return
    if os.path.lexists(path):
        mode = os.stat(path).st_mode if os.path.exists(path) else os.lstat(path).st_mode
        what = "a file" if stat.S_ISREG(mode) else kind_of(mode)
        if stat.S_ISLNK(mode):
            what = "a symbolic link to nothing"
        raise UserError(field, f"{path} is {what}, not a folder; give a folder (new or one "
                        "this command made)")
    _creatable(path, field)
