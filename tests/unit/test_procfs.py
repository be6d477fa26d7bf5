"""``/proc/<pid>/stat`` read one way (``core.procfs``), by the agent, the pod entry and workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kfp_nvrx.components.core.procfs import PGRP, PPID, STATE, stat_fields


def test_own_fields() -> None:
    fields = stat_fields()
    assert fields is not None
    assert int(fields[PPID]) == os.getppid() and int(fields[PGRP]) == os.getpgrp()
    assert fields[STATE] in "RS"


def test_a_command_name_with_parentheses_and_spaces(tmp_path: Path) -> None:
    odd = tmp_path / "x) (y"
    odd.symlink_to(sys.executable)
    proc = subprocess.Popen([str(odd), "-c", "import time; time.sleep(60)"])
    try:
        fields = stat_fields(proc.pid)
        assert fields is not None and int(fields[PPID]) == os.getpid()
    finally:
        proc.kill()
        proc.wait()
    assert stat_fields(proc.pid) is None  # reaped: gone
