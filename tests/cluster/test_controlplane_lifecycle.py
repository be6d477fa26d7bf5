"""The test cluster's lifecycle: `up` and `down` leave no process and no port behind (the promise
`make cluster-down` makes), and a dead supervisor or component is never a silent half-cluster.

Each test starts a control plane of its own in its own folder (no nodes), not the session's: the
module runs on whichever pytest-xdist worker is free (tests/conftest.py, ``OWN_CLUSTER``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.controlplane import bin_dir
from cluster.procs import alive
from cluster.supervisor import read_state

TESTS = Path(__file__).resolve().parents[1]


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster", *args], cwd=TESTS, text=True,
                          capture_output=True, timeout=timeout)


def _open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.skipif(bin_dir() is None, reason="cluster tests need `make cluster-bins`")
def test_up_and_down_leave_nothing_behind(tmp_path):
    """`up` prints the kubeconfig; `down` stops every component and frees every port."""
    root = tmp_path / "c"
    up = _cli("up", "--dir", str(root), "--nodes", "0")
    assert up.returncode == 0, up.stdout + up.stderr
    state = read_state(root)
    assert f"KUBECONFIG={state['kubeconfig']}" in up.stdout
    pids = [c["pid"] for c in state["components"].values()] + [state["supervisor"]]
    assert all(alive(p) for p in pids)
    again = _cli("up", "--dir", str(root), "--nodes", "0")  # idempotent: one cluster per dir
    assert again.returncode == 0 and "already running" in again.stdout
    down = _cli("down", "--dir", str(root))
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(alive(p) for p in pids)
    assert not [p for p in state["ports"] if _open(p)]


@pytest.mark.skipif(bin_dir() is None, reason="cluster tests need `make cluster-bins`")
def test_supervisor_killed_takes_every_component_with_it(tmp_path):
    """SIGKILL of the supervisor (no cleanup code runs) still leaves no component running."""
    root = tmp_path / "k"
    assert _cli("up", "--dir", str(root), "--nodes", "0").returncode == 0
    state = read_state(root)
    pids = [c["pid"] for c in state["components"].values()]
    os.kill(state["supervisor"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)


@pytest.mark.skipif(bin_dir() is None, reason="cluster tests need `make cluster-bins`")
def test_a_dead_component_is_reported_with_its_log(tmp_path):
    """A controller that dies makes the cluster report which one and its log's tail."""
    root = tmp_path / "d"
    assert _cli("up", "--dir", str(root), "--nodes", "0").returncode == 0
    state = read_state(root)
    os.kill(state["components"]["jobset-controller"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        failed = (read_state(root) or {}).get("failed")
        if failed:
            break
        time.sleep(0.2)
    assert failed and failed.startswith("jobset-controller exited with -9")
    assert "jobset" in failed.split("\n", 1)[1].lower()  # the log's tail comes with it
    _cli("down", "--dir", str(root))
    assert not any(alive(c["pid"]) for c in state["components"].values())
