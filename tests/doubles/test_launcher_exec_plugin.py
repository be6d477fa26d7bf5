"""Issue 38 item 4: a kubeconfig ``exec`` credential plugin never outlives its launcher.

The plugin (here a stand-in that records its pid and hangs, as an SSO helper waiting for a login
does) is run by the ``kubernetes`` client while it loads the credentials; a SIGTERM to the
launcher then left it running. The launcher is the real CLI; the API double is never reached.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from support.k8s_double import K8sDouble


def test_a_sigterm_while_the_exec_plugin_runs_stops_the_plugin_too(double: K8sDouble,
                                                                   tmp_path: Path) -> None:
    pid_file = tmp_path / "plugin.pid"
    plugin = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
              "time.sleep(600)")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": double.url}}],
        "users": [{"name": "u", "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1", "command": sys.executable,
            "args": ["-c", plugin], "interactiveMode": "Never"}}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kfp_nvrx.components.cli", "launch", "--backend", "kubernetes",
         "--job-api", "pytorchjob", "--kubeconfig", str(kubeconfig), "--name", "exec-plugin",
         "--nodes", "1", "--image", "img:1", "--pvc", "fsx", "--instance-type", "cpu",
         "--config", "tiny"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        plugin_pid = int(pid_file.read_text())
        assert psutil.pid_exists(plugin_pid)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    deadline = time.monotonic() + 10
    while _running(plugin_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _running(plugin_pid)
    if alive:
        os.kill(plugin_pid, signal.SIGKILL)
    assert not alive, "the exec plugin outlived the launcher"
    assert double.calls("POST") == []


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
