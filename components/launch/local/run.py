"""The ``local`` backend: N ``ft_launcher`` agents on this machine, as a PyTorchJob would run them.

Each agent gets the ``PET_*`` environment the Training Operator injects into a pod of a PyTorchJob
with an ``elasticPolicy``, and the command line comes from :func:`launch_command.ft_launcher_argv`,
the same builder the pod spec uses. Output is streamed with a ``[nodeK]`` prefix (:mod:`.agent`);
SIGINT/SIGTERM or a deadline stop every agent and every worker they started (nothing is left
running: the run-dir lock and the watchdog of :mod:`.lifetime`).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from kfp_nvrx.components.core.events import End, Event, read_events
from kfp_nvrx.components.core.exits import BUDGET_SPENT
from kfp_nvrx.components.core.host_copy import NODE_ENV, remove_run_copy
from kfp_nvrx.components.core.launch_command import (
    FtLauncher,
    agent_env,
    ft_launcher_argv,
    in_process_env,
    pet_env,
    term_timeout_s,
)
from kfp_nvrx.components.core.ownership import claim_run_dir
from kfp_nvrx.components.core.pod_entry import quiet_warnings
from kfp_nvrx.components.core.rundir import LOGS_DIR
from kfp_nvrx.components.core.shm_leftovers import remove_new_semaphores, semaphores, snapshot
from kfp_nvrx.components.core.stop_request import (
    SAVE_MARGIN_S,
    STOP_FILE_ENV,
    request_stop,
    stop_file,
)
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
from kfp_nvrx.components.launch.local.agent import Agent, NodeOutput
from kfp_nvrx.components.launch.local.gpus import slice_gpus
from kfp_nvrx.components.launch.local.lifetime import (
    RunDirLock,
    Watchdog,
    processes_with_env,
    stop_leftovers,
)
from kfp_nvrx.components.launch.local.preflight import ft_launcher, preflight
from kfp_nvrx.components.launch.local.shm_sweep import SNAPSHOT_FILE, STOPS_PREFIX, sweep_previous
from kfp_nvrx.components.launch.result import LaunchResult, account

_MARKER = "KFP_NVRX_LOCAL_RUN"
#: The signals that cancel a run (SIGHUP: the terminal closed; it must not train unattended).
_CANCEL = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def free_port() -> int:
    """A TCP port on localhost that is free now (rendezvous and test process groups)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reap(marker: str) -> int:
    """Kills any process still carrying this run's marker in its environment."""
    killed = 0
    for pid in processes_with_env(_MARKER, marker):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:  # gone meanwhile
            continue
    return killed


class LocalRun:
    """One run of a resolved job on localhost, from its checks to its result.

    Uses the trainer part of the job: its node range (MAX ft_launcher agents are started),
    workers per agent, run directory, config, overrides, faults and env; its name is also the
    rendezvous id.

    Args:
        job: The job, resolved for the ``local`` backend (or for Kubernetes: the pod is unused).
        log: Where streamed output goes.
        deadline_s: Wall-clock limit; exceeded -> agents stopped, state ``DeadlineExceeded``.
        verbose: Stream every launcher line (default: trainer lines and errors only).
        on_start: Called once with the agents' PIDs, node 0 first, after all were started
            (:mod:`.agent`: each leads its own process group; the fault drills kill them).

    Raises:
        UserError: ``deadline_s`` is not a finite number of seconds > 0.
    """

    def __init__(self, job: ResolvedJob, *, log: Callable[[str], None] = print,
                 deadline_s: float | None = None, verbose: bool = False,
                 on_start: Callable[[list[int]], None] | None = None) -> None:
        if deadline_s is not None and not (math.isfinite(deadline_s) and deadline_s > 0):
            raise UserError("deadline_s",
                            f"must be a finite number of seconds > 0, got {deadline_s}")
        self.job, self.log, self.deadline_s = job, log, deadline_s
        self.verbose, self.on_start = verbose, on_start
        self.run_path = Path(job.run_dir).resolve()
        self.marker = uuid.uuid4().hex
        self.grace = term_timeout_s(job.config.resilience) + 10
        self.state, self.reason = "Running", ""
        self.received: dict[str, int] = {}
        self.agents: list[Agent] = []
        self._stop = threading.Event()
        #: The watchdog's sweep (run dir, /dev/shm snapshot of the run's start), once taken.
        self.sweep: tuple[str, str] | tuple[()] = ()

    def run(self) -> LaunchResult:
        """Check, start the agents, follow them to the end, stop everything they left.

        Returns:
            The LaunchResult (``Succeeded``, ``Failed``, ``Cancelled`` or ``DeadlineExceeded``).

        Raises:
            UserError: Bad input, before anything is started.
        """
        job = self.job
        # train.device=cuda on a host without GPUs fails here, naming train.device, before anything.
        slices = slice_gpus(job.max_nodes, job.procs_per_node, job.config.train.device)
        trainer = job.trainer_args()
        preflight(trainer, dict(job.user_env))
        trainer.run_dir = str(self.run_path)
        argv = ft_launcher_argv(job.config.resilience, trainer, local_addr="127.0.0.1",
                                launcher=FtLauncher(ft_launcher()))
        env = self._base_env(free_port())
        lock = self._take_run_dir()
        # FT: each node's stop request (core.stop_request): a cancelled run, or one past its
        # deadline, lets its workers save first; a failed one stops them at once.
        stops = Path(tempfile.mkdtemp(prefix=STOPS_PREFIX))
        # What /dev/shm held before the run: the semaphores its processes leak are the others.
        shm_before = semaphores()
        snapshot(stops / SNAPSHOT_FILE)
        self.sweep = (str(self.run_path), str(stops / SNAPSHOT_FILE))
        lock.note(stops=str(stops))  # FT: the next launch sweeps if this one dies whole
        # Stops everything of this run if the launcher itself dies (SIGKILL included), then
        # removes what the run left in /dev/shm; it holds the lock until then. If the watchdog
        # dies first, the loop starts a new one.
        watchdog = Watchdog(f"{_MARKER}={self.marker}", self.grace, keep_fds=(lock.held(),),
                            sweep=self.sweep)
        self.log(f"[launch-local] {job.name}: {job.max_nodes} node(s) x {job.procs_per_node} "
                 f"proc, run dir {self.run_path}")
        started = time.time()
        old = self._catch_signals()
        try:
            self._start_agents(argv, env, slices, stops, lock)
            watchdog = self._follow(started, watchdog, lock)
        finally:
            leftovers = self._stop_agents(stops)
            # Every worker is gone: the run's node-local host copy (up to two banks of each
            # rank's state in /dev/shm) would hold that RAM until some later run swept it. Ours
            # to delete while we hold the run dir (a relaunch resumes from the commits).
            remove_run_copy(self.run_path)
            remove_new_semaphores(shm_before)  # a straggler's own stay mapped: the watchdog's
            shutil.rmtree(stops, ignore_errors=True)
            watchdog.finish()
            lock.release()
            for sig, handler in old.items():
                signal.signal(sig, handler)
        return self._result(started, argv, leftovers)

    # -- before the agents ----------------------------------------------------------------------

    def _base_env(self, port: int) -> dict[str, str]:
        """Every agent's environment: ours, the user's, and the ``PET_*`` a pod gets."""
        job, user = self.job, dict(self.job.user_env)
        lo, hi, procs = job.min_nodes, job.max_nodes, job.procs_per_node
        threads = max(1, (os.cpu_count() or 1) // (hi * procs))
        return {**os.environ, **user, _MARKER: self.marker, "PYTHONUNBUFFERED": "1",
                "PYTHONWARNINGS": quiet_warnings({**os.environ, **user}),
                # NVRx >= 0.6 closes the rendezvous when two agents share a host unless told
                # this is deliberate (local "nodes" are agents on one machine).
                "NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE": "1",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
                **pet_env(nnodes=f"{lo}:{hi}" if lo != hi else str(hi), nproc_per_node=procs,
                          rdzv_endpoint=f"127.0.0.1:{port}",
                          rdzv_id=f"{job.name}-{self.marker[:8]}",
                          max_restarts=job.config.resilience.max_restarts)}

    def _take_run_dir(self) -> RunDirLock:
        """Claim and lock the run dir, stop what the run before left, make the logs folder."""
        claim_run_dir(self.run_path)
        # One run owns a run dir at a time; taken before anything is written into it, so a
        # launch refused for a run dir in use leaves it as it was.
        lock = RunDirLock(self.run_path).acquire(self.marker)
        # Held: no launcher, watchdog or agent of the run before lives. What else it left (it
        # died whole, its watchdog too) would go on beside this run; stopped before anything.
        left = stop_leftovers(lock.previous, _MARKER)
        if left:
            self.log(f"[launch-local] stopped {left} process(es) the run before left behind "
                     f"(launched by pid {lock.previous.get('pid')}, which is gone)")
        # Every process of it is gone now: what it left in /dev/shm when its launcher and its
        # watchdog were both killed (neither could sweep) goes too (issue 38 item 4).
        swept = sweep_previous(lock.previous, self.run_path)
        if swept:
            self.log(f"[launch-local] removed {swept} that the run before left in /dev/shm "
                     "(its launcher and watchdog were killed)")
        # Every agent's full output; the stream shows what matters.
        (self.run_path / LOGS_DIR).mkdir(exist_ok=True)
        return lock

    def _catch_signals(self) -> dict[int, Any]:
        """Cancel the run on SIGINT, SIGTERM and SIGHUP (main thread only); the old handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self._on_signal) for sig in _CANCEL}

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.state, self.reason = "Cancelled", f"received {signal.Signals(signum).name}"
        self.received["signal"] = int(signum)
        self._stop.set()

    # -- the agents -----------------------------------------------------------------------------

    def _start_agents(self, argv: list[str], env: dict[str, str], slices: list[str | None],
                      stops: Path, lock: RunDirLock) -> None:
        """One agent per node, node 0 the rendezvous host, each with its GPUs and stop file."""
        in_process = self.job.config.resilience.in_process
        for i in range(self.job.max_nodes):
            # NODE_ENV: each local node keeps its host memory (snapshots, peer copies) in a
            # folder of its own, so a lost node's is really gone while the others' stay.
            node = {**env, **agent_env(self.job.config.resilience),
                         "PET_RDZV_CONF": f"is_host={1 if i == 0 else 0}",
                         STOP_FILE_ENV: str(stop_file(stops, f"node{i}")), NODE_ENV: f"{i}"}
            if slices[i] is not None:
                # Each local node sees only its own GPUs, as a pod would; LOCAL_RANK indexes them.
                node["CUDA_VISIBLE_DEVICES"] = str(slices[i])
            if in_process:  # the pod spec's rule (jobspec/env.py), GPU or CPU
                node.update(in_process_env(gpu=slices[i] is not None))
            out = NodeOutput(self.log, self.verbose, self.run_path / LOGS_DIR / f"node{i}.log")
            self.agents.append(Agent(i, argv, node, out, hold=lock.path))
        if self.on_start is not None:
            self.on_start([a.proc.pid for a in self.agents])

    def _follow(self, started: float, watchdog: Watchdog, lock: RunDirLock) -> Watchdog:
        """Wait for the agents' end, a verdict, the deadline or a signal; the watchdog now."""
        while not self._stop.is_set() and any(a.proc.poll() is None for a in self.agents):
            for a in self.agents:
                if a.exited_at is None and a.proc.poll() is not None:
                    a.exited_at = time.time()
            if self.deadline_s is not None and time.time() - started > self.deadline_s:
                self.state = "DeadlineExceeded"
                self.reason = f"deadline of {self.deadline_s:g}s passed"
                break
            if any(a.gave_up for a in self.agents):  # a final verdict: the others need not wait
                break
            if watchdog.dead() is not None:
                try:
                    watchdog = self._replace_watchdog(watchdog, lock)
                except OSError as err:  # without a watchdog a SIGKILLed launcher leaks
                    self.state = "Failed"
                    self.reason = f"the watchdog died and no new one could be started: {err}"
                    break
            self._stop.wait(0.2)
        return watchdog

    def _replace_watchdog(self, old: Watchdog, lock: RunDirLock) -> Watchdog:
        """A new watchdog for a dead one (someone killed it; the run must stay covered)."""
        code = old.dead()
        old.close()
        new = Watchdog(f"{_MARKER}={self.marker}", self.grace, keep_fds=(lock.held(),),
                       sweep=self.sweep)
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        self.log(f"[launch-local] the watchdog (pid {old.proc.pid}) died ({how}); started a "
                 f"new one (pid {new.proc.pid})")
        return new

    def _stop_agents(self, stops: Path) -> int:
        """Stop every agent (asked to stop: their workers save first); the stragglers killed."""
        if self.state in ("Cancelled", "DeadlineExceeded"):
            for i in range(len(self.agents)):
                request_stop(stop_file(stops, f"node{i}"),
                             term_timeout_s(self.job.config.resilience) - SAVE_MARGIN_S)
        # Tell every node first, then wait: stopping them one at a time would take N x grace.
        for a in self.agents:
            a.terminate()
        stop_by = time.time() + self.grace
        for a in self.agents:
            a.stop(grace=stop_by - time.time())
        for a in self.agents:
            a.thread.join(timeout=5)
        return _reap(self.marker)

    # -- the result -----------------------------------------------------------------------------

    def _result(self, started: float, argv: list[str], leftovers: int) -> LaunchResult:
        """What happened: the state, why, and the run's own accounting from its events."""
        result = LaunchResult(
            name=self.job.name, backend="local", state=self.state, run_dir=str(self.run_path),
            reason=self.reason, started_at=started, finished_at=time.time(),
            extra={"agents_exit_codes": [a.exit_code for a in self.agents],
                   "leftover_processes_killed": leftovers, "command": argv, **self.received})
        events = read_events(self.run_path)  # read once: the report and the completion check
        account(result, events)
        if self.state == "Running":
            self._decide(result, events)
        return result

    def _decide(self, result: LaunchResult, events: list[Event]) -> None:
        """A run that ended by itself: Succeeded when it completed, else why it failed."""
        completed = any(isinstance(e, End) and e.completed for e in events)
        failing = [a for a in self.agents if a.failed]
        if completed and not failing:
            result.state = "Succeeded"
            return
        result.state = "Failed"
        # The agent that failed first holds the cause; the others report its consequences.
        failing.sort(key=lambda a: a.exited_at or float("inf"))
        bad = next((a for a in self.agents if a.gave_up), failing[0] if failing else self.agents[0])
        result.last_log_lines = bad.disk_full.clean((bad.verdict_tail or list(bad.tail))[-20:])
        if bad.gave_up:  # a worker's own verdict (the job's budget, a diverged loss)
            # The budget was spent on restarts that met a full disk: that is what to fix.
            full = next((a.disk_full.line for a in self.agents if a.disk_full.line), "")
            cause = f"{full}; " if full and BUDGET_SPENT in bad.gave_up else ""
            result.reason = f"node{bad.idx} {cause}{bad.gave_up[:400]}"
            return
        last_err = bad.disk_full.line or next(
            (ln for ln in reversed(result.last_log_lines) if "error" in ln.lower()), "")
        in_job, most = result.restarts_in_job, self.job.config.resilience.max_restarts
        gave_up = (f" after {in_job} in-job restart(s), the most resilience.max_restarts="
                   f"{most} allows" if failing and in_job is not None and in_job >= most else "")
        result.reason = (f"node{bad.idx} ft_launcher exited {bad.exit_code}{gave_up}"
                         + (f": {last_err.strip()[:300]}" if last_err else ""))
