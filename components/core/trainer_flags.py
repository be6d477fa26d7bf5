"""The trainer's own flags, declared once: what every parser of them reads and TrainerArgs writes.

The trainer (``python -m kfp_nvrx.components.training.trainer``), ``launch-local``, ``render-job``
and ``launch`` (passed through), and the ``kfp-nvrx-ft`` runtime's command (:mod:`.runtime_entry`)
read ``--config``, ``--run-dir``, ``--set`` and ``--fault`` with :func:`add_trainer_flags`;
:meth:`.launch_command.TrainerArgs.argv` writes them. Each takes ``--set`` and ``--fault`` one
or more values at a time, as often as given; the values land in ``overrides`` and ``faults``.
Imports no torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection

from kfp_nvrx.components.core.faults import FAULT_KINDS

CONFIG_FLAG = "--config"
RUN_DIR_FLAG = "--run-dir"
SET_FLAG = "--set"
FAULT_FLAG = "--fault"


def add_trainer_flags(p: argparse._ActionsContainer, *, config: str | None = None,
                      required: Collection[str] = (), run_dir_help: str = "",
                      run_dir_type: Callable[[str], str] | None = None) -> None:
    """Adds the trainer's flags to ``p`` (a parser or an argument group).

    Args:
        p: Where the flags go.
        config: ``--config``'s default (None: none).
        required: The flags the surface requires, of ``--config`` and ``--run-dir``.
        run_dir_help: ``--run-dir``'s help, where the surface has its own default.
        run_dir_type: A check of ``--run-dir`` (the CLI's: no empty path).
    """
    default = f" (default {config})" if config else ""
    p.add_argument(CONFIG_FLAG, default=config, required=CONFIG_FLAG in required,
                   help=f"trainer preset (tiny, 125m, 1b, 8b) or YAML path{default}")
    p.add_argument(RUN_DIR_FLAG, default=None, required=RUN_DIR_FLAG in required,
                   type=run_dir_type or str, help=run_dir_help or "run directory (checkpoints, events)")
    p.add_argument(SET_FLAG, dest="overrides", action="extend", nargs="+", default=[],
                   metavar="SECTION.KEY=VALUE", help="override a trainer config value (repeatable)")
    p.add_argument(FAULT_FLAG, dest="faults", action="extend", nargs="+", default=[],
                   metavar="KIND@STEP[/RANK]",
                   help=f"inject a fault once per run (drills; repeatable): {FAULT_KINDS.listing()}")
