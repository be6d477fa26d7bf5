"""Issue 38 item 3: after a stop signal everything the launcher still does fits one bound.

KFP gives a cancelled step 30 s before it SIGKILLs the pod. Against an API server (the HTTP
double, :mod:`support.k8s_double`) that trickles its answers to every DELETE and GET once the
stop came, the launcher used its full per-call deadline (120 s) for each of three delete attempts
and then the 20 s wait. Now the delete, its retries and the wait share
:data:`~kfp_nvrx.components.launch.kube.http.STOP_BUDGET_S` from the signal on, and the launch
ends Cancelled (exit 143 from the CLI) with one line naming what did not finish.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.k8s_double import K8sDouble
from support.k8s_launch import SPEC, launch_on, playing

from kfp_nvrx.components.launch.jobspec.resolve import resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.kube.http import STOP_BUDGET_S

#: KFP's termination grace: the bound the budget must stay below, with room for the exit itself.
GRACE_S = 30.0


def _running_then_slow_then_sigterm(d: K8sDouble, name: str) -> None:
    d.start(d.add_pod(name, 0))
    d.set_condition(name, "Running")
    time.sleep(0.3)
    d.trickle = {"DELETE", "GET"}  # from now on the server answers nothing in time
    os.kill(os.getpid(), signal.SIGTERM)  # KFP terminating the run


def test_a_stop_against_a_trickling_server_ends_within_the_budget(double: K8sDouble) -> None:
    spec = JobSpec(**SPEC)
    with playing(double, spec, _running_then_slow_then_sigterm):
        t0 = time.monotonic()
        result = launch_on(double, spec, log=lambda _l: None, handle_signals=True)
        spent = time.monotonic() - t0
    assert result.state == "Cancelled" and result.extra["signal"] == signal.SIGTERM
    assert spent < GRACE_S, spent
    assert f"not finished within the {STOP_BUDGET_S:g} s a stopped launcher has" \
        in result.reason, result.reason
    assert f"deleting PyTorchJob default/{resolve(spec).name}" in result.reason
    assert "\n" not in result.reason
    assert double.calls("DELETE")  # the delete was tried


def test_the_cli_exits_143_with_one_line_naming_what_did_not_finish(double: K8sDouble,
                                                                      tmp_path: Path) -> None:
    kubeconfig = double.write_kubeconfig(tmp_path / "kubeconfig")
    name = "stop-budget"
    argv = [sys.executable, "-m", "kfp_nvrx.components.cli", "launch", "--backend", "kubernetes",
            "--job-api", "pytorchjob", "--kubeconfig", str(kubeconfig), "--name", name,
            "--nodes", "2", "--image", "img:1", "--pvc", "fsx", "--instance-type", "cpu",
            "--config", "tiny", "--set", "train.steps=6", "--poll-interval", "0.2"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        double.wait_for_job(name, timeout=120)
        double.start(double.add_pod(name, 0))
        double.set_condition(name, "Running")
        time.sleep(1.0)
        double.trickle = {"DELETE", "GET"}
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        spent = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, (out, err)
    assert spent < GRACE_S, spent
    cancelled = [line for line in err.splitlines() if line.startswith("kfp-nvrx launch:")]
    assert len(cancelled) == 1 and "not finished within" in cancelled[0], err
    assert f"PyTorchJob default/{name}" in cancelled[0] and "Traceback" not in err, err
