"""The part of the kubelet API the API server calls: ``/containerLogs`` (``kubectl logs``,
``read_namespaced_pod_log``) and ``/healthz``, over HTTPS on 127.0.0.1.

The API server reaches it through each Node's ``status.daemonEndpoints.kubeletEndpoint.port`` at
the node's ``InternalIP``; without ``--kubelet-certificate-authority`` it does not verify the
serving certificate, which is still one from the run's CA. One server answers for every test node
(the path names the pod).
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import parse_qs, urlparse

if TYPE_CHECKING:
    from .agent import Agent


class KubeletServer:
    """Serve container logs of the agent's pods.

    Args:
        agent: The node agent (finds a pod's runner by namespace and name).
        cert: Serving certificate file.
        key: Its key.
    """

    def __init__(self, agent: Agent, cert: str, key: str) -> None:
        self.agent = agent
        handler = type("Handler", (_Handler,), {"agent": agent})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                       name="kubelet-api")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    agent: Agent

    def log_message(self, *args) -> None:  # quiet: the API server polls
        pass

    def _fail(self, code: int, msg: str) -> None:
        body = msg.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlparse(self.path)
        if url.path in ("/healthz", "/readyz", "/livez"):
            return self._fail(200, "ok")
        parts = url.path.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "containerLogs":
            return self._fail(404, f"not served by the test node agent: {url.path}")
        _, ns, name, container = parts
        lq = _LogQuery.parse(url.query)
        runner = self.agent.runner(ns, name)
        c = runner.container(container) if runner else None
        if c is None:
            return self._fail(404, f"container {container} of pod {ns}/{name} not found")
        restart, path = _log_file(runner, c, container, lq.previous)
        if restart < 0 or not path.is_file():
            what = "previous terminated" if lq.previous else "current"
            return self._fail(400, f"{what} container {container} in pod {name} not found")
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()  # HTTP/1.0: the body ends when the stream closes
        with open(path, "rb") as f:
            sent = 0
            if lq.tail is not None:
                sent = self._send_tail(f, lq)
                if not lq.follow:
                    return
            self._send_rest(f, lq, lambda: _instance_over(lq, c, restart), sent)

    def _send_tail(self, f: BinaryIO, lq: _LogQuery) -> int:
        """Write the last ``tailLines`` lines (within ``limitBytes``); how many bytes they were."""
        assert lq.tail is not None
        lines = f.read().splitlines(keepends=True)[-lq.tail:] if lq.tail > 0 else []
        chunk = b"".join(lines)
        self.wfile.write(chunk[:lq.limit] if lq.limit is not None else chunk)
        return len(chunk)

    def _send_rest(self, f: BinaryIO, lq: _LogQuery, over: Callable[[], bool], sent: int) -> None:
        """Write the log from where ``f`` is, following it until ``over()`` when asked to."""
        while True:
            data = f.read(64 * 1024)
            if data:
                if lq.limit is not None:
                    data = data[:max(0, lq.limit - sent)]
                if not self._write(data):
                    return  # the client went away
                sent += len(data)
                if lq.limit is not None and sent >= lq.limit:
                    return
                continue
            # End of file: a follow stream ends once this container instance is over.
            if over():
                rest = f.read()
                if rest:
                    self.wfile.write(rest)
                return
            time.sleep(0.2)

    def _write(self, data: bytes) -> bool:
        """Write and flush ``data``; False when the client has gone away."""
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class _LogQuery:
    """The ``containerLogs`` query parameters this server honours."""

    previous: bool
    follow: bool
    limit: int | None
    tail: int | None

    @classmethod
    def parse(cls, query: str) -> _LogQuery:
        q = {k: v[-1] for k, v in parse_qs(query).items()}
        previous = q.get("previous") == "true"
        return cls(previous=previous, follow=q.get("follow") == "true" and not previous,
                   limit=int(q["limitBytes"]) if q.get("limitBytes") else None,
                   tail=int(q["tailLines"]) if q.get("tailLines") else None)


def _log_file(runner: Any, c: Any, container: str, previous: bool) -> tuple[int, Path]:
    """Which instance's log to serve (its restart number) and its file."""
    restart = c.restarts - 1 if previous else c.restarts
    path = runner.log_path(container, restart)
    if not previous and restart > 0 and not path.is_file():
        # Waiting to restart (back-off): the current log is the instance that just ended.
        restart -= 1
        path = runner.log_path(container, restart)
    return restart, path


def _instance_over(lq: _LogQuery, c: Any, restart: int) -> bool:
    """Whether the stream ends at end of file: not following, or that instance has ended."""
    return not lq.follow or c.restarts != restart or "running" not in c.state
