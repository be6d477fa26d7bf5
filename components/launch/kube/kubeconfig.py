"""Kubeconfig files are checked before anything opens them: regular files of a bounded size.

The ``kubernetes`` client's loader (and our own redaction, which reads the credentials first so
that no error can print them) opens the kubeconfig and the files it names with a plain ``open``:
a kubeconfig that is a FIFO hung the launcher before it said anything, and a ``tokenFile`` of
``/dev/zero`` was read until memory ran out. :func:`check_kubeconfig` refuses both in one line,
through the bounded reader (:mod:`..core.bounded`), before any loader runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kfp_nvrx.components.core.bounded import CONFIG_LIMIT, read_bytes, read_text
from kfp_nvrx.components.errors import UserError

#: Keys that name a file, per kubeconfig section (``users[].user``, ``clusters[].cluster``).
FILE_KEYS = {"users": ("user", ("tokenFile", "client-certificate", "client-key")),
             "clusters": ("cluster", ("certificate-authority",))}


def kubeconfig_paths(explicit: str | None) -> list[Path]:
    """The kubeconfig files the loader reads: ``explicit``, else ``$KUBECONFIG``, else the default.

    Args:
        explicit: A path or ``$KUBECONFIG``-style list (``:``-separated); None or ''.
    """
    raw = explicit or os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    return [Path(p) for p in raw.split(os.pathsep) if p]


def _named_files(doc: Any, base: Path) -> list[tuple[str, Path]]:
    """(key, path) of every file a kubeconfig document names (relative to its folder)."""
    found = []
    for section, (item, keys) in FILE_KEYS.items():
        entries = doc.get(section) if isinstance(doc, dict) else None
        for entry in entries if isinstance(entries, list) else []:
            inner = entry.get(item) if isinstance(entry, dict) else None
            for key in keys:
                value = inner.get(key) if isinstance(inner, dict) else None
                if isinstance(value, str) and value:
                    found.append((key, base / os.path.expanduser(value)))
    return found


def check_kubeconfig(explicit: str | None, field: str = "kubeconfig") -> None:
    """Refuses a kubeconfig, or a file it names, that is no regular file or is too large.

    A file that does not exist is left to the loader, which says what it needs (a file named
    for a user the current context does not use is never read).

    Raises:
        UserError: Naming ``field``: a FIFO, device, socket or folder, or more than 1 MiB.
    """
    for path in kubeconfig_paths(explicit):
        if not os.path.lexists(path):
            continue
        text = read_text(path, field, CONFIG_LIMIT, "kubeconfig")
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError:
            continue  # the loader reports the file's own errors
        except RecursionError:  # [[[[...: the YAML parser (and the loader's) recurses per level
            raise UserError(field, f"{path} nests deeper than a kubeconfig ever does (the YAML "
                            "parser gave up); give the cluster's kubeconfig") from None
        for key, file in _named_files(doc, path.parent):
            if os.path.lexists(file):
                read_bytes(file, field, CONFIG_LIMIT, f"kubeconfig {key}")


@contextlib.contextmanager
def exec_plugins_stopped(grace_s: float = 2.0) -> Iterator[None]:
    """Stops, when the block ends however it ends, every process it started and left running.

    A kubeconfig's ``exec`` credential plugin (``aws eks get-token``, an SSO helper waiting for a
    login) is a child of the launcher, run by the ``kubernetes`` client, which waits for it: a
    SIGTERM that ended the launcher while it waited left the plugin running (issue 38 item 4).
    The Kubernetes launch path starts no other process, so what is new below us is the plugin:
    SIGTERM, then after ``grace_s`` SIGKILL.
    """
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    try:
        yield
    finally:
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, alive = psutil.wait_procs(left, timeout=grace_s)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()

