"""The training container's entrypoint keeps Kubernetes' exit-code contract (issue 21.4)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

ENTRY = [sys.executable, "-m", "kfp_nvrx.components.core.pod_entry"]
#: Like ft_launcher: on SIGTERM it stops its "workers" and exits 1 (NVRx's main does).
FT_LIKE = ("import signal, sys, time\n"
           "signal.signal(signal.SIGTERM, lambda *a: (print('stopping', flush=True), "
           "sys.exit(1)))\n"
           "print('ready', flush=True)\n"
           "time.sleep(60)\n")


@pytest.mark.parametrize("script,code", [("raise SystemExit(0)", 0), ("raise SystemExit(1)", 1),
                                         ("raise SystemExit(93)", 93),
                                         ("import os; os.kill(os.getpid(), 9)", 137)])
def test_exit_status_passes_through(script: str, code: int) -> None:
    assert subprocess.run([*ENTRY, sys.executable, "-c", script], timeout=60).returncode == code


def test_sigterm_is_forwarded_and_reported_as_a_stop_not_a_verdict() -> None:
    p = subprocess.Popen([*ENTRY, sys.executable, "-c", FT_LIKE], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    assert p.stdout.readline().strip() == "stopping"  # the child got the signal and stopped
    assert p.wait(60) == 143  # not ft_launcher's 1: the pod was asked to stop


def test_missing_command_and_usage() -> None:
    assert subprocess.run([*ENTRY, "no-such-binary-kfp"], timeout=60).returncode == 127
    assert subprocess.run(ENTRY, timeout=60, capture_output=True).returncode == 2


def test_a_left_behind_grandchild_does_not_hold_it() -> None:
    """The entrypoint ends with its child, not with whatever the child left running."""
    import os

    line = "sleep 120 >/dev/null 2>&1 & echo $!; exit 4"
    out = subprocess.run([*ENTRY, "/bin/sh", "-c", line],
                         timeout=60, capture_output=True, text=True)
    os.kill(int(out.stdout.strip()), signal.SIGKILL)  # leave nothing running
    assert out.returncode == 4


def test_exit_codes_have_one_phrase_for_the_launcher() -> None:
    from kfp_nvrx.components.core.pod_entry import exit_meaning

    assert "gave up" in exit_meaning(1) and "no training progress" in exit_meaning(93)
    assert "SIGKILL" in exit_meaning(137) and "SIGTERM" in exit_meaning(143)
    assert exit_meaning(0) == exit_meaning(None) == exit_meaning(42) == ""
