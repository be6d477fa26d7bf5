"""Follow the logs of a job's worker pods, including pods that start late or restart.

``TrainingClient.get_job_logs(follow=True)`` follows only the pods that are already running when it
is called, so a worker that is scheduled later, restarted by the kubelet, or recreated by the
operator is never shown. :class:`PodLogFollower` instead watches the job's pods (a PyTorchJob's
by label ``training.kubeflow.org/job-name``, a TrainJob's by its JobSet's) and opens one
``follow`` log stream per container *instance* (pod uid + restart count), prefixing every line
with the replica (``[worker-1]``, ``[worker-1/r2]`` after two restarts). It keeps the last lines
of every pod for failure reports and feeds :class:`Progress` (the step/total a progress line
shows). Restarts are not read from log lines: the run's events count them (:mod:`.result`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client as k8s
from kubernetes import watch as k8s_watch
from kubernetes.client.rest import ApiException

from kfp_nvrx.components.launch.kube import calls
from kfp_nvrx.components.launch.kube.followed import JobPods
from kfp_nvrx.components.launch.kube.pods import (
    Ended,
    PodState,
    Progress,
    container_status,
    missing_objects,
    pod_restarts,
    prefix,
)

__all__ = ["Ended", "PodLogFollower", "PodState", "Progress"]

#: Pause after the first failed or empty pod watch, and the most it grows to.
WATCH_BACKOFF_S = (0.8, 30.0)


def _phase(pod: k8s.V1Pod) -> str:
    return (pod.status and pod.status.phase) or "Pending"


class PodLogFollower:
    """Streams every worker container's log with a replica prefix (see module docstring).

    Args:
        core: CoreV1Api of the cluster.
        namespace: The job's namespace.
        pods: Which pods are the job's, their container and how their replicas are named
            (:meth:`.followed.FollowedJob.pods`).
        emit: Called with each prefixed line (and pod status notes); must be thread-safe.
        watch_timeout_s: Length of one pod watch request (it is renewed until :meth:`stop`).

    """

    def __init__(self, core: k8s.CoreV1Api, namespace: str, pods: JobPods, *,
                 emit: Callable[[str], None], watch_timeout_s: int = 30) -> None:
        self.core = core
        self.namespace = namespace
        self.emit = emit
        self.job_name = pods.job
        self.container = pods.container
        self.watch_timeout_s = watch_timeout_s
        self.selector = pods.selector
        self.replica_name = pods.replica
        self.restart_of = pods.restart_of
        self.first_success_ends_job = pods.first_success_ends_job
        #: A pod of this admission exited 0: training completed (see first_success_ends_job).
        self._completed = False
        self.progress = Progress()
        self.pods: dict[str, PodState] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._streamed: set[tuple[str, int]] = set()
        self._streams: dict[tuple[str, int], tuple[threading.Thread, Any]] = {}
        self._watcher: threading.Thread | None = None
        self._error = ""
        #: Admission of each pod instance (uid): Kueue's preemption deletes the pods and its
        #: re-admission makes new ones, which are no restarts (:meth:`set_aside`).
        self._admission = 0
        self._admission_of: dict[str, int] = {}
        #: The job-wide restart that made each pod instance (JobPods.restart_of).
        self._restart_of: dict[str, int | None] = {}
        #: Set when a pod instance's exit is first seen (:class:`.follow.Follow` reads the job
        #: sooner then); cleared by its reader.
        self.exited = threading.Event()
        #: API requests of the pod watch and what they met (list, watch, bookmark, gone).
        self.requests: collections.Counter[str] = collections.Counter()

    # -- public ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start watching pods in a daemon thread."""
        self._watcher = threading.Thread(target=self._watch_loop, name="pod-watch", daemon=True)
        self._watcher.start()

    def stop(self, drain_s: float = 5.0) -> None:
        """Let open streams finish for up to ``drain_s`` seconds, then close them."""
        self._stop.set()
        deadline = time.monotonic() + drain_s
        for thread, _ in list(self._streams.values()):
            thread.join(max(0.0, deadline - time.monotonic()))
        for thread, resp in list(self._streams.values()):
            if thread.is_alive() and resp is not None:
                try:
                    resp.shutdown()  # interrupts the blocking read of a follow stream
                except Exception:  # noqa: BLE001 - best effort on a socket we are abandoning
                    pass
            thread.join(1.0)
        if self._watcher:
            self._watcher.join(1.0)

    def missing(self) -> list[str]:
        """What the pods wait for that does not exist (``PersistentVolumeClaim fsx``), sorted."""
        with self._lock:
            return sorted({m for p in self.pods.values() for m in p.waiting_on})

    def pod_restarts(self) -> int:
        """Container restarts plus restarts of the job's pods (:func:`.pods.pod_restarts`)."""
        with self._lock:
            return pod_restarts(self.pods.values(), self._admission_of, self._restart_of)

    def pod_restarts_whole(self) -> bool:
        """Whether :meth:`pod_restarts` holds those before this launcher followed the job.

        True where the job keeps its own count (a JobSet's restart attempt on its pods); a
        PyTorchJob pod the operator recreated before a launcher re-attached is not known.
        """
        with self._lock:
            return any(a is not None for a in self._restart_of.values())

    def set_aside(self) -> None:
        """Kueue evicted the job: its pods go, and pods of the next admission are no restarts.

        Their exits (a stop) never decide a failure (:meth:`failed_pod`).
        """
        with self._lock:
            self._admission += 1

    def failed_pod(self) -> Ended | None:
        """The pod instance whose exit decided a failure, if any exited non-zero.

        The pod whose trainer said the job's final verdict (``[trainer] gave up: ...``: the
        restart budget is spent) decides first, exited or not: its pod exits only once its agent
        has stopped, and meanwhile a peer that lost the gone rendezvous store fails with a c10d
        timeout and ends the job (issue 38 item 7: the launcher named that peer). Then a final
        exit (1..127: ft_launcher gave up, bad input; no policy retries it) decides over the
        exits a controller answers with a new pod (a signal, a stop, a lost peer, 200): in a
        PyTorchJob whose worker-1 gave up, worker-0 lost its peer and exited 200 first, and was
        recreated. Among equals, the earliest.
        """
        with self._lock:
            ended = [i for p in self.pods.values() for i in p.instances.values()
                     if (i.exit_code not in (None, 0) or (i.exit_code is None and i.verdict))
                     and self._admission_of.get(i.uid, 0) == self._admission]
        return min(ended, key=lambda i: (not i.verdict, not i.final,
                                         i.finished_at or float("inf"))) if ended else None

    def tail(self, pod_name: str, lines: int, uid: str = "") -> list[str]:
        """The last ``lines`` log lines streamed from ``pod_name`` (instance ``uid``: its own)."""
        with self._lock:
            pod = self.pods.get(pod_name)
            if pod is None:
                return []
            kept = [i.tail for i in pod.instances.values() if not uid or i.uid == uid]
            return [line for t in kept for line in t][-lines:]

    def last_lines(self, ended: Ended, lines: int) -> list[str]:
        """``ended``'s last lines: streamed, else read from the API while that pod is there.

        Never another instance's: a recreated pod of the same name has lines of its own.
        """
        tail = self.tail(ended.name, lines, ended.uid)
        if tail:
            return tail
        try:
            pod = self.core.read_namespaced_pod(ended.name, self.namespace,
                                                _request_timeout=calls.REQUEST_TIMEOUT)
            if pod.metadata.uid != ended.uid:
                return []
            text = self.core.read_namespaced_pod_log(
                ended.name, self.namespace, container=self.container, tail_lines=lines,
                _request_timeout=calls.REQUEST_TIMEOUT)
        except Exception:  # noqa: BLE001 - no log to show (gone, API unreachable): no tail
            return []
        return [t for t in (text or "").splitlines() if t]

    # -- pods -----------------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        """LIST once, then WATCH from the last resourceVersion seen, for as long as we follow.

        What keeps this from hot-looping the API (a Pending job used to cost a LIST and a WATCH
        every time a watch ended at once): a renewed watch resumes from the last
        resourceVersion instead of listing again (LIST only at start and after 410 Gone);
        ``allowWatchBookmarks`` lets the server move that resourceVersion on while nothing
        happens, so a resumed watch is rarely too old; and a watch that failed, or ended before
        half its length without delivering anything, is followed by an exponentially growing
        pause (client-go's reflector does the same: 0.8 s doubling to 30 s).
        """
        rv, pause = "", 0.0
        while not self._stop.is_set():
            started, delivered = time.monotonic(), False
            try:
                rv = rv or self._list()
                rv, delivered = self._watch(rv)
                self._error = ""
            except ApiException as err:
                if err.status == 410:  # our resourceVersion is older than the server keeps
                    self.requests["gone"] += 1
                    rv = ""
                else:
                    self._warn_once(err)
            except Exception as err:  # noqa: BLE001 - connection reset, server restarting
                self._warn_once(err)
            healthy = delivered or time.monotonic() - started >= self.watch_timeout_s / 2
            pause = 0.0 if healthy else min(max(2 * pause, WATCH_BACKOFF_S[0]),
                                            WATCH_BACKOFF_S[1])
            if pause:
                self._stop.wait(pause)

    def _list(self) -> str:
        """LIST the job's pods, take each in; the listing's resourceVersion."""
        self.requests["list"] += 1
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector,
                                             _request_timeout=calls.REQUEST_TIMEOUT)
        # A listing has no order in time: a pod that succeeded is taken first, as the watch
        # would have delivered it before the pods stopped after it.
        for pod in sorted(pods.items, key=lambda p: _phase(p) != "Succeeded"):
            self._on_pod(pod)
        return str(pods.metadata.resource_version or "")

    def _watch(self, rv: str) -> tuple[str, bool]:
        """One WATCH from ``rv``: the last resourceVersion seen, and whether it delivered any."""
        self.requests["watch"] += 1
        delivered, w = False, k8s_watch.Watch()
        for event in w.stream(self.core.list_namespaced_pod, self.namespace,
                              label_selector=self.selector, resource_version=rv,
                              allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s,
                              # silence past the server's own end: a dead connection
                              _request_timeout=(calls.REQUEST_TIMEOUT[0],
                                                self.watch_timeout_s + 30)):
            delivered = True
            raw = event.get("raw_object") or {}
            rv = (raw.get("metadata") or {}).get("resourceVersion") or rv
            if event["type"] == "BOOKMARK":
                self.requests["bookmark"] += 1
            elif event["type"] in ("ADDED", "MODIFIED"):
                self._on_pod(event["object"])
            if self._stop.is_set():
                w.stop()
        return rv, delivered

    def _warn_once(self, err: BaseException) -> None:
        """Say once what keeps the pod watch from working (until it works again)."""
        line = str(calls.describe(f"watching the pods of {self.job_name}", err,
                                    calls.host_of(getattr(self.core, "api_client", None))))
        if line != self._error:
            self._error = line
            self.emit(f"warning: {line} (retrying)")

    def _on_pod(self, pod: k8s.V1Pod) -> None:
        name, uid = pod.metadata.name, pod.metadata.uid
        status = container_status(pod, self.container)
        with self._lock:
            state = self.pods.setdefault(name, PodState(name=name,
                                                            replica=self.replica_name(pod)))
            if uid not in state.uids:
                state.uids.append(uid)
                self._admission_of[uid] = self._admission
                self._restart_of[uid] = self.restart_of(pod)
                if len(state.uids) > 1:
                    self._note(state, f"pod recreated by the operator (#{len(state.uids)})")
            phase = _phase(pod)
            if status is not None:
                self._record_exit(state, uid, status)
            if phase != state.phase:
                state.phase = phase
                self._note(state, self._phase_note(state, uid, phase))
            if phase == "Pending":  # a finished pod keeps its old PodScheduled condition
                self._note_unschedulable(state, pod)
            state.waiting_on = missing_objects(pod, self.container) if phase == "Pending" else []
            if status is None:
                return
            started = status.state and (status.state.running or status.state.terminated)
            key = (uid, state.restart_count)
            if not started or key in self._streamed or self._stop.is_set():
                return
            self._streamed.add(key)
        thread = threading.Thread(target=self._stream, args=(state, key, prefix(state, key[1])),
                                  name=f"log-{name}", daemon=True)
        thread.start()  # registered only once started: stop() may join it at any time
        self._streams.setdefault(key, (thread, None))

    def _record_exit(self, state: PodState, uid: str, status: Any) -> None:
        """The container's restart count and, once it ended, how (caller holds the lock)."""
        state.restart_count = status.restart_count or 0
        term = (status.state and status.state.terminated) or (
            status.last_state and status.last_state.terminated)
        if term is None or term.exit_code is None:
            return
        done = term.finished_at
        ended = state.instance(uid)
        if ended.exit_code is None:
            self.exited.set()  # the job's end may follow in a moment: its follow reads it soon
        ended.exit_code = state.exit_code = term.exit_code
        ended.exit_reason = state.exit_reason = term.reason or ""
        ended.finished_at = state.finished_at = done.timestamp() if done else time.time()
        if term.exit_code == 0 and self._admission_of.get(uid, 0) == self._admission:
            self._completed = self.first_success_ends_job

    def _phase_note(self, state: PodState, uid: str, phase: str) -> str:
        """How a pod's new phase reads: ``pod Failed`` only when it is one.

        Once a pod of a PyTorchJob exited 0 the job has succeeded, and the operator stops the
        pods still running (``cleanPodPolicy: Running``; they end 143 or 137, phase Failed); a
        pod that ends non-zero then (its peer, the rendezvous host, went away) fails nothing.
        The watch delivers the pod that succeeded first: the others were stopped after it.
        """
        if phase != "Failed" or not self._completed:
            return f"pod {phase}"
        code = state.instances[uid].exit_code if uid in state.instances else None
        return ("pod stopped after training completed"
                + (f" (exit {code})" if code is not None else "") + ", not a failure")

    def _note(self, state: PodState, text: str) -> None:
        if text != state.note:
            state.note = text
            self.emit(f"[{state.replica}] -- {text}")

    def _note_unschedulable(self, state: PodState, pod: k8s.V1Pod) -> None:
        for cond in (pod.status and pod.status.conditions) or []:
            if cond.type == "PodScheduled" and cond.status == "False" and cond.message:
                self._note(state, f"not scheduled: {cond.reason}: {cond.message}")

    # -- log streams ----------------------------------------------------------------------------

    def _line(self, state: PodState, uid: str, label: str, line: str) -> None:
        with self._lock:
            state.instance(uid).tail.append(line)
        self.progress.feed(line)
        self.emit(f"[{label}] {line}")

    def _previous(self, state: PodState, uid: str, label: str) -> None:
        """Emit the whole log of the container instance before the current one."""
        try:
            text = self.core.read_namespaced_pod_log(
                state.name, self.namespace, container=self.container, previous=True)
        except Exception:  # noqa: BLE001 - gone (kubelet GC) or the API unreachable: skip it
            return
        for line in filter(None, (text or "").splitlines()):
            self._line(state, uid, label, line)

    def _stream(self, state: PodState, key: tuple[str, int], label: str) -> None:
        uid, instance = key
        try:
            # Pod events can arrive late: the log endpoint serves the *current* container, so make
            # sure it is still the instance this stream is for.
            pod = self.core.read_namespaced_pod(state.name, self.namespace)
            status = container_status(pod, self.container)
            if pod.metadata.uid != uid or status is None:
                return  # replaced by a new pod; its own events start its stream
            current = status.restart_count or 0
            if current > instance:
                if current == instance + 1:  # the instance just before the current one
                    self._previous(state, uid, label)
                return
            with self._lock:
                missed = instance > 0 and (uid, instance - 1) not in self._streamed
                self._streamed.add((uid, instance - 1))
            if missed:  # it ran and ended between two of our pod reads: show it first
                self._previous(state, uid, prefix(state, instance - 1))
            resp = self.core.read_namespaced_pod_log(
                state.name, self.namespace, container=self.container, follow=True,
                _preload_content=False)
        except Exception:  # noqa: BLE001 - not a traceback from a log thread, whatever it is
            # Not ready to serve logs yet, gone, or the API server unreachable (restarting): let
            # the next pod event retry.
            with self._lock:
                self._streamed.discard(key)
            return
        self._streams[key] = (threading.current_thread(), resp)
        try:
            for line in k8s_watch.watch.iter_resp_lines(resp):
                self._line(state, uid, label, line)
        except Exception:  # noqa: BLE001 - stream cut (shutdown, pod deleted): nothing to add
            pass
        finally:
            resp.release_conn()
