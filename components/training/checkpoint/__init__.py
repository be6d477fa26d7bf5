"""Checkpointing: async DCP saves through NVRx's writer, atomic commits, fast and in-memory resume.

Modules, and the object each one holds:

* :mod:`.checkpointer`: :class:`Checkpointer`, one per incarnation: when to save, save and commit,
  where to resume from and load. It owns the :class:`~.async_save.AsyncSaver` and uses the two
  objects below, which outlive in-process restarts (handed over as :class:`Kept`).
* :mod:`.writer`: :class:`NvrxWriter`, NVRx's persistent writer process of this worker process,
  and every writer process it started until reaped (killed at interpreter exit).
* :mod:`.staging`: :class:`HostStaging`, the pinned, shared host buffer a save is copied into (and
  an in-process restart restores from); the writer-process side of a staged write.
* :mod:`.async_save`: how a save's data reaches the writer (staged or NVRx-staged), finalisation.
* :mod:`.recovery`: where a start resumes from: the host-memory tier (:mod:`.host_tier`) or the
  run's checkpoint store (:mod:`kfp_nvrx.components.core.ckpt_store`, which alone knows the layout,
  commits, verifies and prunes); :mod:`.dcp_io` turns a store's step into DCP readers/writers.
* :mod:`.reader`: a faster reader for DCP checkpoints (pipelined large reads).
"""

from kfp_nvrx.components.training.checkpoint.checkpointer import Checkpointer, Kept, Reports
from kfp_nvrx.components.training.checkpoint.staging import HostStaging
from kfp_nvrx.components.training.checkpoint.writer import CheckpointError, NvrxWriter

__all__ = ["CheckpointError", "Checkpointer", "HostStaging", "Kept", "NvrxWriter", "Reports"]
