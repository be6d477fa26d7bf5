"""The control plane reports the versions it was built from, and the README's table says them.

``make cluster-bins`` sets the Kubernetes binaries' version at build time (component-base's
``gitVersion`` and friends, the build date from the module's tag): ``/version`` and ``--version``
tell the pinned ``k8s.io/kubernetes`` version, not ``v0.0.0-master+$Format:%H$``. The README's
"Tested versions" table must name each pinned module's version (issue 31 item 6).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from harness.controlplane import bin_dir

HERE = Path(__file__).resolve().parents[1] / "harness"  # the Go modules that pin the versions
README = HERE.parents[1] / "README.md"


def _pinned(go_mod: Path, module: str) -> str:
    m = re.search(rf"^\s*(?:require\s+)?{re.escape(module)} (v\S+)", go_mod.read_text(), re.M)
    assert m, f"{go_mod} pins no {module}"
    return m[1]


KUBERNETES = _pinned(HERE / "go.mod", "k8s.io/kubernetes")
#: README row text -> the version its go.mod pins (without the leading v, as the table has it).
ROWS = {
    "kube-apiserver, kube-controller-manager, kube-scheduler": KUBERNETES.lstrip("v"),
    "etcd": _pinned(HERE / "go.mod", "go.etcd.io/etcd/server/v3").lstrip("v"),
    "Kubeflow Trainer (TrainJob, TrainingRuntime)":
        _pinned(HERE / "controllers/trainer/go.mod", "github.com/kubeflow/trainer/v2"),
    "JobSet": _pinned(HERE / "controllers/jobset/go.mod", "sigs.k8s.io/jobset"),
    "Kubeflow Training Operator (PyTorchJob)":
        _pinned(HERE / "controllers/training-operator/go.mod",
                "github.com/kubeflow/training-operator"),
    "Kueue": _pinned(HERE / "controllers/kueue/go.mod", "sigs.k8s.io/kueue"),
}


def test_readme_names_every_pinned_version() -> None:
    table = {row[0].strip(): row[1].strip() for row in
             (line.strip("|").split("|") for line in README.read_text().splitlines()
              if line.startswith("| ") and line.count("|") == 3)}
    for piece, version in ROWS.items():
        assert piece in table, f"README's tested-versions table has no row {piece!r}"
        assert table[piece].split()[0] == version, (piece, table[piece], version)


@pytest.mark.skipif(bin_dir() is None, reason="cluster tests need `make cluster-bins`")
@pytest.mark.parametrize("binary", ["kube-apiserver", "kube-controller-manager",
                                    "kube-scheduler"])
def test_each_kubernetes_binary_says_its_version(binary: str) -> None:
    out = subprocess.run([str(bin_dir() / binary), "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Kubernetes", KUBERNETES], out.stdout


def test_apiserver_version_is_the_pinned_one(kube) -> None:
    info = kube.client().call_api("/version", "GET", response_type="object",
                                  _return_http_data_only=True)
    major, minor = KUBERNETES.lstrip("v").split(".")[:2]
    assert info["gitVersion"] == KUBERNETES
    assert (info["major"], info["minor"]) == (major, minor)
    assert info["gitTreeState"] == "clean" and "$Format" not in info["gitCommit"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", info["buildDate"])
    assert info["buildDate"] != "1970-01-01T00:00:00Z"
