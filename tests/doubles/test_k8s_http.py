"""Every Kubernetes API call is bounded in time and size, never redirected, cut by SIGTERM.

Against :mod:`hostile_http` (a server that misbehaves on purpose), through the real
``kubernetes`` client as the launcher builds it (:func:`.kube.cluster.api_client`). Issue 30 item 12:
each of these once held the launcher forever, read gigabytes, or re-sent a job's POST body to
wherever a 307 pointed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from kubernetes import client as k8s
from kubernetes.watch.watch import iter_resp_lines
from support.hostile_http import HostileServer

from kfp_nvrx.components.launch.kube import calls, http
from kfp_nvrx.components.launch.kube.cluster import Cluster, api_client
from kfp_nvrx.components.launch.kube.http import StopSignals


@pytest.fixture
def server() -> Iterator[HostileServer]:
    with HostileServer() as srv:
        yield srv


def _api(server: HostileServer) -> k8s.ApiClient:
    cfg = k8s.Configuration()
    cfg.host = server.url
    return api_client(cfg)


def _get(api: k8s.ApiClient, path: str, method: str = "GET", **kw: object) -> object:
    return calls.call(f"reading {path}", api.configuration.host, api.call_api, path, method,
                        response_type="object", _return_http_data_only=True, **kw)


def test_a_trickling_body_or_header_ends_at_the_call_deadline(
        server: HostileServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte every 0.3 s never tripped the 60 s read timeout: the call never ended."""
    monkeypatch.setattr(http, "CALL_DEADLINE_S", 1.5)
    api = _api(server)
    for path in ("/trickle", "/trickle-headers"):
        started = time.monotonic()
        with pytest.raises(calls.ClusterError) as err:
            _get(api, path)
        assert time.monotonic() - started < 6, path
        assert "within 1.5 s" in str(err.value) and "\n" not in str(err.value)


def test_sigterm_cuts_a_trickling_call_short(server: HostileServer) -> None:
    """The launcher's handler only set a flag; the blocked read went on (the job never deleted)."""
    api = _api(server)
    killer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    started = time.monotonic()
    with StopSignals(True) as signals, pytest.raises(calls.Interrupted) as err:
        killer.start()
        _get(api, "/trickle")
    assert signals.event.is_set() and time.monotonic() - started < 5
    assert "interrupted by a stop signal" in str(err.value)
    assert _get(api, "/target")["kind"] == "Thing"  # later calls (the delete) are not affected


def test_a_huge_body_is_refused_at_the_bound(server: HostileServer,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "MAX_BODY_BYTES", 4 << 20)
    with pytest.raises(calls.ClusterError) as err:
        _get(_api(server), "/huge")
    assert "more than 4 MiB" in str(err.value)


def test_a_429_is_retried_briefly_not_slept_on_for_its_retry_after(
        server: HostileServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retry-After: 3600 made urllib3 sleep an hour inside the call, deaf to SIGTERM."""
    monkeypatch.setattr(calls, "THROTTLE_WAIT_MAX_S", 0.2)
    api = _api(server)
    server.throttled = 2
    started = time.monotonic()
    assert _get(api, "/throttle")["kind"] == "Thing"  # the third answer is the object
    assert time.monotonic() - started < 5
    server.throttled = 10**9
    with pytest.raises(calls.ClusterError) as err:
        _get(api, "/throttle")
    assert "HTTP 429" in str(err.value) and "slow down" in str(err.value)
    assert server.requests.count(("GET", "/throttle")) == 3 + calls.THROTTLE_RETRIES + 1


def test_sigterm_cuts_a_throttled_wait_short(server: HostileServer) -> None:
    api = _api(server)
    killer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    started = time.monotonic()
    with StopSignals(True), pytest.raises(calls.Interrupted):
        killer.start()
        _get(api, "/throttle")  # the default wait: up to 10 s, three times
    assert time.monotonic() - started < 3


def test_a_redirect_is_refused_and_the_post_body_never_re_sent(server: HostileServer) -> None:
    api = _api(server)
    with pytest.raises(calls.ClusterError) as err:
        _get(api, "/redirect", method="POST", body={"kind": "PyTorchJob", "spec": "secret"})
    assert "HTTP 307" in str(err.value) and "not followed" in str(err.value)
    assert f"{server.url}/target" in str(err.value)
    assert ("POST", "/target") not in server.requests and ("GET", "/target") not in server.requests


def test_a_streamed_line_without_a_newline_is_cut_not_held(server: HostileServer,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod log line with no newline grew without end in the launcher (930 MB)."""
    monkeypatch.setattr(http, "MAX_LINE_BYTES", 1 << 20)
    resp = _api(server).call_api("/log", "GET", _preload_content=False,
                                 _return_http_data_only=True)
    lines = list(iter_resp_lines(resp))
    assert len(lines) == 2 and lines[1] == "next line", [len(x) for x in lines]
    assert lines[0].startswith("xxx") and lines[0].endswith("longer than 2 MiB]")
    assert len(lines[0]) <= (1 << 20) + len(http.CUT_MARK)


def test_cut_lines_keeps_short_lines_and_cuts_across_chunks() -> None:
    chunks = [b"ab\ncdef", b"gh\n", b"ij", b"klmnop", b"q\nrs"]
    out = b"".join(http.cut_lines(iter(chunks), limit=4))
    mark = http.CUT_MARK
    assert out == b"ab\ncdef" + mark + b"\nijkl" + mark + b"\nrs"


def test_every_client_the_launcher_makes_is_bounded() -> None:
    cfg = k8s.Configuration()
    cfg.host = "http://127.0.0.1:9"
    assert isinstance(api_client(cfg).rest_client.pool_manager, http.BoundedPool)
    # Every job API's calls and the pods' logs go through the connection's one client.
    assert isinstance(Cluster(cfg, "default").client().rest_client.pool_manager,
                      http.BoundedPool)


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_a_failed_read_right_after_the_create_deletes_the_job(
        double, monkeypatch: pytest.MonkeyPatch, api: str) -> None:
    """The launcher exited 1 and left the job it had just created running (its GPUs busy)."""
    from support.k8s_launch import SPEC, launch_on

    from kfp_nvrx.components.launch.jobspec.spec import JobSpec
    from kfp_nvrx.components.launch.kube.followed import FollowedJob

    real_get = FollowedJob.get  # the one custom-object client of every job API

    def get(self):  # the read right after the POST fails; every other read works
        if double.calls("POST") and not getattr(self, "_failed_once", False):
            self._failed_once = True
            raise calls.ClusterError(f"reading {self.where}: connection reset")
        return real_get(self)

    monkeypatch.setattr(FollowedJob, "get", get)
    spec, lines = JobSpec(**SPEC), []
    with pytest.raises(calls.ClusterError, match="connection reset"):
        launch_on(double, spec, api, log=lines.append)
    assert len(double.calls("POST")) == 1 and len(double.calls("DELETE")) == 1
    assert double.jobs == {}
    assert any("deleting" in line and "which this launcher created" in line for line in lines)


def test_a_kubeconfig_or_a_file_it_names_that_is_no_regular_file_is_refused_unread(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A FIFO kubeconfig hung the launcher; a tokenFile of /dev/zero was read whole (30.12)."""
    from kfp_nvrx.components.errors import UserError
    from kfp_nvrx.components.launch.kube.kubeconfig import check_kubeconfig
    from kfp_nvrx.components.redaction import register_kubeconfig

    os.mkfifo(tmp_path / "fifo")
    config = ("apiVersion: v1\nkind: Config\nusers: [{name: u, user: {%s: %s}}]\n"
              "clusters: [{name: c, cluster: {certificate-authority: ca.pem}}]\n")
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    cases = {"fifo": None, "zero": ("tokenFile", "/dev/zero"), "key": ("client-key", "fifo")}
    for name, user in cases.items():
        path = tmp_path / "fifo" if user is None else tmp_path / f"{name}.yaml"
        if user is not None:
            path.write_text(config % user)
        with pytest.raises(UserError) as err:
            check_kubeconfig(str(path), "--kubeconfig")
        assert err.value.field == "--kubeconfig", err.value
        assert ("FIFO" if name != "zero" else "character device") in err.value.message
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}{os.pathsep}{tmp_path / 'fifo'}")
    with pytest.raises(UserError):
        check_kubeconfig(None)
    register_kubeconfig(None)  # the redaction reads it first: a FIFO is skipped, not waited on
    (tmp_path / "ok.yaml").write_text(config % ("tokenFile", "missing-token"))
    check_kubeconfig(str(tmp_path / "ok.yaml"))  # a named file that is missing: the loader's
