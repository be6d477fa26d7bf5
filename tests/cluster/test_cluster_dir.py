"""The test cluster's folder belongs to one live cluster and starts clean (issue 30 item 9).

Every checkout of a user shares the default ``CLUSTER_DIR``: a second ``make cluster-up`` from
another checkout took over the first cluster's folder, reused its etcd data and its node agent's
control files (a "lost" node marker carried over) and re-ran its pods; ``cluster-down`` left the
etcd data behind; the stop hint did not name the folder. Control plane only (``--nodes 0``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness.controlplane import bin_dir

pytestmark = [pytest.mark.timeout(600)]
TESTS = Path(__file__).resolve().parents[1]


def _cli(cmd: str, root: Path, cwd: Path = TESTS) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", cmd, "--dir", str(root), "--nodes",
                           "0"], cwd=cwd, capture_output=True, text=True, timeout=400)


def _other_checkout(tmp: Path) -> Path:
    """A copy of the cluster harness elsewhere: another checkout of the same user."""
    other = tmp / "other-checkout" / "tests"
    shutil.copytree(TESTS / "harness", other / "harness",
                    ignore=shutil.ignore_patterns("__pycache__", "controllers"))
    return other


def _configmaps(root: Path) -> list[str]:
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(config_file=str(root / "kubeconfig")))
    return [c.metadata.name for c in api.list_namespaced_config_map("default").items]


def test_one_live_cluster_owns_its_folder_and_each_starts_clean(tmp_path):
    if bin_dir() is None:
        pytest.skip("no control-plane binaries (make cluster-bins)")
    from kubernetes import client, config

    root = tmp_path / "cluster"
    up = _cli("up", root)
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"CLUSTER_DIR={root}" in up.stdout  # the stop hint names the folder
    try:
        pid = __import__("json").loads((root / "owner.json").read_text())["pid"]
        other = _other_checkout(tmp_path)
        for cmd in ("up", "down"):  # another checkout neither takes it over nor stops it
            out = _cli(cmd, root, cwd=other)
            assert out.returncode == 2, out.stdout + out.stderr
            assert f"supervisor pid {pid}" in out.stderr and str(TESTS.parent) in out.stderr
        api = client.CoreV1Api(config.new_client_from_config(config_file=str(root /
                                                                             "kubeconfig")))
        api.create_namespaced_config_map("default", client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="from-the-first-cluster")))
    finally:
        down = _cli("down", root)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (root / "etcd").exists()  # no later cluster brings its objects back
    control = root / "agent" / "control"
    control.mkdir(parents=True, exist_ok=True)
    (control / "kfp-nvrx-node-0").write_text("lost")  # what an earlier drill left
    up = _cli("up", root)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "from-the-first-cluster" not in _configmaps(root)
        assert not (control / "kfp-nvrx-node-0").exists()
    finally:
        assert _cli("down", root).returncode == 0
    assert os.listdir(root / "logs")  # its logs stay for reading
