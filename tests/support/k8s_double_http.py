"""TEST DOUBLE, part 2: the HTTP side of :class:`k8s_double.K8sDouble` (the wire format).

One handler class per double: it routes the Kubernetes API paths the launcher calls to the
double's state and answers in the API server's format (``Status`` errors, chunked watch event
lines and followed logs). The endpoints are listed in :mod:`k8s_double`'s docstring.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

if TYPE_CHECKING:
    from support.k8s_double import K8sDouble

PODS = "/api/v1/namespaces/"
#: plural -> (group, version) of the job APIs the double serves.
JOB_APIS = {"pytorchjobs": ("kubeflow.org", "v1"), "trainjobs": ("trainer.kubeflow.org", "v1alpha1")}
JOB_LABELS = ("training.kubeflow.org/job-name", "jobset.sigs.k8s.io/jobset-name")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}


def _select(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def handler_for(double: K8sDouble) -> type[BaseHTTPRequestHandler]:
    """The request handler class serving ``double``'s state."""
    return type("Handler", (_Handler,), {"double": double})


#: GET routes: (leading path segments, segment count) -> the handler method that answers.
_GET_ROUTES: dict[tuple[tuple[str, ...], int], str] = {
    (("apis",), 3): "_discovery",
    (("apis",), 7): "_get_job",
    (("api", "v1", "namespaces"), 6): "_get_pod",
    (("api", "v1", "namespaces"), 5): "_pods",
    (("api", "v1", "namespaces"), 7): "_log",
}
_TRUE = ("true", "1", "True")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    double: K8sDouble

    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass

    # -- plumbing -------------------------------------------------------------------------------

    def _record(self, body: Any = None) -> tuple[list[str], dict[str, str]]:
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.double.requests.append({"method": self.command, "path": url.path, "query": query,
                                     "body": copy.deepcopy(body)})
        return url.path.strip("/").split("/"), query

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"null") if length else None

    def _json(self, code: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _trickled(self) -> bool:
        """Answers this request by a trickle when its verb is in ``double.trickle``."""
        if self.command not in self.double.trickle:
            return False
        self._record()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            while not self.double.closed:
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(self.double.trickle_s)
        except OSError:
            pass  # the client hung up: what a bounded client does
        self.close_connection = True
        return True

    def _no_endpoint(self) -> None:
        self._json(404, _status(404, "NotFound", "no such endpoint"))

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _start_stream(self, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    # -- verbs ----------------------------------------------------------------------------------

    def do_POST(self) -> None:  # noqa: N802
        double = self.double
        body = self._body()
        parts, _ = self._record(body)
        if "POST" in double.fail_next:
            code, reason = double.fail_next.pop("POST")
            return self._json(code, _status(code, reason, f"injected {reason}"))
        if len(parts) != 6 or parts[5] not in double.served:
            return self._no_endpoint()
        ns = parts[4]
        with double.cond:
            if (ns, body["metadata"]["name"]) in double.jobs:
                return self._json(409, _status(409, "AlreadyExists",
                                               f"{parts[5]} already exists"))
            stored = double.store_job(ns, body)
        self._json(201, stored)

    def do_DELETE(self) -> None:  # noqa: N802
        if self._trickled():
            return
        double = self.double
        body = self._body()
        parts, _ = self._record(body)
        ns, name = parts[4], parts[6]
        with double.cond:
            job = double.jobs.pop((ns, name), None)
            if job is None:
                return self._json(404, _status(404, "NotFound", f"{name} not found"))
            for key in [k for k, p in double.pods.items() if k[0] == ns and name in (
                    p["metadata"]["labels"].get(label) for label in JOB_LABELS)]:
                pod = double.pods.pop(key)
                for lk, buf in double.logs.items():
                    if lk[:2] == key:
                        buf["done"] = True
                double.event(ns, "DELETED", pod)
        self._json(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

    def do_GET(self) -> None:  # noqa: N802
        if self._trickled():
            return
        parts, query = self._record()
        for (prefix, count), method in _GET_ROUTES.items():
            if len(parts) == count and tuple(parts[:len(prefix)]) == prefix:
                return getattr(self, method)(parts, query)
        self._no_endpoint()

    # -- GET routes: each takes the path's segments and the query -------------------------------

    def _discovery(self, parts: list[str], _query: dict[str, str]) -> None:
        group, version = parts[1], parts[2]
        plurals = [p for p, gv in JOB_APIS.items() if gv == (group, version)
                   and p in self.double.served]
        if not plurals:
            return self._json(404, _status(404, "NotFound", "the server could not find "
                                           "the requested resource"))
        return self._json(200, {"kind": "APIResourceList", "apiVersion": "v1",
                                "groupVersion": f"{group}/{version}", "resources": [
                                    {"name": p, "namespaced": True, "kind": p[:-1],
                                     "verbs": ["create", "get", "delete"]}
                                    for p in plurals]})

    def _get_job(self, parts: list[str], _query: dict[str, str]) -> None:
        if parts[5] not in self.double.served:
            return self._no_endpoint()
        with self.double.cond:
            job = self.double.jobs.get((parts[4], parts[6]))
        if job is None:
            return self._json(404, _status(404, "NotFound", f"{parts[6]} not found"))
        return self._json(200, job)

    def _get_pod(self, parts: list[str], _query: dict[str, str]) -> None:
        with self.double.cond:
            pod = copy.deepcopy(self.double.pods.get((parts[3], parts[5])))
        if pod is None:
            return self._json(404, _status(404, "NotFound", f"pods {parts[5]} not found"))
        return self._json(200, pod)

    def _pods(self, parts: list[str], query: dict[str, str]) -> None:
        double, ns = self.double, parts[3]
        selector = query.get("labelSelector", "")
        if query.get("watch") not in _TRUE:
            with double.cond:
                items = [copy.deepcopy(p) for (n, _), p in double.pods.items()
                         if n == ns and _select(p["metadata"]["labels"], selector)]
                rv = str(double.rv)
            return self._json(200, {"kind": "PodList", "apiVersion": "v1",
                                    "metadata": {"resourceVersion": rv}, "items": items})
        return self._watch_pods(ns, selector, query)

    def _watch_pods(self, ns: str, selector: str, query: dict[str, str]) -> None:
        double = self.double
        since = int(query.get("resourceVersion") or 0)
        timeout = float(query.get("timeoutSeconds") or 30)
        self._start_stream("application/json")
        end = threading.Event()
        threading.Timer(timeout, lambda: (end.set(), _wake(double))).start()
        try:
            while True:
                with double.cond:
                    double.cond.wait_for(lambda s=since: end.is_set() or double.closed or any(
                        rv > s for rv, *_ in double.events), 1.0)
                    batch = [(rv, t, p) for rv, n, t, p in double.events
                             if rv > since and n == ns
                             and _select(p["metadata"]["labels"], selector)]
                    since = max([since] + [rv for rv, *_ in double.events])
                    stop = end.is_set() or double.closed
                for _, etype, pod in batch:
                    self._chunk(json.dumps({"type": etype, "object": pod}).encode() + b"\n")
                if stop:
                    break
            self._end_stream()
        except OSError:
            pass

    def _log(self, parts: list[str], query: dict[str, str]) -> None:
        if parts[6] != "log":
            return self._no_endpoint()
        double, ns, pod = self.double, parts[3], parts[5]
        with double.cond:
            p = double.pods.get((ns, pod))
            if p is None:
                return self._json(404, _status(404, "NotFound", f"pods {pod} not found"))
            key = double.log_key(ns, p)
            if query.get("previous") in _TRUE:
                key = (*key[:3], key[3] - 1)
            buf = double.logs.get(key)
        if buf is None:
            return self._json(400, _status(400, "BadRequest", f'container "pytorch" in pod '
                                           f'"{pod}" is waiting to start: ContainerCreating'))
        tail = int(query["tailLines"]) if "tailLines" in query else None
        if query.get("follow") in _TRUE:
            return self._follow_log(buf)
        with double.cond:
            lines = list(buf["lines"])
        lines = lines[-tail:] if tail is not None else lines
        data = "".join(f"{ln}\n" for ln in lines).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return None

    def _follow_log(self, buf: dict[str, Any]) -> None:
        double = self.double
        self._start_stream("text/plain")
        sent = 0
        try:
            while True:
                with double.cond:
                    double.cond.wait_for(lambda n=sent: len(buf["lines"]) > n or buf["done"]
                                         or double.closed, 1.0)
                    new = buf["lines"][sent:]
                    sent += len(new)
                    stop = (buf["done"] and sent == len(buf["lines"])) or double.closed
                if new:
                    self._chunk("".join(f"{ln}\n" for ln in new).encode())
                if stop:
                    break
            self._end_stream()
        except OSError:
            pass


def _wake(double: K8sDouble) -> None:
    with double.cond:
        double.cond.notify_all()
