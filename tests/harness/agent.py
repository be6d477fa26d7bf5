"""The test node agent: N Nodes that run their pods as local processes (issue 21).

:func:`start_agent` registers the Nodes (capacity, labels and taints the ``cpu`` profile selects),
keeps them Ready (node status and Lease heartbeats, so kube-controller-manager's node lifecycle
controller keeps them), and watches the Pods the kube-scheduler binds to them; each runs in a
:class:`.agent_pod.PodRunner`. It also

* runs every pod in one network namespace of the cluster's own (:class:`.agent_hosts.Netns`);
* keeps one cluster hosts file (``<root>/agent/hosts``) with every pod's and Service's DNS names,
  bind-mounted on ``/etc/hosts`` inside each container's private mount namespace only;
* backs every PersistentVolumeClaim with a folder ``<root>/volumes/<namespace>/<claim>`` (claims
  that no PersistentVolume serves get a hostPath PV made for them, so "create a claim, get a
  folder"; ``<root>/agent/volumes.json`` lists them all);
* serves container logs to the API server (:mod:`.agent_kubelet`).

Drills reach it through files: ``<root>/agent/pods/<uid>/pids.json`` names each container's
process group; ``<root>/agent/control/<node>`` containing ``lost`` makes that node stop
heartbeating and its processes die without a word (a lost machine).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .agent_env import decode_secret
from .agent_hosts import Hosts, Netns, dns_names
from .agent_kubelet import KubeletServer
from .agent_node import CAPACITY, LEASE_NAMESPACE, lease_body, node_body, node_status
from .agent_pod import PodRunner
from .pki import Leaf

if TYPE_CHECKING:
    from .controlplane import ControlPlane

NODE_PREFIX = "kfp-nvrx-node-"
HEARTBEAT_S = 5.0


class Agent:
    """See the module docstring.

    Args:
        cp: The running control plane.
        nodes: How many Nodes to register.
    """

    def __init__(self, cp: ControlPlane, nodes: int) -> None:
        from kubernetes import client, config

        self.cp = cp
        self.root = cp.root / "agent"
        self.volumes = cp.root / "volumes"
        (self.root / "control").mkdir(parents=True, exist_ok=True)
        self.api = config.new_client_from_config(config_file=str(cp.kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.coord = client.CoordinationV1Api(self.api)
        self.nodes = [f"{NODE_PREFIX}{i}" for i in range(nodes)]
        self.lost: set[str] = set()
        self.allocatable = dict(CAPACITY)
        self.hosts = Hosts(self.root / "hosts")
        self.netns = Netns()
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.runners: dict[str, PodRunner] = {}  # by uid
        self.by_name: dict[tuple[str, str], str] = {}  # (ns, name) -> newest uid
        self.ips: dict[str, str] = {}
        self.claims: dict[str, str] = {}
        pair = cp.pki.issue("kubelet", Leaf("kubelet", ips=("127.0.0.1",), dns=("localhost",)))
        self.kubelet = KubeletServer(self, str(pair.cert), str(pair.key))
        self.threads: list[threading.Thread] = []

    # -- API helpers ---------------------------------------------------------------------------

    def _patch(self, path: str, body: dict[str, Any]) -> None:
        self.api.call_api(path, "PATCH", header_params={
            "Content-Type": "application/strategic-merge-patch+json",
            "Accept": "application/json"}, body=body, auth_settings=["BearerToken"],
            response_type="object", _return_http_data_only=True)

    def _retry(self, what: str, fn, attempts: int = 5) -> Any:
        from kubernetes.client.rest import ApiException

        for i in range(attempts):
            try:
                return fn()
            except ApiException as e:
                if e.status in (404, 409, 422) or i == attempts - 1:
                    if e.status != 404:
                        print(f"agent: {what}: HTTP {e.status} {e.reason}: {str(e.body)[:300]}",
                              flush=True)
                    return None
            except Exception as e:  # noqa: BLE001 - connection resets while the server is busy
                if i == attempts - 1:
                    print(f"agent: {what}: {type(e).__name__}: {e}", flush=True)
                    return None
            time.sleep(0.5 * (i + 1))
        return None

    # -- nodes ---------------------------------------------------------------------------------

    def _node_status(self) -> dict[str, Any]:
        return node_status(self.allocatable, self.kubelet.port)

    def _register(self, name: str) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.core.create_node(node_body(name))
        except ApiException as e:
            if e.status != 409:
                raise
        self._patch(f"/api/v1/nodes/{name}/status", {"status": self._node_status()})

    def _heartbeat(self) -> None:
        """Node status and Lease renewals; a lost node gets neither."""
        while not self.stopping.wait(HEARTBEAT_S):
            self._read_control()
            for name in self.nodes:
                if name in self.lost:
                    continue
                self._retry(f"node {name} status", lambda n=name: self._patch(
                    f"/api/v1/nodes/{n}/status", {"status": self._node_status()}), 2)
                self._retry(f"lease {name}", lambda n=name: self._renew(n), 2)

    def _renew(self, name: str) -> None:
        from kubernetes.client.rest import ApiException

        body = lease_body(name)
        try:
            self.coord.patch_namespaced_lease(name, LEASE_NAMESPACE, {"spec": body["spec"]})
        except ApiException as e:
            if e.status != 404:
                raise
            self.coord.create_namespaced_lease(LEASE_NAMESPACE, body)

    def _read_control(self) -> None:
        """``control/<node>`` = ``lost``: stop that node (ack: ``<node>.lost``); file removed:
        register it again (a replacement machine with the same name)."""
        for name in self.nodes:
            f, ack = self.root / "control" / name, self.root / "control" / f"{name}.lost"
            lost = f.is_file() and f.read_text().strip() == "lost"
            if lost and name not in self.lost:
                self.lost.add(name)
                with self.lock:
                    doomed = [r for r in self.runners.values() if r.node == name]
                for r in doomed:
                    r.kill(report=False)
                print(f"agent: node {name} lost (no heartbeats; {len(doomed)} pods killed)",
                      flush=True)
                ack.write_text("lost")
            elif not lost and name in self.lost:
                self._retry(f"registering node {name}", lambda n=name: self._register(n), 3)
                self.lost.discard(name)
                ack.unlink(missing_ok=True)
                print(f"agent: node {name} back", flush=True)

    # -- pods ----------------------------------------------------------------------------------

    def runner(self, ns: str, name: str) -> PodRunner | None:
        """The runner of the newest pod named ``ns/name``."""
        with self.lock:
            uid = self.by_name.get((ns, name))
            return self.runners.get(uid) if uid else None

    def address(self, pod: dict[str, Any]) -> str:
        """The pod's 127.0.0.x address, stable per (namespace, hostname, subdomain)."""
        meta, spec = pod["metadata"], pod["spec"]
        key = f"{meta['namespace']}/{spec.get('hostname') or meta['name']}/" \
              f"{spec.get('subdomain', '')}"
        with self.lock:
            if key not in self.ips:
                n = len(self.ips) + 2
                self.ips[key] = f"127.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
            return self.ips[key]

    def pod_started(self, r: PodRunner) -> None:
        """A pod got its address: its names go into the hosts file before any process starts."""
        spec = r.pod["spec"]
        entries = {n: r.ip for n in dns_names(r.hostname, spec.get("subdomain", ""), r.ns)}
        entries.setdefault(r.hostname, r.ip)
        self.hosts.set(entries)
        self._services(r.ns)

    def _services(self, ns: str) -> None:
        """Point every Service of ``ns`` whose selector matches a running pod at that pod."""
        svcs = self._retry(f"services of {ns}", lambda: self.core.list_namespaced_service(ns), 2)
        with self.lock:
            pods = [r for r in self.runners.values() if r.ns == ns and r.ip and
                    not r.finished.is_set()]
        entries = {}
        for svc in svcs.items if svcs else []:
            sel = svc.spec.selector or {}
            match = [r for r in pods if sel and all(
                (r.pod["metadata"].get("labels") or {}).get(k) == v for k, v in sel.items())]
            if match:
                entries.update({n: match[0].ip for n in dns_names(svc.metadata.name, "", ns)})
        if entries:
            self.hosts.set(entries)

    def patch_status(self, r: PodRunner, status: dict[str, Any]) -> None:
        self._retry(f"status of pod {r.ns}/{r.name}", lambda: self._patch(
            f"/api/v1/namespaces/{r.ns}/pods/{r.name}/status", {
                "metadata": {"uid": r.uid}, "status": status}))

    def remove_pod(self, r: PodRunner) -> None:
        """The final delete a kubelet makes once the containers are gone."""
        from kubernetes import client

        self._retry(f"deleting pod {r.ns}/{r.name}", lambda: self.core.delete_namespaced_pod(
            r.name, r.ns, body=client.V1DeleteOptions(
                grace_period_seconds=0, preconditions=client.V1Preconditions(uid=r.uid))))

    def lookup(self, kind: str, ns: str, name: str) -> dict[str, str] | None:
        """Decoded data of a Secret or ConfigMap (None when it does not exist)."""
        from kubernetes.client.rest import ApiException

        try:
            if kind == "secret":
                obj = self.api.sanitize_for_serialization(
                    self.core.read_namespaced_secret(name, ns))
                return decode_secret(obj)
            return dict(self.core.read_namespaced_config_map(name, ns).data or {})
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        node = spec.get("nodeName")
        if node not in self.nodes:
            return
        uid = meta["uid"]
        with self.lock:
            r = self.runners.get(uid)
        if kind == "DELETED":
            if r is not None:
                r.kill()
                r.cleanup()
                with self.lock:
                    self.runners.pop(uid, None)
                    if self.by_name.get((r.ns, r.name)) == uid:
                        self.by_name.pop((r.ns, r.name))
            return
        if r is None:
            phase = (pod.get("status") or {}).get("phase")
            if node in self.lost or phase in ("Succeeded", "Failed"):
                return
            if meta.get("deletionTimestamp"):
                # Never started: nothing to stop; release it as the kubelet would.
                r = PodRunner(self, pod, node)
                self.remove_pod(r)
                return
            r = PodRunner(self, pod, node)
            with self.lock:
                self.runners[uid] = r
                self.by_name[(r.ns, r.name)] = uid
            r.start()
        elif meta.get("deletionTimestamp"):
            r.delete(meta.get("deletionGracePeriodSeconds"))

    # -- volumes -------------------------------------------------------------------------------

    def claim_folder(self, ns: str, claim: str) -> Path:
        """The folder backing PVC ``ns/claim`` (created on first use)."""
        folder = self.volumes / ns / claim
        folder.mkdir(parents=True, exist_ok=True)
        with self.lock:
            if self.claims.get(f"{ns}/{claim}") != str(folder):
                self.claims[f"{ns}/{claim}"] = str(folder)
                # Claims made after `up` printed its list: <root>/agent/volumes.json has all.
                tmp = self.root / "volumes.json.tmp"
                tmp.write_text(json.dumps(dict(sorted(self.claims.items())), indent=1))
                os.replace(tmp, self.root / "volumes.json")
        return folder

    def _on_claim(self, kind: str, pvc: dict[str, Any]) -> None:
        if kind == "DELETED":
            return
        meta, spec = pvc["metadata"], pvc.get("spec") or {}
        folder = self.claim_folder(meta["namespace"], meta["name"])
        if spec.get("volumeName"):
            return
        # Nothing serves this claim: a hostPath PV bound to it by claimRef (the PV controller
        # completes the binding), standing in for a dynamic provisioner.
        pv = {"apiVersion": "v1", "kind": "PersistentVolume",
              "metadata": {"name": f"agent-{meta['uid']}"},
              "spec": {"capacity": {"storage": (spec.get("resources") or {}).get(
                  "requests", {}).get("storage", "1Gi")},
                  "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                  "persistentVolumeReclaimPolicy": "Retain",
                  "storageClassName": spec.get("storageClassName") or "",
                  "hostPath": {"path": str(folder), "type": "DirectoryOrCreate"},
                  "claimRef": {"namespace": meta["namespace"], "name": meta["name"],
                               "uid": meta["uid"]}}}
        self._retry(f"PV for claim {meta['namespace']}/{meta['name']}",
                    lambda: self.core.create_persistent_volume(pv), 2)

    # -- watches -------------------------------------------------------------------------------

    def _watch(self, list_fn, handler, listed: threading.Event | None = None) -> None:
        """List, then watch from that resourceVersion; re-list only after 410 Gone or an error."""
        while not self.stopping.is_set():
            try:
                rv = self._list(list_fn, handler, listed)
                while not self.stopping.is_set():  # a watch that timed out resumes at rv
                    rv = self._stream(list_fn, handler, rv)
            except Exception as e:  # noqa: BLE001 - 410 Gone, a reset connection: re-list
                if not self.stopping.is_set() and "410" not in str(e) and "Expired" not in str(e):
                    print(f"agent: watch: {type(e).__name__}: {str(e)[:200]}", flush=True)
                self.stopping.wait(1.0)

    @staticmethod
    def _list(list_fn, handler, listed: threading.Event | None) -> str:
        """Hand every listed item to ``handler`` as ADDED; the list's resourceVersion."""
        body = json.loads(list_fn(_preload_content=False).data)
        for item in body.get("items") or []:
            handler("ADDED", item)
        if listed is not None:
            listed.set()
        return body["metadata"]["resourceVersion"]

    def _stream(self, list_fn, handler, rv: str) -> str:
        """One watch from ``rv`` until it times out or the agent stops; the last resourceVersion."""
        from kubernetes import watch

        w = watch.Watch()
        for ev in w.stream(list_fn, resource_version=rv, timeout_seconds=30,
                           allow_watch_bookmarks=True):
            raw = ev.get("raw_object") or {}
            if ev["type"] == "ERROR":
                raise RuntimeError(f"watch error: {raw.get('message', raw)}")
            rv = (raw.get("metadata") or {}).get("resourceVersion", rv)
            if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                handler(ev["type"], raw)
            if self.stopping.is_set():
                w.stop()
                break
        return rv

    def _thread(self, name: str, target, *args) -> None:
        t = threading.Thread(target=target, args=args, name=f"agent-{name}", daemon=True)
        t.start()
        self.threads.append(t)

    # -- life ----------------------------------------------------------------------------------

    def start(self) -> Agent:
        self.kubelet.start()
        for name in self.nodes:
            self._register(name)
            self._renew(name)
        self._thread("heartbeat", self._heartbeat)
        self._thread("pods", self._watch, self.core.list_pod_for_all_namespaces, self._on_pod)
        claims = threading.Event()
        self._thread("claims", self._watch,
                     self.core.list_persistent_volume_claim_for_all_namespaces, self._on_claim,
                     claims)
        self._thread("services", self._watch, self.core.list_service_for_all_namespaces,
                     lambda kind, svc: kind != "DELETED" and self._services(
                         svc["metadata"]["namespace"]))
        claims.wait(60)  # the claims that exist now are in state() (`up` prints them)
        return self

    def state(self) -> dict[str, Any]:
        """What ``state.json`` carries: nodes, PVC folders, where pods and controls live."""
        return {"volumes": dict(sorted(self.claims.items())),
                "agent": {"nodes": self.nodes, "pods": str(self.root / "pods"),
                          "control": str(self.root / "control"),
                          "hosts": str(self.hosts.path), "kubelet_port": self.kubelet.port}}

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every pod (SIGTERM, ``grace_s``, SIGKILL) and the agent's threads."""
        self.stopping.set()
        with self.lock:
            runners = list(self.runners.values())
        for r in runners:
            r.lost = True  # the cluster is going down: no more status reports
            r.delete(min(r.grace_s, grace_s))
        deadline = time.monotonic() + grace_s + 5
        for r in runners:
            r.finished.wait(max(0.0, deadline - time.monotonic()))
            r.kill(report=False)
        self.kubelet.stop()
        self.netns.stop()


def start_agent(cp: ControlPlane, nodes: int) -> Agent:
    """Register ``nodes`` Nodes and start running their pods (the supervisor calls this)."""
    return Agent(cp, nodes).start()
