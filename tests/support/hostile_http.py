"""TEST DOUBLE: an HTTP server that misbehaves on purpose (raw sockets, one thread per client).

Not a Kubernetes API server: each path answers one way a broken or hostile server (or a proxy in
front of one) can, to show that the launcher's client bounds every call (issue 30.12):

* ``/trickle`` - a 200 whose body arrives one byte every :attr:`HostileServer.trickle_s`;
* ``/trickle-headers`` - the status line, then header bytes one at a time;
* ``/huge`` - a 200 with a 1 GiB ``Content-Length`` sent as fast as the client reads;
* ``/throttle`` - a 429 with ``Retry-After: 3600`` (then a 200 once :attr:`throttled` runs out);
* ``/redirect`` - a 307 to ``/target`` on this server (a client that follows it re-sends there);
* ``/log`` - a chunked stream: 5 MiB without a newline, then ``next line\\n``.

Every request's method and path is recorded in :attr:`HostileServer.requests`.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

OBJECT = json.dumps({"kind": "Thing", "apiVersion": "v1", "metadata": {"name": "x"}}).encode()


class HostileServer:
    """The server; ``with HostileServer() as srv: srv.url``."""

    def __init__(self, trickle_s: float = 0.3) -> None:
        self.trickle_s = trickle_s
        self.requests: list[tuple[str, str]] = []
        self.throttled = 10**9  # 429s still to send on /throttle
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        """Base URL."""
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HostileServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._closed.set()
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _read_request(self, conn: socket.socket) -> tuple[str, str] | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path = lines[0].split(" ")[:2]
        length = next((int(h.split(":", 1)[1]) for h in lines[1:]
                       if h.lower().startswith("content-length:")), 0)
        while len(rest) < length:
            rest += conn.recv(65536)
        self.requests.append((method, path.split("?")[0]))
        return method, path.split("?")[0]

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                req = self._read_request(conn)
                if req is None:
                    return
                getattr(self, "_" + req[1].strip("/").replace("-", "_"), self._target)(conn)
        except OSError:
            pass  # the client hung up: that is what a bounded client does
        finally:
            conn.close()

    @staticmethod
    def _send(conn: socket.socket, status: str, body: bytes, *headers: str) -> None:
        head = [f"HTTP/1.1 {status}", "Content-Type: application/json",
                f"Content-Length: {len(body)}", *headers]
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)

    def _target(self, conn: socket.socket) -> None:
        self._send(conn, "200 OK", OBJECT)

    def _trickle(self, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n")
        while not self._closed.is_set():
            conn.sendall(b" ")
            time.sleep(self.trickle_s)

    def _trickle_headers(self, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        while not self._closed.is_set():
            conn.sendall(b"X")
            time.sleep(self.trickle_s)

    def _huge(self, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1073741824\r\n\r\n")
        block = b" " * (1 << 20)
        for _ in range(1024):
            conn.sendall(block)

    def _throttle(self, conn: socket.socket) -> None:
        if self.throttled > 0:
            self.throttled -= 1
            self._send(conn, "429 Too Many Requests", b'{"kind": "Status", "message": "slow down"}',
                       "Retry-After: 3600")
        else:
            self._send(conn, "200 OK", OBJECT)

    def _redirect(self, conn: socket.socket) -> None:
        self._send(conn, "307 Temporary Redirect", b"", f"Location: {self.url}/target")

    def _log(self, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        block = b"x" * (1 << 20)
        for _ in range(5):
            conn.sendall(b"%x\r\n%s\r\n" % (len(block), block))
        tail = b"\nnext line\n"
        conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
