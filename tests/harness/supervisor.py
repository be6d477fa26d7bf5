"""The one process that owns a test cluster: starts every component, reports, stops them all.

``python -m harness serve --dir D`` runs in the foreground until SIGTERM/SIGINT; ``up`` starts it
detached and waits for ``D/state.json`` to say ``ready``; ``down`` signals it and waits until every
component and port is gone. The components die with the supervisor even when it is SIGKILLed
(``PR_SET_PDEATHSIG``), so nothing outlives a cluster.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
import time
from pathlib import Path

from . import install, owner
from .controlplane import SYSTEM_NAMESPACE, USER_NAMESPACE, ControlPlane
from .procs import wait_until


class Lock:
    """An exclusive ``flock`` on ``D/lock`` held for the life of the supervisor."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            rec = owner.read_owner(root)
            who = f" ({owner.describe(rec)})" if rec else ""
            raise SystemExit(f"cluster: {root} is in use by a running cluster{who}; "
                             f"{owner.stop_hint(root)} from its checkout stops it") from None
        owner.claim(root)


class _Stopped(BaseException):
    """A stop signal arrived while the cluster was starting."""


class _Signals:
    """The supervisor's signals as events.

    SIGTERM/SIGINT/SIGHUP set ``stop`` (and abort a start-up still waiting on a component).
    SIGUSR1 asks for a kube-apiserver restart (tests of clients that must survive it); SIGUSR2
    the same, with etcd compacted while it is down. The restart is done in the supervisor's loop,
    where a component's exit is not mistaken for a death.
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.restart = threading.Event()
        self.compact = threading.Event()
        self.starting = True

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGUSR1, lambda *_: self.restart.set())
        signal.signal(signal.SIGUSR2, lambda *_: (self.compact.set(), self.restart.set()))

    def _on_stop(self, signum: int, _frame) -> None:
        self.stop.set()
        if self.starting:  # abort a start-up that is waiting on a component; `finally` stops all
            raise _Stopped(signal.Signals(signum).name)


def serve(root: Path, bins: Path, nodes: int = 0) -> int:
    """Start the cluster in ``root`` and keep it until a stop signal.

    Args:
        root: The run folder.
        bins: The binaries.
        nodes: Test nodes for the node agent (0: none).

    Returns:
        Exit status (0 after a clean stop, 1 if start-up failed).
    """
    lock = Lock(root)  # noqa: F841 - held until the process exits
    signals = _Signals()
    signals.install()
    owner.clean(root)  # an earlier cluster's etcd, agent control files, pods, volumes
    cp = ControlPlane(root, bins)
    agent = None
    status = 0
    try:
        t0 = time.monotonic()
        _start_control_plane(cp)
        if nodes:
            from .agent import start_agent

            agent = start_agent(cp, nodes)
            _wait_nodes_schedulable(cp, nodes)
        ready = {"ready": True, "supervisor": os.getpid(),
                 "startup_s": round(time.monotonic() - t0, 1), "apiserver_restarts": 0,
                 **(agent.state() if agent else {})}
        cp.write_state(ready)
        print(f"cluster: ready in {time.monotonic() - t0:.0f} s; KUBECONFIG={cp.kubeconfig}",
              flush=True)
        signals.starting = False
        status = _keep(cp, signals, ready)
    except _Stopped as e:
        print(f"cluster: start-up stopped by {e}", flush=True)
    except Exception as e:  # noqa: BLE001 - any start-up failure: report it, stop what started
        msg = f"{type(e).__name__}: {e}"
        cp.write_state({"ready": False, "failed": msg, "supervisor": os.getpid()})
        print(f"cluster: start-up failed: {msg}", flush=True)
        status = 1
    finally:
        if agent is not None:
            agent.stop()
        cp.stop()
        if status == 0:
            (root / "state.json").unlink(missing_ok=True)
    return status


def _start_control_plane(cp: ControlPlane) -> None:
    """etcd, the API server, what is installed in it, and every controller, in that order."""
    cp.start_etcd()
    cp.start_apiserver()
    install.namespaces(cp, [SYSTEM_NAMESPACE, USER_NAMESPACE])
    install.crds(cp)
    install.webhooks(cp)
    cp.start_kube_controllers()
    controllers = [cp.start_trainer(), cp.start_jobset(), cp.start_training_operator(),
                   cp.start_kueue()]
    cp.wait_controllers(controllers)
    install.upstream_runtimes(cp)
    install.ours(cp, USER_NAMESPACE)


def _keep(cp: ControlPlane, signals: _Signals, ready: dict) -> int:
    """Keep the cluster until a stop signal (0) or a component's death (1); restart on request."""
    while not signals.stop.wait(0.2 if signals.restart.is_set() else 1.0):
        if signals.restart.is_set():
            signals.restart.clear()
            cp.restart_apiserver(compact=signals.compact.is_set())
            signals.compact.clear()
            ready["apiserver_restarts"] += 1
            cp.write_state(ready)
        msg = next((m for p in cp.procs if (m := p.died()) is not None), None)
        if msg is not None:
            # A dead component is a broken cluster: say which and stop the rest.
            cp.write_state({"ready": False, "failed": msg, "supervisor": os.getpid()})
            print(f"cluster: {msg}", flush=True)
            signals.stop.set()
            return 1
    return 0


def _wait_nodes_schedulable(cp: ControlPlane, nodes: int, timeout_s: float = 120.0) -> None:
    """Ready means pods can land: every test node Ready and without the not-ready taint.

    The node lifecycle controller taints a node it saw before its first Ready status and lifts
    the taint on its next pass; a cluster called ready before that refuses to schedule.
    """
    from kubernetes import client, config

    core = client.CoreV1Api(config.new_client_from_config(config_file=str(cp.kubeconfig)))

    def schedulable() -> bool:
        items = core.list_node(_request_timeout=10).items
        return len(items) >= nodes and all(
            {c.type: c.status for c in n.status.conditions or []}.get("Ready") == "True"
            and not n.spec.taints for n in items)

    wait_until("test nodes schedulable", schedulable, timeout_s, cp.procs)


def read_state(root: Path) -> dict | None:
    """The state a supervisor wrote, or None."""
    try:
        return json.loads((root / "state.json").read_text())
    except (OSError, ValueError):
        return None
