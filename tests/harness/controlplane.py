"""A real Kubernetes control plane on 127.0.0.1 for the tests: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, the Kubeflow Trainer, JobSet and Training Operator
controllers, and Kueue (:mod:`.kueue`), all built from their Go modules (``make cluster-bins``).

Everything lives in one folder (``root``): certificates made for this run, each component's log,
etcd's data, the admin kubeconfig. Ports are picked free at start; webhooks are served by each
controller on loopback and registered with the run's CA by URL.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .pki import PKI, Leaf
from .procs import Proc, free_port, wait_until

#: The namespace the controllers run "in" (their Secrets, leases): Kubeflow's own.
SYSTEM_NAMESPACE = "kubeflow"
#: The pipeline namespace our images/deploy manifests default to (Kubeflow's example profile).
USER_NAMESPACE = "kubeflow-user-example-com"
#: How long one component may take to become ready on a loaded 2-core machine.
READY_S = 180.0


def bin_dir() -> Path | None:
    """The folder ``make cluster-bins`` built, or None when it was not built (or has no Go)."""
    env = os.environ.get("KFP_NVRX_CLUSTER_BINS")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    stamp = here / ".bins"  # written by build.sh: where this checkout's binaries are
    if stamp.is_file():
        path = Path(stamp.read_text().strip())
        if (path / "kube-apiserver").is_file():
            return path
    return None


@dataclass
class Endpoints:
    """The ports of one run, chosen free at start."""

    etcd: int = field(default_factory=free_port)
    etcd_peer: int = field(default_factory=free_port)
    apiserver: int = field(default_factory=free_port)
    kcm: int = field(default_factory=free_port)
    scheduler: int = field(default_factory=free_port)
    ports: dict[str, dict[str, int]] = field(default_factory=dict)

    def controller(self, name: str) -> dict[str, int]:
        """The webhook and health ports of one controller."""
        if name not in self.ports:
            self.ports[name] = {"webhook": free_port(), "health": free_port()}
        return self.ports[name]


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


class ControlPlane:
    """Start and stop the components, in dependency order.

    Args:
        root: The run folder (created; must not hold a running cluster).
        bins: Folder with the binaries.
    """

    def __init__(self, root: Path, bins: Path) -> None:
        self.root = root
        self.bins = bins
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pki = PKI(root / "pki")
        self.ep = Endpoints()
        self.procs: list[Proc] = []
        self.kubeconfig = root / "kubeconfig"
        self.manifests = bins.parent / "manifests"

    # -- helpers ---------------------------------------------------------------------------

    def _proc(self, name: str, argv: list[str], **kw) -> Proc:
        p = Proc(name, argv, self.logs, **kw).start()
        self.procs.append(p)
        return p

    def _https_ok(self, port: int, path: str, client: bool = True) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        if client:
            ctx.load_cert_chain(str(self.admin.cert), str(self.admin.key))
        else:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", context=ctx,
                                    timeout=5) as r:
            return r.status == 200

    @staticmethod
    def _http_ok(url: str) -> bool:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200

    def _kubeconfig_file(self) -> None:
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "kfp-nvrx-test",
            # Credentials inline: the file works wherever it is copied (a private /tmp too).
            "clusters": [{"name": "kfp-nvrx-test", "cluster": {
                "server": f"https://127.0.0.1:{self.ep.apiserver}",
                "certificate-authority-data": _b64(self.pki.ca.cert)}}],
            "users": [{"name": "admin", "user": {
                "client-certificate-data": _b64(self.admin.cert),
                "client-key-data": _b64(self.admin.key)}}],
            "contexts": [{"name": "kfp-nvrx-test", "context": {
                "cluster": "kfp-nvrx-test", "user": "admin", "namespace": USER_NAMESPACE}}],
        }
        self.kubeconfig.write_text(yaml.safe_dump(cfg))
        self.kubeconfig.chmod(0o600)

    # -- the components --------------------------------------------------------------------

    def start_etcd(self) -> None:
        ep = self.ep
        p = self._proc("etcd", [
            str(self.bins / "etcd"), "--name", "default", "--data-dir", str(self.root / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{ep.etcd}",
            "--advertise-client-urls", f"http://127.0.0.1:{ep.etcd}",
            "--listen-peer-urls", f"http://127.0.0.1:{ep.etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{ep.etcd_peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{ep.etcd_peer}",
            # A test cluster: no fsync (etcd's own test setting), a small backend.
            "--unsafe-no-fsync", "--quota-backend-bytes", str(2 << 30),
            "--log-level", "warn"])
        wait_until("etcd", lambda: self._http_ok(f"http://127.0.0.1:{ep.etcd}/health"),
                   READY_S, [p])

    def start_apiserver(self) -> None:
        pki, ep = self.pki, self.ep
        serving = pki.issue("apiserver", Leaf("kube-apiserver", ips=("127.0.0.1", "10.0.0.1"),
                                              dns=("localhost", "kubernetes", "kubernetes.default",
                                                   "kubernetes.default.svc",
                                                   "kubernetes.default.svc.cluster.local")))
        self.admin = pki.issue("admin", Leaf("kfp-nvrx-admin", organization="system:masters",
                                             server=False))
        self._kubeconfig_file()
        p = self._proc("kube-apiserver", [
            str(self.bins / "kube-apiserver"),
            "--etcd-servers", f"http://127.0.0.1:{ep.etcd}",
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(ep.apiserver),
            "--tls-cert-file", str(serving.cert), "--tls-private-key-file", str(serving.key),
            "--client-ca-file", str(pki.ca.cert),
            "--service-account-key-file", str(pki.sa_pub),
            "--service-account-signing-key-file", str(pki.sa_key),
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range", "10.0.0.0/24",
            "--authorization-mode", "Node,RBAC", "--allow-privileged=true",
            # Webhooks are registered by URL on loopback; the server must be allowed to call them.
            "--enable-admission-plugins", "NodeRestriction",
            "--cert-dir", str(self.root / "apiserver-certs"),
            # The loopback address cannot be the `kubernetes` Service's endpoint; nothing in
            # the tests reaches the API server through that Service.
            "--endpoint-reconciler-type", "none",
            # kcm and the scheduler read the front-proxy CA at start; none proxies here.
            "--requestheader-client-ca-file", str(pki.ca.cert),
            "--requestheader-allowed-names", "front-proxy-client",
            "--requestheader-username-headers", "X-Remote-User",
            "--requestheader-group-headers", "X-Remote-Group",
            "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
            # Requests of the user namespace's service accounts (the launcher's, in the tests
            # that run as it) land in logs/audit.log: the tests count what our code asks.
            "--audit-policy-file", str(self._audit_policy()),
            "--audit-log-path", str(self.audit_log), "--audit-log-format", "json",
            "--audit-log-maxsize", "100", "--audit-log-maxbackup", "1",
            "--v", "1"])
        wait_until("kube-apiserver", lambda: self._https_ok(ep.apiserver, "/readyz"),
                   READY_S, [p])

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (requests of the user namespace's service accounts)."""
        return self.logs / "audit.log"

    def _audit_policy(self) -> Path:
        policy = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                  "omitStages": ["RequestReceived"],
                  "rules": [{"level": "Metadata",
                             "userGroups": [f"system:serviceaccounts:{USER_NAMESPACE}"]},
                            {"level": "None"}]}
        path = self.root / "audit-policy.yaml"
        path.write_text(yaml.safe_dump(policy))
        return path

    def restart_apiserver(self, compact: bool = False) -> None:
        """Stop kube-apiserver and start it again on the same port with the same flags.

        etcd keeps every object; clients see what a control-plane restart does to them: open
        watches and connections cut, refused connections for a while, then a fresh watch cache.
        With ``compact``, etcd moves on and is compacted while the API server is down, so every
        resourceVersion a client saw before is gone for certain: its next watch gets 410 Gone.
        """
        old = next(p for p in self.procs if p.name == "kube-apiserver")
        old.stop()
        if compact:
            put = self._etcd("/v3/kv/put", {"key": base64.b64encode(b"/kfp-nvrx-test/restart")
                                            .decode(), "value": ""})
            self._etcd("/v3/kv/compaction", {"revision": put["header"]["revision"]})
        new = Proc(old.name, old.argv, self.logs, env=old.env).start()
        self.procs[self.procs.index(old)] = new
        wait_until("kube-apiserver", lambda: self._https_ok(self.ep.apiserver, "/readyz"),
                   READY_S, [new])

    def _etcd(self, path: str, body: dict) -> dict:
        """One call to etcd's v3 HTTP gateway."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.ep.etcd}{path}", method="POST",
                                     data=json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)

    def start_kube_controllers(self) -> None:
        ep, kc = self.ep, str(self.kubeconfig)
        kcm = self._proc("kube-controller-manager", [
            str(self.bins / "kube-controller-manager"), "--kubeconfig", kc,
            "--authentication-kubeconfig", kc, "--authorization-kubeconfig", kc,
            "--bind-address", "127.0.0.1", "--secure-port", str(ep.kcm),
            "--leader-elect=false", "--use-service-account-credentials=false",
            "--service-account-private-key-file", str(self.pki.sa_key),
            "--root-ca-file", str(self.pki.ca.cert),
            # No cloud, no node IPAM: the test nodes carry no pod CIDRs.
            "--controllers", "*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-route",
            "--cluster-signing-cert-file", str(self.pki.ca.cert),
            "--cluster-signing-key-file", str(self.pki.ca.key), "--v", "1"])
        sched = self._proc("kube-scheduler", [
            str(self.bins / "kube-scheduler"), "--kubeconfig", kc,
            "--authentication-kubeconfig", kc, "--authorization-kubeconfig", kc,
            "--bind-address", "127.0.0.1", "--secure-port", str(ep.scheduler),
            "--leader-elect=false", "--v", "1"])
        for p, port in ((kcm, ep.kcm), (sched, ep.scheduler)):
            wait_until(p.name, lambda port=port: self._https_ok(port, "/healthz", client=False),
                       READY_S, [p])

    def webhook_certs(self, name: str, dns: tuple[str, ...] = ()) -> Path:
        """Serving cert for one controller's webhook server, in controller-runtime's layout."""
        folder = self.root / name / "tmp" / "k8s-webhook-server" / "serving-certs"
        self.pki.issue(f"{name}-webhook", Leaf(name, ips=("127.0.0.1",), dns=("localhost", *dns)),
                       folder=folder, cert_file="tls.crt", key_file="tls.key")
        return folder

    def _manager_config(self, name: str, api_version: str, webhook: dict, **extra) -> Path:
        """A controller-runtime manager's Configuration file: probes and webhooks on loopback
        ports of this run, no metrics server, no leader election (one replica)."""
        ports = self.ep.controller(name)
        config = {
            "apiVersion": api_version, "kind": "Configuration",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['health']}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": ports["webhook"], "host": "127.0.0.1", **webhook},
            "leaderElection": {"leaderElect": False}, **extra,
        }
        path = self.root / name / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start_trainer(self) -> Proc:
        certs = self.webhook_certs("trainer")
        cfg = self._manager_config("trainer", "config.trainer.kubeflow.org/v1alpha1", {},
                                   # Certificates come from this run's CA, not the controller's
                                   # own rotation.
                                   certManagement={"enable": False})
        return self._proc("trainer-controller-manager", [
            str(self.bins / "trainer-controller-manager"), "--config", str(cfg)],
            env={"KUBECONFIG": str(self.kubeconfig), "TMPDIR": str(certs.parents[1])})

    def start_jobset(self) -> Proc:
        certs = self.webhook_certs("jobset")
        cfg = self._manager_config("jobset", "config.jobset.x-k8s.io/v1alpha1",
                                   {"certDir": str(certs)},
                                   internalCertManagement={"enable": False})
        return self._proc("jobset-controller", [
            str(self.bins / "jobset-controller"), "--config", str(cfg)],
            env={"KUBECONFIG": str(self.kubeconfig)})

    def start_training_operator(self) -> Proc:
        ports = self.ep.controller("training-operator")
        dns = f"training-operator.{SYSTEM_NAMESPACE}.svc"
        certs = self.webhook_certs("training-operator", dns=(dns,))
        # Its cert rotator always runs: hand it a valid Secret made by our CA (it keeps a valid
        # one) and give it a private /tmp, where it writes the certs at a fixed path.
        self._create_secret_for_rotator(certs)
        private_tmp = certs.parents[1]
        shutil.copy(self.kubeconfig, private_tmp / "kubeconfig")
        # The binary goes in too: a bin cache under /tmp (KFP_NVRX_CLUSTER_CACHE=/tmp/...) is
        # hidden once the private /tmp is mounted over it (exit 127, "not found").
        binary = private_tmp / "training-operator"
        if not binary.exists():  # a restart of the operator finds it there
            try:
                os.link(self.bins / "training-operator", binary)
            except OSError:  # another file system
                shutil.copy2(self.bins / "training-operator", binary)
        wrapper = 'mount --bind "$0" /tmp && exec "$@"'
        return self._proc("training-operator", [
            "unshare", "--mount", "--propagation", "private", "sh", "-c", wrapper,
            str(private_tmp), "/tmp/training-operator",
            "--metrics-bind-address", "0",
            "--health-probe-bind-address", f"127.0.0.1:{ports['health']}",
            "--webhook-server-port", str(ports["webhook"]),
            "--enable-scheme", "pytorchjob"],
            env={"KUBECONFIG": "/tmp/kubeconfig", "MY_POD_NAMESPACE": SYSTEM_NAMESPACE})

    def start_kueue(self) -> Proc:
        """Kueue's controller manager (:mod:`.kueue`)."""
        from . import kueue

        return kueue.start(self)

    def _create_secret_for_rotator(self, certs: Path) -> None:
        from . import install

        data = {"ca.crt": self.pki.ca.cert.read_bytes(), "ca.key": self.pki.ca.key.read_bytes(),
                "tls.crt": (certs / "tls.crt").read_bytes(),
                "tls.key": (certs / "tls.key").read_bytes()}
        install.secret(self, SYSTEM_NAMESPACE, "training-operator-webhook-cert", data)

    def wait_controllers(self, procs: list[Proc]) -> None:
        """Wait until each Kubeflow controller's readiness probe (webhook server up) passes."""
        names = {"trainer-controller-manager": "trainer", "jobset-controller": "jobset",
                 "training-operator": "training-operator", "kueue": "kueue"}
        for p in procs:
            port = self.ep.controller(names[p.name])["health"]
            wait_until(p.name, lambda port=port: self._http_ok(
                f"http://127.0.0.1:{port}/readyz"), READY_S, [p])

    def stop(self) -> None:
        """Stop every component, newest first."""
        for p in reversed(self.procs):
            p.stop()

    def state(self) -> dict:
        """What a client needs: the kubeconfig, the ports, every component's pid and log."""
        return {"kubeconfig": str(self.kubeconfig), "apiserver": self.ep.apiserver,
                "etcd": self.ep.etcd, "root": str(self.root),
                "components": {p.name: {"pid": p.pid, "log": str(p.log)} for p in self.procs},
                "ports": [self.ep.etcd, self.ep.etcd_peer, self.ep.apiserver, self.ep.kcm,
                          self.ep.scheduler]
                + [v for c in self.ep.ports.values() for v in c.values()]}

    def write_state(self, extra: dict | None = None) -> None:
        """Write ``state.json`` (atomically) for the CLI and the tests."""
        tmp = self.root / "state.json.tmp"
        tmp.write_text(json.dumps({**self.state(), **(extra or {})}, indent=1))
        os.replace(tmp, self.root / "state.json")
