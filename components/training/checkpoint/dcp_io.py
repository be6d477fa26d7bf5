"""DCP readers and writers for a checkpoint store's steps: the torch side of the store interface.

The stores (:mod:`kfp_nvrx.components.core.ckpt_store`) import no torch, so they hand out a
*location* per step (:meth:`~kfp_nvrx.components.core.ckpt_store.CheckpointStore.location`) and
this module turns it into a DCP ``StorageReader`` / ``StorageWriter``: a POSIX path gets DCP's
file-system ones (and the pipelined :class:`.reader.FastFileSystemReader` for loads); a URL
(``s3://...``) gets DCP's fsspec ones, so a store on an object store needs no change here.
"""

from __future__ import annotations

from typing import Any

import torch.distributed.checkpoint as dcp

from kfp_nvrx.components.core.ckpt_store import CheckpointStore
from kfp_nvrx.components.training.checkpoint.reader import load as fast_load


def _is_url(location: str) -> bool:
    return "://" in location


def storage_reader(location: str) -> dcp.StorageReader:
    """A DCP reader of the checkpoint at ``location``."""
    if _is_url(location):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(location)
    return dcp.FileSystemReader(location)


def storage_writer(location: str) -> dcp.StorageWriter:
    """A DCP writer of a synchronous save to ``location``."""
    if _is_url(location):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(location)
    return dcp.FileSystemWriter(location)


def reader(store: CheckpointStore, step: int) -> dcp.StorageReader:
    """A DCP reader of ``step`` in ``store``."""
    return storage_reader(store.location(step))


def writer(store: CheckpointStore, step: int) -> dcp.StorageWriter:
    """A DCP writer of ``step`` in ``store`` (its entry made by ``store.begin``)."""
    return storage_writer(store.location(step))


def read_metadata(location: str) -> Any:
    """The DCP metadata of the checkpoint at ``location`` (keys, global shapes)."""
    return storage_reader(location).read_metadata()


def load(store: CheckpointStore, step: int, state: dict[str, Any]) -> None:
    """Loads ``step`` into ``state`` in place (collective; DCP reshards to this world size).

    A file-system step goes through :func:`.reader.load` (pipelined large reads).
    """
    location = store.location(step)
    if _is_url(location):
        dcp.load(state, storage_reader=storage_reader(location))
    else:
        fast_load(state, location)
