"""The run directory: every name in it (the checkpoints' own are the checkpoint store's).

One run directory is shared by every worker of a run, the launcher and the tools that read a run
afterwards (export, drills, goodput)::

    <run_dir>/
      config.yaml              the run's record: the resolved config of its first start (never
                               replaced; see :mod:`.run_record`)
      config.resumed.yaml      the resolved config of the newest start that differed from it
      dataset.json             the data the run trains on, by content (never replaced; see
                               :mod:`.dataset_record`)
      events.jsonl             run events (:mod:`.events`)
      faults/                  one marker per injected fault that fired (fires once per run)
      nccl_trace/rank_*        NCCL flight-recorder dumps
      checkpoints/             the volume checkpoint store (:mod:`.volume_store`; its layout is
                               :mod:`.volume_layout`'s, reached through :mod:`.ckpt_store`)

Nothing is written or deleted through a symbolic link below the run dir (:func:`link_in`): a
``checkpoints`` that links elsewhere would make pruning delete a stranger's ``step_*`` folders.
:func:`.run_record.check_run_dir` refuses such a run dir before anything starts; the writer and the pruner
check again where they act. This module imports no torch.
"""

from __future__ import annotations

import stat
from pathlib import Path

# link_in, refuse_link and write_atomic live in .atomic; imported from here too (one run-dir API).
from kfp_nvrx.components.core.atomic import link_in, refuse_link, write_atomic  # noqa: F401
from kfp_nvrx.components.core.bounded import kind_of
from kfp_nvrx.components.core.timeline import committed_steps  # noqa: F401

# The checkpoints' layout is the volume store's (.volume_layout); product code reaches it through
# .ckpt_store. These names stay importable from here for the tests that build checkpoints by hand.
from kfp_nvrx.components.core.volume_layout import (  # noqa: F401
    CHECKPOINTS_DIR,
    COMMIT_MARKER,
    CRC_SIDECAR_PREFIX,
    DCP_METADATA,
    STEP_PREFIX,
    checkpoints_dir,
    crc32_file,
    parse_step,
    read_commit_marker,
    remove_torn,
    step_dir,
    verify,
    write_commit_marker,
)
from kfp_nvrx.components.errors import UserError

CONFIG_FILE = "config.yaml"
RESUMED_CONFIG_FILE = "config.resumed.yaml"
DATASET_FILE = "dataset.json"
EVENTS_FILE = "events.jsonl"
FAULTS_DIR = "faults"
NCCL_TRACE_DIR = "nccl_trace"
#: Every line each local agent (ft_launcher and its workers) printed: ``node<i>.log``.
LOGS_DIR = "logs"


#: Entries of a run dir whose own entries we create, delete or write (each checked for links).
_WRITTEN_DIRS = (CHECKPOINTS_DIR, LOGS_DIR, FAULTS_DIR, NCCL_TRACE_DIR)


#: Files of a run dir every start appends to or replaces: each must be a regular file.
_WRITTEN_FILES = (CONFIG_FILE, RESUMED_CONFIG_FILE, DATASET_FILE, EVENTS_FILE)


def _refuse_special(entry: Path, folder: bool) -> None:
    """Refuses ``entry`` unless it is a folder (``folder``) or a regular file.

    A FIFO at events.jsonl blocked every rank's first event forever; a folder there gave a
    traceback per restart.
    """
    mode = entry.lstat().st_mode
    if stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode):
        return
    what = "a file" if stat.S_ISREG(mode) else kind_of(mode)
    raise UserError("run_dir", f"{entry} is {what}, where kfp-nvrx writes a "
                    f"{'folder' if folder else 'file'}; remove it or use another `run_dir`")


def check_run_dir_links(run_dir: Path) -> None:
    """Refuses a run dir holding a link, FIFO, device or socket where we write (one line, exit 2).

    Also a folder where we write a file (events.jsonl, config.yaml) and a file where we write
    a folder (checkpoints, logs).
    """
    if not run_dir.is_dir():
        return
    for entry in run_dir.iterdir():  # config.yaml, events.jsonl, the lock, the marker, ...
        refuse_link(entry, run_dir)
        if entry.name in _WRITTEN_FILES or entry.name in _WRITTEN_DIRS:
            _refuse_special(entry, folder=entry.name in _WRITTEN_DIRS)
        if entry.name in _WRITTEN_DIRS:
            for child in entry.iterdir():  # step_* folders, node logs, NCCL dumps
                refuse_link(child, run_dir)
                if entry.name == LOGS_DIR:  # the launcher appends to them
                    _refuse_special(child, folder=False)
