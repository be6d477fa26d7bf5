"""What ``kfp-nvrx launch --backend kubernetes`` says when the thing at the kubeconfig's server
is not a working Kubernetes API (issue 23, item 7): one line naming the host, exit 1, no
traceback, no urllib3 ``WARNING`` lines, no credential.

The server here is a TEST DOUBLE standing in for what sits in front of a real API server in the
field (an SSO proxy's login page, a redirect to it, a port speaking something else); a real proxy
cannot run on this machine. The unreachable case needs no double: a closed port.
And the pod watch's backoff: a proxy that ends every watch at once must not turn following a
Pending job into a LIST+WATCH loop.
"""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from kfp_nvrx.components.launch.kube.logs import PodLogFollower
from kfp_nvrx.components.launch.pytorchjob.follow import job_pods

TOKEN = "sso-9f8e7d6c5b4a"  # noqa: S105 - a test credential that must never be printed
LOGIN = (b"<!DOCTYPE html><html><head><title>Sign in</title></head><body><form action=/login>"
         b"<input name=user></form></body></html>")
ARGS = ["--instance-type", "cpu", "--image", "img:1", "--pvc", "fsx", "--nodes", "1",
        "--run-id", "run-err", "--task", "train", "--namespace", "team-a"]


class _Proxy(http.server.BaseHTTPRequestHandler):
    """Answers every request the way one kind of broken front end does (``server.mode``)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        mode = self.server.mode  # type: ignore[attr-defined]
        self.server.requests.append(self.path)  # type: ignore[attr-defined]
        if mode == "redirect" and not self.path.startswith("/login"):
            return self._send(302, b"", "text/html", {"Location": "/login?next=" + self.path})
        if mode in ("html", "redirect"):
            return self._send(200, LOGIN, "text/html; charset=utf-8")
        if mode == "html403":
            return self._send(403, LOGIN, "text/html")
        if mode == "binary":
            return self._send(200, b"\xff\xfe\x00\x81binary\xc3\x28", "application/octet-stream")
        if mode == "hang":  # accepts, reads the request, never answers (a dead LB backend)
            time.sleep(5.0)
            return None
        if mode == "watch-ends":  # lists fine; every watch closes at once with no event
            if "watch=" in self.path:
                return self._send(200, b"", "application/json")
            body = {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"},
                    "items": []}
            return self._send(200, json.dumps(body).encode(), "application/json")
        return None

    do_POST = do_DELETE = do_GET  # noqa: N815

    def _send(self, code: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args) -> None:
        pass


@pytest.fixture()
def proxy() -> Iterator[http.server.ThreadingHTTPServer]:
    """The double on a free port of 127.0.0.1."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    server.mode, server.requests = "html", []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _kubeconfig(tmp_path: Path, server: str) -> Path:
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "clusters": [{"name": "c", "cluster": {"server": server}}],
           "users": [{"name": "u", "user": {"token": TOKEN}}],
           "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(tmp_path: Path, server: str, job_api: str) -> tuple[int, str, str]:
    cmd = [sys.executable, "-m", "kfp_nvrx.components.cli", "launch", "--backend", "kubernetes",
           "--job-api", job_api, "--kubeconfig", str(_kubeconfig(tmp_path, server)), *ARGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def _one_line(rc: int, out: str, err: str, host: str, says: str) -> None:
    assert rc == 1, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kfp-nvrx launch: cluster error: ")
    assert host in lines[0] and says in lines[0], lines[0]
    assert "Traceback" not in err + out and "WARNING" not in err + out
    assert TOKEN not in err + out and "<html" not in err.lower()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens


@pytest.mark.parametrize("job_api", ["pytorchjob", "trainjob", "auto"])
def test_unreachable_api_server_is_one_line_without_retry_warnings(tmp_path, job_api) -> None:
    host = f"https://127.0.0.1:{_closed_port()}"
    rc, out, err = _launch(tmp_path, host, job_api)
    _one_line(rc, out, err, host, "cannot reach the Kubernetes API server at")
    assert "Connection refused" in err and "object at 0x" not in err


@pytest.mark.parametrize(("mode", "job_api", "says"), [
    ("html", "pytorchjob", "answered with an HTML page, not the Kubernetes API"),
    ("html", "trainjob", "answered with an HTML page, not the Kubernetes API"),
    ("redirect", "pytorchjob", "redirecting to /login?next=/apis/kubeflow.org/v1/namespaces"),
    ("html", "auto", "asking the API server for trainer.kubeflow.org/v1alpha1"),
    ("html403", "trainjob", "answered HTTP 403 Forbidden. RBAC forbids it (see docs/eks.md). "
                            "(an HTML page: a login page or a proxy"),
    ("binary", "pytorchjob", "answered with bytes that are not UTF-8"),
    ("binary", "auto", "answered with bytes that are not UTF-8"),
])
def test_proxy_answers_are_one_line_naming_the_host(tmp_path, proxy, mode, job_api,
                                                    says) -> None:
    proxy.mode = mode
    host = f"http://127.0.0.1:{proxy.server_address[1]}"
    rc, out, err = _launch(tmp_path, host, job_api)
    _one_line(rc, out, err, host, says)
    assert proxy.requests  # it did ask the double


def test_watch_that_ends_at_once_backs_off(proxy) -> None:
    """Followed for 4 s, a watch closed at once costs a handful of requests, not a loop.

    Before the backoff every loop turn was a LIST and a WATCH with no pause (hundreds of
    requests in 4 s against this double; about 23 per second against a remote API server).
    """
    proxy.mode = "watch-ends"
    cfg = client.Configuration(host=f"http://127.0.0.1:{proxy.server_address[1]}")
    follower = PodLogFollower(client.CoreV1Api(client.ApiClient(cfg)), "team-a", job_pods("job"),
                              emit=lambda _: None, watch_timeout_s=30)
    follower.start()
    time.sleep(4.0)
    follower.stop(drain_s=0)
    lists = sum("watch=" not in p for p in proxy.requests)
    watches = len(proxy.requests) - lists
    # 0.8 + 1.6 + 3.2 s of pauses fit in 4 s: at most 4 watches, and one LIST (no relisting).
    assert lists == 1 and 1 <= watches <= 4, proxy.requests
    assert follower.requests["watch"] == watches


def test_a_server_that_never_answers_is_a_one_line_timeout(proxy, monkeypatch) -> None:
    """Every call has a read timeout: a silent server must not hold the launcher forever."""
    from kfp_nvrx.components.launch.backends import launch
    from kfp_nvrx.components.launch.jobspec.resolve import resolve
    from kfp_nvrx.components.launch.jobspec.spec import JobSpec
    from kfp_nvrx.components.launch.kube import calls
    from kfp_nvrx.components.launch.kube.calls import ClusterError
    from kfp_nvrx.components.launch.kube.cluster import Cluster
    from kfp_nvrx.components.launch.options import FollowOptions, KubernetesOptions

    proxy.mode = "hang"
    monkeypatch.setattr(calls, "REQUEST_TIMEOUT", (1.0, 1.0))
    host = f"http://127.0.0.1:{proxy.server_address[1]}"
    spec = JobSpec(image="img:1", pvc="fsx", instance_type="cpu", nodes="1", run_id="run-hang",
                   task="train", namespace="team-a")
    opts = KubernetesOptions(job_api="pytorchjob", cluster=Cluster(client.Configuration(host)),
                             follow=FollowOptions(handle_signals=False))
    with pytest.raises(ClusterError) as err:
        launch(resolve(spec), opts, log=lambda _: None)
    text = str(err.value)
    assert f"cannot reach the Kubernetes API server at {host}" in text and "timed out" in text
    assert "\n" not in text
