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
(:meth:`set_condition`, :meth:`add_pod` / :meth:`add_node_pod`, :meth:`start`, :meth:`log`,
:meth:`terminate`, :meth:`restart`, :meth:`recreate`). Every request is recorded in
:attr:`requests`. This module holds the fake cluster's state and those scenario methods;
:mod:`k8s_double_http` holds the HTTP handler that serves the state in the API's wire format.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import threading
import uuid
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

from support.k8s_double_http import JOB_APIS, handler_for


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


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
        #: Verbs (``{"DELETE", "GET"}``) answered by a trickle: the status line and headers of a
        #: 200, then one body byte every :attr:`trickle_s`, until the client hangs up (a slow API
        #: server or a proxy holding the connection).
        self.trickle: set[str] = set()
        self.trickle_s = 0.5
        self.tls = False
        #: Job plurals the API server serves (discovery; creating another kind answers 404).
        self.served = set(JOB_APIS)
        self.rv = 1
        self.cond = threading.Condition()
        self.closed = False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL of the double."""
        host, port = self._server.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    def use_tls(self, certfile: Path, keyfile: Path) -> K8sDouble:
        """Serve HTTPS with this (self-signed) certificate; call before :meth:`serve`."""
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(certfile), str(keyfile))
        self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self.tls = True
        return self

    def configuration(self) -> k8s.Configuration:
        """A client configuration pointing at the double."""
        cfg = k8s.Configuration()
        cfg.host = self.url
        return cfg

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """Write a kubeconfig whose current context is the double (a token, no secret)."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "double",
            "clusters": [{"name": "double", "cluster": {
                "server": self.url, **({"insecure-skip-tls-verify": True} if self.tls else {})}}],
            "users": [{"name": "tester", "user": {"token": "not-a-secret"}}],
            "contexts": [{"name": "double", "context": {"cluster": "double", "user": "tester",
                                                        "namespace": namespace}}],
        }))
        return path

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
            return self.store_job(ns, copy.deepcopy(manifest))

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
            self.event(ns, "ADDED", pod)
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
            self.event(ns, "MODIFIED", p)

    def start(self, pod: str, ns: str = "default") -> None:
        """Container running (current restart count)."""
        with self.cond:
            p = self.pods[(ns, pod)]
            st = p["status"]["containerStatuses"][0]
            st["state"] = {"running": {"startedAt": _now()}}
            st["ready"] = True
            p["status"]["phase"] = "Running"
            p["status"].pop("conditions", None)
            self.logs.setdefault(self.log_key(ns, p), {"lines": [], "done": False})
            self.event(ns, "MODIFIED", p)

    def log(self, pod: str, *lines: str, ns: str = "default") -> None:
        """Append lines to the running container instance's log."""
        with self.cond:
            self.logs[self.log_key(ns, self.pods[(ns, pod)])]["lines"].extend(lines)
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
            self.logs[self.log_key(ns, p)]["done"] = True
            self.event(ns, "MODIFIED", p)

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
            self.event(ns, "DELETED", old)
        self.add_pod(pod.rsplit("-worker-", 1)[0], index, ns)

    # -- state changes shared with the HTTP handler ---------------------------------------------

    @staticmethod
    def log_key(ns: str, pod: dict[str, Any]) -> tuple[str, str, str, int]:
        st = pod["status"]["containerStatuses"][0]
        return ns, pod["metadata"]["name"], pod["metadata"]["uid"], st["restartCount"]

    def event(self, ns: str, etype: str, pod: dict[str, Any]) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, ns, etype, copy.deepcopy(pod)))
        self.cond.notify_all()

    def store_job(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        meta = body.setdefault("metadata", {})
        meta.update(namespace=ns, uid=str(uuid.uuid4()), resourceVersion=str(self.rv),
                    creationTimestamp=_now(), generation=1)
        body.setdefault("status", {})
        self.jobs[(ns, meta["name"])] = body
        self.cond.notify_all()
        return body


