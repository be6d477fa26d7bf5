"""The session's test cluster: one real control plane shared by every test in tests/cluster.

Started on first use by the same supervisor ``make cluster-up`` runs, stopped at session end. A
component that dies makes the next test that uses the cluster fail with that component's log
tail. Without the binaries the cluster tests are skipped with one line naming
``make cluster-bins`` — unless ``KFP_NVRX_REQUIRE_CLUSTER=1`` (CI), where that is a failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness.controlplane import USER_NAMESPACE, bin_dir
from harness.procs import alive, tail
from harness.supervisor import read_state

TESTS = Path(__file__).resolve().parents[1]
NO_BINS = "cluster tests need the control-plane binaries: run `make cluster-bins` (Go 1.26)"


@dataclass
class Cluster:
    """A running test cluster, as the tests see it."""

    root: Path
    kubeconfig: Path
    namespace: str
    state: dict

    def check(self) -> None:
        """Fail the calling test if a component died (with its log tail)."""
        state = read_state(self.root) or {}
        if state.get("failed"):
            pytest.fail(f"test cluster broke: {state['failed']}", pytrace=False)
        if state.get("components"):  # a restarted component has a new pid (SIGUSR1: apiserver)
            self.state = state
        for name, c in self.state["components"].items():
            if not alive(c["pid"]):
                pytest.fail(f"test cluster component {name} died; log {c['log']}:\n"
                            f"{tail(Path(c['log']))}", pytrace=False)

    def client(self):
        """A kubernetes ApiClient with the admin credentials."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def dynamic(self):
        """A kubernetes DynamicClient with the admin credentials."""
        from kubernetes import dynamic

        return dynamic.DynamicClient(self.client())


def _nodes() -> int:
    return int(os.environ.get("KFP_NVRX_TEST_NODES", "2"))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Cluster:
    """Start the session's cluster (or skip/fail without binaries)."""
    if bin_dir() is None:
        if os.environ.get("KFP_NVRX_REQUIRE_CLUSTER") == "1":
            pytest.fail(NO_BINS + " (KFP_NVRX_REQUIRE_CLUSTER=1: required here)", pytrace=False)
        pytest.skip(NO_BINS)
    root = tmp_path_factory.mktemp("cluster")
    log = open(root / "supervisor.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "harness", "serve", "--dir", str(root),
                             "--nodes", str(_nodes())], cwd=TESTS, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    state = None
    while time.monotonic() < deadline:
        state = read_state(root)
        if state and (state.get("ready") or state.get("failed")):
            break
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    if not state or not state.get("ready"):
        proc.kill()
        pytest.fail(f"test cluster did not start:\n{tail(root / 'supervisor.log', 40)}",
                    pytrace=False)
    c = Cluster(root, Path(state["kubeconfig"]), USER_NAMESPACE, state)
    yield c
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture()
def kube(cluster: Cluster) -> Cluster:
    """The cluster, checked healthy before and after the test."""
    cluster.check()
    yield cluster
    cluster.check()
