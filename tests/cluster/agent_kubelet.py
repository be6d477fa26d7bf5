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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
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
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        runner = self.agent.runner(ns, name)
        c = runner.container(container) if runner else None
        if c is None:
            return self._fail(404, f"container {container} of pod {ns}/{name} not found")
        previous = q.get("previous") == "true"
        restart = c.restarts - 1 if previous else c.restarts
        path = runner.log_path(container, restart)
        if not previous and restart > 0 and not path.is_file():
            # Waiting to restart (back-off): the current log is the instance that just ended.
            restart -= 1
            path = runner.log_path(container, restart)
        if restart < 0 or not path.is_file():
            what = "previous terminated" if previous else "current"
            return self._fail(400, f"{what} container {container} in pod {name} not found")
        follow = q.get("follow") == "true" and not previous
        limit = int(q["limitBytes"]) if q.get("limitBytes") else None
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()  # HTTP/1.0: the body ends when the stream closes
        sent = 0
        with open(path, "rb") as f:
            if q.get("tailLines"):
                data = f.read()
                lines = data.splitlines(keepends=True)[-int(q["tailLines"]):] if int(
                    q["tailLines"]) > 0 else []
                chunk = b"".join(lines)
                self.wfile.write(chunk[:limit] if limit is not None else chunk)
                if not follow:
                    return
                sent = len(chunk)
            while True:
                data = f.read(64 * 1024)
                if data:
                    if limit is not None:
                        data = data[:max(0, limit - sent)]
                    try:
                        self.wfile.write(data)
                        self.wfile.flush()
                    except OSError:
                        return  # the client went away
                    sent += len(data)
                    if limit is not None and sent >= limit:
                        return
                    continue
                # End of file: a follow stream ends once this container instance is over.
                if not follow or c.restarts != restart or "running" not in c.state:
                    rest = f.read()
                    if rest:
                        self.wfile.write(rest)
                    return
                time.sleep(0.2)
