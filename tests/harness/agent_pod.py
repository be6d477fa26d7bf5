"""One pod on a test node: its containers run as local processes, its status goes to the API server.

A pod's life here, as a kubelet would live it:

1. The agent sees the pod bound to one of its nodes and starts a :class:`PodRunner` thread.
2. The runner gives the pod an address (``127.0.0.x``, stable per hostname or pod name, so a
   recreated pod keeps its DNS entry) and reports ``Pending`` with ``podIP``; init containers run
   one after the other, then every container starts (``Running``).
3. Each container is ``unshare --pid --fork --kill-child --mount-proc --mount --uts`` inside the
   cluster's network namespace (``nsenter --net``, :mod:`.agent_hosts`): its own PID
   namespace (nothing it starts outlives it), a private mount namespace in which the cluster hosts
   file covers ``/etc/hosts``, volumes are bind-mounted at their paths and ``/tmp`` and
   ``/dev/shm`` are per container, and the pod's hostname. :mod:`.pod_init` is its PID 1.
4. A container that exits is reported ``terminated`` with its exit code (128 + signal when
   killed); ``OnFailure``/``Always`` restart it in place (``restartCount``, ``lastState``, a short
   back-off), ``Never`` leaves it. The pod ends ``Succeeded`` or ``Failed``.
5. A deletion (``deletionTimestamp``) sends SIGTERM to each container's PID 1, waits up to the
   grace period, SIGKILLs the rest, reports the terminal phase and removes the pod object
   (grace 0, uid precondition), as the kubelet does.

Every process is started from the runner thread that waits on it and carries ``PR_SET_PDEATHSIG``
(the signal fires when that *thread* ends), so a dying agent takes its pods with it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .agent_env import ConfigError, container_argv, container_env
from .procs import _die_with_parent, start_time, tail

if TYPE_CHECKING:
    from .agent import Agent

POD_INIT = Path(__file__).resolve().parent / "pod_init.py"
#: What every container runs from the host: this checkout (pod_init, the editable install's
#: sources) and the interpreter's environment. Under /tmp (a CI clone there) the pod's private
#: /tmp would hide them; they are bound back in at the same paths.
HOST_PATHS = tuple(sorted({Path(__file__).resolve().parents[2], Path(sys.prefix).resolve()}))
#: Restart back-off: the kubelet's is 10 s doubling to 5 min; tests want it short.
BACKOFF_S = (1.0, 2.0, 4.0, 8.0)
#: Volumes the agent does not mount (the service-account token: nothing here reads it).
SKIPPED_VOLUMES = ("projected",)


def now() -> str:
    """RFC 3339 UTC time, as the API writes it."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _under_tmp(paths: tuple[Path, ...]) -> list[Path]:
    """The paths below /tmp, none inside another (binding the outer one brings it along)."""
    tmp = [p for p in paths if p.is_relative_to("/tmp") and p != Path("/tmp")]
    return [p for p in tmp if not any(q != p and p.is_relative_to(q) for q in tmp)]


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Container:
    """The state of one container of the pod (what ``containerStatuses[]`` reports)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.name = spec["name"]
        self.restarts = 0
        self.state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self.last: dict[str, Any] = {}
        self.popen: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None

    def status(self) -> dict[str, Any]:
        running = "running" in self.state
        return {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
                "containerID": f"agent://{self.popen.pid}" if self.popen else "",
                "ready": running, "started": running, "restartCount": self.restarts,
                "state": self.state, "lastState": self.last}


class PodRunner:
    """Run one pod; see the module docstring.

    Args:
        agent: The node agent (API calls, addresses, hosts file, volumes).
        pod: The pod as first seen (bound to ``node``).
        node: The node it is bound to.
    """

    def __init__(self, agent: Agent, pod: dict[str, Any], node: str) -> None:
        self.agent, self.pod, self.node = agent, pod, node
        meta, spec = pod["metadata"], pod["spec"]
        self.ns, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.hostname = spec.get("hostname") or self.name
        self.dir = agent.root / "pods" / self.uid
        self.policy = spec.get("restartPolicy", "Always")
        self.init = [Container(c) for c in spec.get("initContainers") or []]
        self.containers = [Container(c) for c in spec["containers"]]
        self.lock = threading.Lock()
        self.deleting = threading.Event()
        self.lost = False  # node lost: no more status reports
        self.grace_s = float(spec.get("terminationGracePeriodSeconds", 30))
        self.phase = "Pending"
        self.ip = ""
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"pod-{self.name}", daemon=True)

    # -- control from the agent -------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def delete(self, grace_s: float | None) -> None:
        """The pod got a ``deletionTimestamp``: stop within ``grace_s``."""
        if grace_s is not None:
            self.grace_s = grace_s
        if not self.deleting.is_set():
            self.deleting.set()
            threading.Thread(target=self._terminate, daemon=True).start()

    def kill(self, report: bool = True) -> None:
        """SIGKILL every container now (node lost, pod object gone, agent stopping)."""
        self.lost = self.lost or not report
        self.deleting.set()
        for c in self.init + self.containers:
            self._signal(c, signal.SIGKILL)

    # -- the pod's life ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.ip = self.agent.address(self.pod)
            self.pod.setdefault("status", {}).update(
                {"podIP": self.ip, "podIPs": [{"ip": self.ip}], "hostIP": "127.0.0.1",
                 "hostIPs": [{"ip": "127.0.0.1"}]})
            self.agent.pod_started(self)
            self._report(started=True)
            for c in self.init:
                if self._run_container(c, init=True) != 0:
                    self._finish()
                    return
            threads = [threading.Thread(target=self._run_container, args=(c,), daemon=True,
                                        name=f"ctr-{self.name}-{c.name}")
                       for c in self.containers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self._finish()
        except Exception as e:  # noqa: BLE001 - a broken runner must say so, not vanish
            print(f"agent: pod {self.ns}/{self.name}: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
            self.finished.set()

    def _run_container(self, c: Container, init: bool = False) -> int:
        """Run ``c`` (restarting it by the pod's policy); return its last exit code."""
        while True:
            code = self._run_once(c)
            if self.deleting.is_set():
                return code
            again = (not init and self.policy == "Always") or (
                self.policy in ("Always", "OnFailure") and code != 0)
            if not again:
                return code
            delay = BACKOFF_S[min(c.restarts, len(BACKOFF_S) - 1)]
            with self.lock:
                c.last, c.state = c.state, {"waiting": {"reason": "CrashLoopBackOff",
                                                        "message": f"back-off {delay:.0f}s"}}
                c.restarts += 1
            self._report()
            if self.deleting.wait(delay):
                return code

    def _run_once(self, c: Container) -> int:
        while True:
            try:
                env = container_env(self.pod, c.spec, self.agent.lookup, self.agent.allocatable,
                                    self.hostname)
                argv = container_argv(c.spec, env)
                script = self._setup_script(c)
                break
            except ConfigError as e:
                with self.lock:
                    c.state = {"waiting": {"reason": "CreateContainerConfigError",
                                           "message": str(e)}}
                self._report()
                # The kubelet retries until the reference appears (or the pod is deleted).
                if self.deleting.wait(2.0):
                    return 0
        env.setdefault("TMPDIR", "/tmp")
        log = self.log_path(c.name, c.restarts)
        log.parent.mkdir(parents=True, exist_ok=True)
        started = now()
        with open(log, "ab") as out, self.lock:
            if self.deleting.is_set():
                return 0
            c.popen = subprocess.Popen(
                [*self.agent.netns.enter(),
                 "unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount",
                 "--uts", "--propagation", "private", "/bin/sh", "-c", script, "sh",
                 sys.executable, str(POD_INIT), *argv],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True, preexec_fn=_die_with_parent)
            c.state = {"running": {"startedAt": started}}
            c.exit_code = None
        self._write_pids()
        self._report()
        rc = c.popen.wait()
        code = rc if rc >= 0 else 128 - rc
        with self.lock:
            c.exit_code = code
            term: dict[str, Any] = {"exitCode": code, "reason": "Completed" if code == 0
                                    else "Error", "startedAt": started, "finishedAt": now(),
                                    "containerID": f"agent://{c.popen.pid}"}
            if code >= 128:
                term["signal"] = code - 128
            if code and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
                term["message"] = tail(log, 80)[-4096:]
            c.state = {"terminated": term}
        self._report()
        return code

    def _setup_script(self, c: Container) -> str:
        """The shell lines run inside the new namespaces before PID 1 starts."""
        q = shlex.quote
        lines = ["set -e", f"/bin/hostname {q(self.hostname)}",
                 f"/bin/mount --bind {q(str(self.agent.hosts.path))} /etc/hosts"]
        cdir = self.dir / "containers" / c.name
        mounts = self._mounts(c) + [(cdir / "shm", "/dev/shm", False)]
        # /tmp last: the sources (the cluster folder) may live under /tmp.
        later = [m for m in mounts if m[1] == "/tmp" or m[1].startswith("/tmp/")]
        if not any(m[1] == "/tmp" for m in later):
            later.insert(0, (cdir / "tmp", "/tmp", False))
        later += [(h, str(h), False) for h in _under_tmp(HOST_PATHS)]
        if any(str(src).startswith("/tmp/") for src, dst, _ in later if dst != "/tmp"):
            # The pod's own /tmp covers the real one, where these sources live (a cluster dir
            # under /tmp): keep the real /tmp reachable at /mnt, inside this pod only.
            lines.append("/bin/mount --rbind /tmp /mnt")
        tmp_mounted = False
        for src, dst, ro in [m for m in mounts if m not in later] + later:
            Path(src).mkdir(parents=True, exist_ok=True) if not Path(src).is_file() else None
            source = str(src)
            if tmp_mounted and source.startswith("/tmp/"):
                source = "/mnt" + source[len("/tmp"):]
            lines.append(f"/bin/mkdir -p {q(dst)}")
            lines.append(f"/bin/mount --bind {q(source)} {q(dst)}")
            tmp_mounted = tmp_mounted or dst == "/tmp"
            if ro:
                lines.append(f"/bin/mount -o remount,bind,ro {q(dst)}")
        lines.append(f"cd {q(c.spec.get('workingDir') or '/')}")
        lines.append('exec "$@"')
        return "\n".join(lines)

    def _mounts(self, c: Container) -> list[tuple[Path, str, bool]]:
        vols = {v["name"]: v for v in self.pod["spec"].get("volumes") or []}
        out = []
        for m in c.spec.get("volumeMounts") or []:
            vol = vols.get(m["name"])
            if vol is None or any(k in vol for k in SKIPPED_VOLUMES):
                continue
            src = self._volume_folder(vol)
            if m.get("subPath"):
                src = src / m["subPath"]
            out.append((src, m["mountPath"], bool(m.get("readOnly"))))
        return out

    def _volume_folder(self, vol: dict[str, Any]) -> Path:
        if "persistentVolumeClaim" in vol:
            return self.agent.claim_folder(self.ns, vol["persistentVolumeClaim"]["claimName"])
        if "hostPath" in vol:
            return Path(vol["hostPath"]["path"])
        folder = self.dir / "volumes" / vol["name"]
        folder.mkdir(parents=True, exist_ok=True)
        for kind, key in (("configmap", "configMap"), ("secret", "secret")):
            if key in vol:
                name = vol[key].get("name") or vol[key].get("secretName")
                data = self.agent.lookup(kind, self.ns, name) or {}
                for k, v in data.items():
                    (folder / k).write_text(v)
        return folder  # emptyDir (medium Memory too: a per-pod folder)

    def _write_pids(self) -> None:
        """``<pod dir>/pids.json``: each container's process group (what a drill kills), with
        its leader's start time: the record outlives the processes, and on a busy machine
        (pid_max 32768) their pids soon name others."""
        pids = {c.name: {"pgid": c.popen.pid, "started": start_time(c.popen.pid),
                         "restart": c.restarts}
                for c in self.init + self.containers if c.popen and c.exit_code is None}
        tmp = self.dir / "pids.json.tmp"
        tmp.write_text(json.dumps({"namespace": self.ns, "name": self.name, "node": self.node,
                                   "containers": pids}))
        os.replace(tmp, self.dir / "pids.json")

    def log_path(self, container: str, restart: int) -> Path:
        """The log file of one container instance."""
        return self.dir / "logs" / container / f"{restart}.log"

    def container(self, name: str) -> Container | None:
        return next((c for c in self.init + self.containers if c.name == name), None)

    # -- stopping ------------------------------------------------------------------------------

    def _signal(self, c: Container, sig: int) -> None:
        p = c.popen
        if p is None or p.poll() is not None:
            return
        try:
            if sig == signal.SIGKILL:
                os.killpg(p.pid, sig)  # unshare and PID 1: --kill-child takes the namespace
            else:
                for child in _children(p.pid) or [p.pid]:
                    os.kill(child, sig)  # PID 1 of the container forwards it to the command
        except ProcessLookupError:
            pass

    def _terminate(self) -> None:
        for c in self.init + self.containers:
            self._signal(c, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(
                c.popen and c.popen.poll() is None for c in self.init + self.containers):
            time.sleep(0.1)
        for c in self.init + self.containers:
            self._signal(c, signal.SIGKILL)

    def _finish(self) -> None:
        codes = [c.exit_code for c in self.containers]
        ok = all(code == 0 for code in codes)
        self.phase = "Succeeded" if ok else "Failed"
        self._report()
        self.finished.set()
        if self.deleting.is_set() and not self.lost:
            self.agent.remove_pod(self)

    def cleanup(self) -> None:
        """The pod object is gone: its emptyDirs, /tmp and /dev/shm go too (logs stay)."""
        for sub in ("volumes", "containers"):
            shutil.rmtree(self.dir / sub, ignore_errors=True)

    # -- status ----------------------------------------------------------------------------------

    def _report(self, started: bool = False) -> None:
        if self.lost:
            return
        with self.lock:
            running = any("running" in c.state for c in self.containers)
            if self.phase == "Pending" and running:
                self.phase = "Running"
            ready = self.phase == "Running" and all("running" in c.state
                                                    for c in self.containers)
            t = now()
            conds = [{"type": "PodScheduled", "status": "True"},
                     {"type": "Initialized", "status": "True" if running or self.phase not in
                      ("Pending",) else "False"},
                     {"type": "ContainersReady", "status": str(ready)},
                     {"type": "Ready", "status": str(ready)}]
            for cond in conds:
                cond["lastTransitionTime"] = t
                if self.phase in ("Succeeded", "Failed") and cond["type"] != "PodScheduled":
                    cond["status"], cond["reason"] = "False", "PodCompleted"
            status: dict[str, Any] = {
                "phase": self.phase, "conditions": conds,
                "containerStatuses": [c.status() for c in self.containers]}
            if self.init:
                status["initContainerStatuses"] = [c.status() for c in self.init]
            if started:
                status.update({"startTime": t, "podIP": self.ip, "podIPs": [{"ip": self.ip}],
                               "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}]})
        self.agent.patch_status(self, status)
