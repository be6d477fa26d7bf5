"""The kinds of durable checkpoint store a run may pick (``checkpoint.store``), by name.

The config schema checks ``checkpoint.store`` against :func:`store_kinds` and imports only this
module: no store. A kind maps to its factory, ``factory(run_dir)``, or to the ``module:attribute``
path of one, which :func:`.ckpt_store.open_store` imports when a store of that kind is opened
(``tests/unit/test_import_graph.py`` counts that import by name as ``ckpt_store``'s; the volume
store's module is loaded with ``ckpt_store`` itself).
Another durable store (e.g. S3) is one module implementing :class:`.ckpt_store.CheckpointStore`
plus one line in :data:`_FACTORIES` (or a :func:`register_store` call). Imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from kfp_nvrx.components.errors import UserError

#: What a factory takes: the run dir.
StrPath = str | os.PathLike[str]
#: A store factory, or the ``module:attribute`` path of one (imported when a store is opened).
Factory = Callable[[StrPath], Any] | str

#: Durable stores by kind; a run dir's store is made by ``factory(run_dir)``.
_FACTORIES: dict[str, Factory] = {
    "volume": "kfp_nvrx.components.core.volume_store:VolumeStore",
}
#: The store every run uses unless told otherwise (also a run whose record predates the key).
DEFAULT_KIND = "volume"
#: The config key that picks a run's store (``CheckpointConfig.store``), as records name it.
STORE_KEY = "checkpoint.store"


def register_store(kind: str, factory: Factory) -> None:
    """Makes ``open_store(run_dir, kind)`` build the store with ``factory(run_dir)``."""
    _FACTORIES[kind] = factory


def store_kinds() -> list[str]:
    """The registered kinds, sorted."""
    return sorted(_FACTORIES)


def check_kind(kind: str, source: str = "") -> str:
    """``kind`` when a store of that kind is registered.

    Args:
        kind: A ``checkpoint.store`` value.
        source: Where the value came from, for the message (e.g. the run's record).

    Raises:
        UserError: Naming ``checkpoint.store`` and the registered kinds.
    """
    if kind not in _FACTORIES:
        raise UserError(STORE_KEY, f"must be one of {', '.join(store_kinds())}, got {kind!r}"
                        f"{source}")
    return kind


def factory(kind: str) -> Factory:
    """The factory registered for ``kind`` (checked with :func:`check_kind` first)."""
    return _FACTORIES[kind]
