"""TEST DOUBLE of the Kubeflow Pipelines v2beta1 REST API -- not a real KFP server.

No KFP API server can run on the CI machines, so ``kfp-nvrx submit``/``schedule`` are tested
against this in-process HTTP server. It implements only the endpoints ``kfp.Client`` calls for
them, with the request/response shapes of the KFP v2beta1 API (``kfp_server_api`` models):

- ``GET  /apis/v2beta1/healthz``        -> ``{"multi_user": false}``
- ``GET  /apis/v2beta1/experiments``    -> experiments filtered by ``display_name``
- ``POST /apis/v2beta1/experiments``    -> the created experiment (with an ``experiment_id``)
- ``POST /apis/v2beta1/runs``           -> the created run (with a ``run_id``)
- ``POST /apis/v2beta1/recurringruns``  -> the created recurring run (``recurring_run_id``)

Every request is recorded (method, path, query, headers, JSON body) so tests can assert exactly
what was sent. ``token`` makes every endpoint answer 401 unless ``Authorization: Bearer <token>``
is present; ``redirect_to`` makes every endpoint answer 302 (an auth proxy's login redirect), ``redirect``
one route; ``fail`` makes one route answer an API error.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse


@dataclass
class Request:
    """One recorded request."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any = None


@dataclass
class KfpApiDouble:
    """The double's state; use as a context manager to serve on ``url``."""

    token: str | None = None
    redirect_to: str | None = None
    requests: list[Request] = field(default_factory=list)
    experiments: list[dict[str, Any]] = field(default_factory=list)
    #: ``(method, path) -> (status, message)``: answer that route with an API error instead.
    fail: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict)
    #: ``(method, path) -> seconds``: hold the answer back this long (a stalled API).
    stall: dict[tuple[str, str], float] = field(default_factory=dict)
    #: ``(method, path) -> JSON``: answer 200 with exactly this body (e.g. without an id).
    reply: dict[tuple[str, str], Any] = field(default_factory=dict)
    #: ``(method, path) -> (status, location)``: answer that route with a redirect.
    redirect: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict)

    def __enter__(self) -> KfpApiDouble:
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:
                double._handle(self, "GET")

            def do_POST(self) -> None:
                double._handle(self, "POST")

        self._released = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._released.set()  # stalled handlers answer now, so shutdown does not wait on them
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def calls(self, method: str | None = None, path: str | None = None) -> list[Request]:
        """Recorded requests, optionally filtered."""
        return [r for r in self.requests if (method is None or r.method == method)
                and (path is None or r.path == path)]

    # -- request handling ---------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        self.requests.append(Request(method, url.path, parse_qs(url.query),
                                     {k.lower(): v for k, v in h.headers.items()}, body))
        route = (method, url.path)
        if self._scripted(h, route):
            return None
        answer = _ROUTES.get(route)
        if answer is None:
            return self._send(h, 404, {"error": "Not Found", "code": 5, "message": "Not Found"})
        return self._send(h, 200, getattr(self, answer)(parse_qs(url.query), body))

    def _scripted(self, h: BaseHTTPRequestHandler, route: tuple[str, str]) -> bool:
        """Answer as the test scripted (redirect, auth, stall, reply, fail); False: not scripted."""
        if self.redirect_to:
            self._send(h, 302, None, {"Location": self.redirect_to})
            return True
        if self.token and h.headers.get("Authorization") != f"Bearer {self.token}":
            self._send(h, 401, {"error": "Unauthorized", "code": 16, "message": "Unauthorized"})
            return True
        if route in self.redirect:
            status, location = self.redirect[route]
            self._send(h, status, None, {"Location": location})
            return True
        if route in self.stall:
            self._released.wait(self.stall[route])
        if route in self.reply:
            self._send(h, 200, self.reply[route])
            return True
        if route in self.fail:
            status, message = self.fail[route]
            throttled = {"Retry-After": "3600"} if status == 429 else None  # an API's flow control
            self._send(h, status, {"error": message, "code": 3, "message": message}, throttled)
            return True
        return False

    # -- the API's answers: each takes the query and the request body --------------------------

    def _healthz(self, _query: dict[str, list[str]], _body: Any) -> dict[str, Any]:
        return {"multi_user": False}

    def _create_experiment(self, _query: dict[str, list[str]], body: Any) -> dict[str, Any]:
        exp = {**body, "experiment_id": str(uuid.uuid4()), "storage_state": "AVAILABLE"}
        self.experiments.append(exp)
        return exp

    def _create_run(self, _query: dict[str, list[str]], body: Any) -> dict[str, Any]:
        return {**body, "run_id": str(uuid.uuid4()), "state": "PENDING"}

    def _create_recurring_run(self, _query: dict[str, list[str]], body: Any) -> dict[str, Any]:
        return {**body, "recurring_run_id": str(uuid.uuid4()), "status": "ENABLED"}

    def _list_experiments(self, query: dict[str, list[str]], _body: Any) -> dict[str, Any]:
        found = self.experiments
        if "filter" in query:
            flt = json.loads(query["filter"][0])
            for pred in flt.get("predicates", []):
                if pred.get("key") == "display_name":
                    want = pred.get("stringValue", pred.get("string_value"))
                    found = [e for e in found if e.get("display_name") == want]
        return {"experiments": found, "total_size": len(found)} if found else {}

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, obj: Any,
              headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode() if obj is not None else b""
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        try:
            h.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a client may hang up mid-body (ours stops reading a healthz past 64 KiB)


#: The KFP API routes the double answers: (method, path) -> its method that makes the answer.
_ROUTES = {
    ("GET", "/apis/v2beta1/healthz"): "_healthz",
    ("GET", "/apis/v2beta1/experiments"): "_list_experiments",
    ("POST", "/apis/v2beta1/experiments"): "_create_experiment",
    ("POST", "/apis/v2beta1/runs"): "_create_run",
    ("POST", "/apis/v2beta1/recurringruns"): "_create_recurring_run",
}
