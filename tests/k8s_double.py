"""TEST DOUBLE of the few Kubernetes API endpoints the launcher uses. Not a Kubernetes API server.

There is no Kubernetes cluster on the test machines, so the launcher's calls go to this small HTTP
server instead (``http.server`` in a thread; point a ``kubernetes.client.Configuration`` at
:attr:`K8sDouble.url`). It speaks the real wire format of:

* ``POST/GET/DELETE /apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs[/{name}]`` and the same
  for ``/apis/trainer.kubeflow.org/v1alpha1/.../trainjobs`` (Kubeflow Trainer v2)
* ``GET /apis/{group}/{version}`` (API discovery) for the job APIs in :attr:`served`
* ``GET /api/v1/namespaces/{ns}/pods/{name}`` and ``GET .../pods?labelSelector=...`` (list, and
  ``watch=true``: chunked JSON event lines from a resourceVersion until ``timeoutSeconds``)
* ``GET /api/v1/namespaces/{ns}/pods/{name}/log`` (``follow``, ``tailLines``, ``previous``;
  a follow stream is chunked and ends when the container instance terminates)

It does *not* run an operator or a kubelet: a test plays their part through the scenario methods
(:meth:`set_condition`, :meth:`add_pod` / :meth:`add_node_pod`, :meth:`start`, :meth:`log`, :meth:`terminate`,
:meth:`restart`, :meth:`recreate`). Every request is recorded in :attr:`requests`.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from kubernetes import client as k8s

PODS = "/api/v1/namespaces/"
#: plural -> (group, version) of the job APIs the double serves.
JOB_APIS = {"pytorchjobs": ("kubeflow.org", "v1"), "trainjobs": ("trainer.kubeflow.org", "v1alpha1")}
JOB_LABELS = ("training.kubeflow.org/job-name", "jobset.sigs.k8s.io/jobset-name")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}


class K8sDouble:
    """State of the fake cluster plus the HTTP server that serves it."""

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        # (ns, pod, uid, restart) -> {"lines": [...], "done": bool}
        self.logs: dict[tuple[str, str, str, int], dict[str, Any]] = {}
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, ns, type, pod)
        self.requests: list[dict[str, Any]] = []
        #: ``{"POST": (403, "Forbidden")}``: answer the next request of that verb with an error.
        self.fail_next: dict[str, tuple[int, str]] = {}
        #: Job plurals the API server serves (discovery; creating another kind answers 404).
        self.served = set(JOB_APIS)
        self.rv = 1
        self.cond = threading.Condition()
        self.closed = False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL of the double."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def configuration(self) -> k8s.Configuration:
        """A client configuration pointing at the double."""
        cfg = k8s.Configuration()
        cfg.host = self.url
        return cfg

    def serve(self) -> K8sDouble:
        """Start serving in a daemon thread."""
        self._thread.start()
        return self

    def close(self) -> None:
        """End open streams and stop the server."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def calls(self, method: str, kind: str = "") -> list[dict[str, Any]]:
        """Recorded requests of one method (and path part)."""
        return [r for r in self.requests if r["method"] == method and kind in r["path"]]

    # -- scenario: what the operator and kubelet would do ---------------------------------------

    def wait_for_job(self, name: str, ns: str = "default", timeout: float = 10.0) -> dict:
        """Block until a job named ``name`` exists."""
        with self.cond:
            if not self.cond.wait_for(lambda: (ns, name) in self.jobs, timeout):
                raise TimeoutError(f"job {name} was never created")
            return self.jobs[(ns, name)]

    def put_job(self, manifest: dict[str, Any], ns: str = "default") -> dict[str, Any]:
        """Store a job as if it had been created earlier (for re-attach tests)."""
        with self.cond:
            return self._store_job(ns, copy.deepcopy(manifest))

    def set_condition(self, name: str, ctype: str, reason: str = "", message: str = "",
                      ns: str = "default") -> None:
        """Append a condition (status True) as the operator does; others stop being current."""
        with self.cond:
            job = self.jobs[(ns, name)]
            status = job.setdefault("status", {})
            conds = status.setdefault("conditions", [])
            for c in conds:
                if c["type"] in ("Running", "Restarting") and ctype != c["type"]:
                    c["status"] = "False"
            conds.append({"type": ctype, "status": "True", "reason": reason or f"PyTorchJob{ctype}",
                          "message": message or f"PyTorchJob {name} is {ctype.lower()}.",
                          "lastTransitionTime": _now(), "lastUpdateTime": _now()})
            if ctype in ("Succeeded", "Failed"):
                status["completionTime"] = _now()
            self.cond.notify_all()

    def add_pod(self, job: str, index: int, ns: str = "default", *, name: str = "",
                labels: dict[str, str] | None = None, container: str = "pytorch") -> str:
        """Create worker pod ``<job>-worker-<index>`` (or ``name``) in phase Pending."""
        name = name or f"{job}-worker-{index}"
        labels = labels or {"training.kubeflow.org/job-name": job,
                            "training.kubeflow.org/replica-type": "worker",
                            "training.kubeflow.org/replica-index": str(index),
                            "training.kubeflow.org/operator-name": "pytorchjob-controller"}
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": ns, "uid": str(uuid.uuid4()),
                            "labels": labels, "creationTimestamp": _now()},
               "spec": {"containers": [{"name": container, "image": "img"}]},
               "status": {"phase": "Pending", "containerStatuses": [{
                   "name": container, "image": "img", "imageID": "", "ready": False,
                   "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}]}}
        with self.cond:
            self.pods[(ns, name)] = pod
            self._event(ns, "ADDED", pod)
        return name

    def add_node_pod(self, job: str, index: int, attempt: int = 0, ns: str = "default") -> str:
        """Create a TrainJob node pod as the Job controller names it (random suffix), Pending."""
        name = f"{job}-node-0-{index}-{uuid.uuid4().hex[:5]}"
        labels = {"jobset.sigs.k8s.io/jobset-name": job,
                  "jobset.sigs.k8s.io/replicatedjob-name": "node",
                  "jobset.sigs.k8s.io/restart-attempt": str(attempt),
                  "batch.kubernetes.io/job-completion-index": str(index)}
        self.add_pod(job, index, ns, name=name, labels=labels, container="node")
        return name

    def unschedulable(self, pod: str, message: str, ns: str = "default") -> None:
        """Mark a Pending pod unschedulable (PodScheduled=False)."""
        with self.cond:
            p = self.pods[(ns, pod)]
            p["status"]["conditions"] = [{"type": "PodScheduled", "status": "False",
                                          "reason": "Unschedulable", "message": message}]
            self._event(ns, "MODIFIED", p)

    def start(self, pod: str, ns: str = "default") -> None:
        """Container running (current restart count)."""
        with self.cond:
            p = self.pods[(ns, pod)]
            st = p["status"]["containerStatuses"][0]
            st["state"] = {"running": {"startedAt": _now()}}
            st["ready"] = True
            p["status"]["phase"] = "Running"
            p["status"].pop("conditions", None)
            self.logs.setdefault(self._log_key(ns, p), {"lines": [], "done": False})
            self._event(ns, "MODIFIED", p)

    def log(self, pod: str, *lines: str, ns: str = "default") -> None:
        """Append lines to the running container instance's log."""
        with self.cond:
            self.logs[self._log_key(ns, self.pods[(ns, pod)])]["lines"].extend(lines)
            self.cond.notify_all()

    def terminate(self, pod: str, exit_code: int, reason: str = "", ns: str = "default") -> None:
        """Container exits; pod phase follows (restartPolicy Never, as with ExitCode)."""
        with self.cond:
            p = self.pods[(ns, pod)]
            st = p["status"]["containerStatuses"][0]
            st["state"] = {"terminated": {"exitCode": exit_code,
                                          "reason": reason or ("Completed" if exit_code == 0
                                                               else "Error"),
                                          "startedAt": _now(), "finishedAt": _now()}}
            st["ready"] = False
            p["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
            self.logs[self._log_key(ns, p)]["done"] = True
            self._event(ns, "MODIFIED", p)

    def restart(self, pod: str, ns: str = "default") -> None:
        """Kubelet restarts the terminated container in place (restartCount + 1, running)."""
        with self.cond:
            p = self.pods[(ns, pod)]
            st = p["status"]["containerStatuses"][0]
            st["lastState"] = st["state"]
            st["restartCount"] += 1
            p["status"]["phase"] = "Pending"
        self.start(pod, ns)

    def recreate(self, pod: str, ns: str = "default") -> None:
        """Operator deletes and recreates the pod (new uid, Pending)."""
        index = int(pod.rsplit("-", 1)[1])
        with self.cond:
            old = self.pods.pop((ns, pod))
            self._event(ns, "DELETED", old)
        self.add_pod(pod.rsplit("-worker-", 1)[0], index, ns)

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _log_key(ns: str, pod: dict[str, Any]) -> tuple[str, str, str, int]:
        st = pod["status"]["containerStatuses"][0]
        return ns, pod["metadata"]["name"], pod["metadata"]["uid"], st["restartCount"]

    def _event(self, ns: str, etype: str, pod: dict[str, Any]) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, ns, etype, copy.deepcopy(pod)))
        self.cond.notify_all()

    def _store_job(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        meta = body.setdefault("metadata", {})
        meta.update(namespace=ns, uid=str(uuid.uuid4()), resourceVersion=str(self.rv),
                    creationTimestamp=_now(), generation=1)
        body.setdefault("status", {})
        self.jobs[(ns, meta["name"])] = body
        self.cond.notify_all()
        return body


def _select(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def _handler_for(double: K8sDouble) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # keep test output clean
            pass

        # -- plumbing ---------------------------------------------------------------------------

        def _record(self, body: Any = None) -> tuple[list[str], dict[str, str]]:
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            double.requests.append({"method": self.command, "path": url.path, "query": query,
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

        # -- verbs ------------------------------------------------------------------------------

        def do_POST(self) -> None:  # noqa: N802
            body = self._body()
            parts, _ = self._record(body)
            if "POST" in double.fail_next:
                code, reason = double.fail_next.pop("POST")
                return self._json(code, _status(code, reason, f"injected {reason}"))
            if len(parts) != 6 or parts[5] not in double.served:
                return self._json(404, _status(404, "NotFound", "no such endpoint"))
            ns = parts[4]
            with double.cond:
                if (ns, body["metadata"]["name"]) in double.jobs:
                    return self._json(409, _status(409, "AlreadyExists",
                                                   f"{parts[5]} already exists"))
                stored = double._store_job(ns, body)
            self._json(201, stored)

        def do_DELETE(self) -> None:  # noqa: N802
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
                    double._event(ns, "DELETED", pod)
            self._json(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

        def do_GET(self) -> None:  # noqa: N802
            parts, query = self._record()
            if parts[0] == "apis" and len(parts) == 3:
                return self._discovery(parts[1], parts[2])
            if parts[0] == "apis" and len(parts) == 7 and parts[5] in double.served:
                with double.cond:
                    job = double.jobs.get((parts[4], parts[6]))
                if job is None:
                    return self._json(404, _status(404, "NotFound", f"{parts[6]} not found"))
                return self._json(200, job)
            if self.path.startswith(PODS) and len(parts) == 6:
                with double.cond:
                    pod = copy.deepcopy(double.pods.get((parts[3], parts[5])))
                if pod is None:
                    return self._json(404, _status(404, "NotFound", f"pods {parts[5]} not found"))
                return self._json(200, pod)
            if self.path.startswith(PODS) and len(parts) == 5:
                return self._pods(parts[3], query)
            if self.path.startswith(PODS) and len(parts) == 7 and parts[6] == "log":
                return self._log(parts[3], parts[5], query)
            self._json(404, _status(404, "NotFound", "no such endpoint"))

        def _discovery(self, group: str, version: str) -> None:
            plurals = [p for p, gv in JOB_APIS.items() if gv == (group, version)
                       and p in double.served]
            if not plurals:
                return self._json(404, _status(404, "NotFound", "the server could not find "
                                               "the requested resource"))
            return self._json(200, {"kind": "APIResourceList", "apiVersion": "v1",
                                    "groupVersion": f"{group}/{version}", "resources": [
                                        {"name": p, "namespaced": True, "kind": p[:-1],
                                         "verbs": ["create", "get", "delete"]}
                                        for p in plurals]})

        def _pods(self, ns: str, query: dict[str, str]) -> None:
            selector = query.get("labelSelector", "")
            if query.get("watch") not in ("true", "1", "True"):
                with double.cond:
                    items = [copy.deepcopy(p) for (n, _), p in double.pods.items()
                             if n == ns and _select(p["metadata"]["labels"], selector)]
                    rv = str(double.rv)
                return self._json(200, {"kind": "PodList", "apiVersion": "v1",
                                        "metadata": {"resourceVersion": rv}, "items": items})
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

        def _log(self, ns: str, pod: str, query: dict[str, str]) -> None:
            with double.cond:
                p = double.pods.get((ns, pod))
                if p is None:
                    return self._json(404, _status(404, "NotFound", f"pods {pod} not found"))
                key = K8sDouble._log_key(ns, p)
                if query.get("previous") in ("true", "1", "True"):
                    key = (*key[:3], key[3] - 1)
                buf = double.logs.get(key)
            if buf is None:
                return self._json(400, _status(400, "BadRequest", f'container "pytorch" in pod '
                                               f'"{pod}" is waiting to start: ContainerCreating'))
            follow = query.get("follow") in ("true", "1", "True")
            tail = int(query["tailLines"]) if "tailLines" in query else None
            if not follow:
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
            return None

    return Handler


def _wake(double: K8sDouble) -> None:
    with double.cond:
        double.cond.notify_all()
