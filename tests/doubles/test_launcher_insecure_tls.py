"""Issue 38 item 4: ``insecure-skip-tls-verify`` is said once, not by urllib3 on every call.

The API double serves HTTPS with a self-signed certificate (tests/support/k8s_double.py); the
kubeconfig skips verification, as a test or lab cluster's often does. Every poll printed two lines
of ``InsecureRequestWarning``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from support.k8s_double import K8sDouble


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_an_unverified_api_server_is_one_warning_line_not_two_per_call(tmp_path: Path) -> None:
    d = K8sDouble().use_tls(*_self_signed(tmp_path)).serve()
    try:
        kubeconfig = d.write_kubeconfig(tmp_path / "kubeconfig")
        name = "insecure"

        def play() -> None:
            d.wait_for_job(name, timeout=120)
            d.start(d.add_pod(name, 0))
            d.set_condition(name, "Running")
            time.sleep(2.0)  # a few polls
            d.set_condition(name, "Succeeded")

        t = threading.Thread(target=play, daemon=True)
        t.start()
        out = subprocess.run(
            [sys.executable, "-m", "kfp_nvrx.components.cli", "launch", "--backend",
             "kubernetes", "--job-api", "pytorchjob", "--kubeconfig", str(kubeconfig), "--name",
             name, "--nodes", "1", "--image", "img:1", "--pvc", "fsx", "--instance-type", "cpu",
             "--config", "tiny", "--set", "train.steps=6", "--poll-interval", "0.2"],
            capture_output=True, text=True, timeout=180)
        t.join(10)
    finally:
        d.close()
    assert out.returncode == 0, out.stderr
    assert "InsecureRequestWarning" not in out.stderr, out.stderr[-2000:]
    said = [line for line in out.stderr.splitlines() if "are not verified" in line]
    assert len(said) == 1 and "insecure-skip-tls-verify" in said[0], out.stderr
    assert len(d.calls("GET")) > 3  # the polls went over TLS
