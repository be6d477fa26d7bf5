"""``kfp-nvrx launch --backend kubernetes`` as a real process against the API test double.

The process reads a kubeconfig that points at tests/support/k8s_double.py (a TEST DOUBLE, not a cluster);
SIGTERM is a real signal to a real process, the way KFP terminates a run's launcher pod.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from support.k8s_double import K8sDouble

from kfp_nvrx.components.launch.jobspec import naming

ARGS = ["--job-api", "pytorchjob", "--instance-type", "cpu", "--image", "img:1", "--pvc", "fsx",
        "--nodes", "1",
        "--run-id", "run-cli", "--task", "train", "--set", "train.steps=6",
        "--poll-interval", "0.1"]
NAME = naming.derive_name("run-cli", "train")


def _launch(tmp_path: Path, double: K8sDouble, *extra: str) -> subprocess.Popen:
    kubeconfig = double.write_kubeconfig(tmp_path / "kubeconfig", namespace="team-a")
    cmd = [sys.executable, "-m", "kfp_nvrx.components.cli", "launch", "--backend", "kubernetes",
           "--kubeconfig", str(kubeconfig), *ARGS, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_follows_to_success_in_the_kubeconfig_namespace(tmp_path, double) -> None:
    result_file = tmp_path / "result.json"

    def operator() -> None:
        double.wait_for_job(NAME, ns="team-a", timeout=60)
        w0 = double.add_pod(NAME, 0, ns="team-a")
        double.start(w0, ns="team-a")
        double.set_condition(NAME, "Running", ns="team-a")
        double.log(w0, "[trainer] step 6/6 loss 3.1", ns="team-a")
        time.sleep(0.5)
        double.terminate(w0, 0, ns="team-a")
        double.set_condition(NAME, "Succeeded", ns="team-a")

    threading.Thread(target=operator, daemon=True).start()
    proc = _launch(tmp_path, double, "--result", str(result_file))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "[worker-0] [trainer] step 6/6 loss 3.1" in out
    assert f"Succeeded: {NAME} (kubernetes)" in out
    result = json.loads(result_file.read_text())
    assert result["state"] == "Succeeded" and result["extra"]["namespace"] == "team-a"
    assert double.calls("DELETE")  # delete_after=on_success


def test_cli_sigterm_deletes_the_job_and_exits_143(tmp_path, double) -> None:
    proc = _launch(tmp_path, double)
    double.wait_for_job(NAME, ns="team-a", timeout=60)
    w0 = double.add_pod(NAME, 0, ns="team-a")
    double.start(w0, ns="team-a")
    double.set_condition(NAME, "Running", ns="team-a")
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM received" in out and "Cancelled" in err
    deletes = double.calls("DELETE")
    assert len(deletes) == 1 and deletes[0]["body"]["propagationPolicy"] == "Foreground"
    assert ("team-a", NAME) not in double.jobs


def test_cli_cluster_errors_are_one_line(tmp_path, double) -> None:
    double.fail_next["POST"] = (403, "Forbidden")
    proc = _launch(tmp_path, double)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.strip().count("\n") == 0 and "cluster error" in err and "403" in err
    missing = tmp_path / "missing" / "kubeconfig"
    proc = subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "launch", "--backend",
                           "kubernetes", "--kubeconfig", str(missing), *ARGS],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "cannot load Kubernetes credentials" in proc.stderr


def test_cli_bad_input_exit_2_before_credentials(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "launch", "--backend",
                           "kubernetes", "--kubeconfig", str(tmp_path / "nope"), *ARGS,
                           "--nodes", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "error: --nodes:" in proc.stderr
