"""The kill-in-ckpt drill's judgement of where its restart resumed (``drills.runner``).

The torn step's *write* must never be loaded; its snapshot in host memory may be, when every rank
sealed it before the kill (the full drill matrix saw both on this 2-core box: resumed from step 4
on the volume, or step 8 from host memory, both bitwise equal to the reference).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kfp_nvrx.components.core.events import EventLog, Start
from kfp_nvrx.components.drills.results import Row
from kfp_nvrx.components.drills.runner import _specific
from kfp_nvrx.components.drills.scenarios import SCENARIOS

KILL_IN_CKPT = next(s for s in SCENARIOS if s.name == "kill-in-ckpt")


def _judged(tmp_path: Path, resumed_from: int, from_memory: bool) -> Row:
    log = EventLog(tmp_path)
    log.emit(Start(incarnation=0, iteration=0, world_size=2, resumed_from=None,
                   from_memory=False))
    log.emit(Start(incarnation=1, iteration=0, world_size=2, resumed_from=resumed_from,
                   from_memory=from_memory))
    row = Row(KILL_IN_CKPT.name, KILL_IN_CKPT.what, KILL_IN_CKPT.expect)
    _specific(row, KILL_IN_CKPT, tmp_path, None)
    return row


@pytest.mark.parametrize(("resumed_from", "from_memory", "fails"), [
    (4, False, False),  # the commit before the torn write
    (8, True, False),  # the torn step's sealed snapshot in host memory
    (8, False, True),  # the torn write itself
])
def test_the_torn_write_is_never_loaded(tmp_path, resumed_from, from_memory, fails):
    row = _judged(tmp_path, resumed_from, from_memory)
    assert bool(row.failures) == fails, row.failures
