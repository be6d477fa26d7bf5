"""The ``local`` backend: N ``ft_launcher`` agents on this machine, as a PyTorchJob would run them.

Each agent gets the ``PET_*`` environment the Training Operator injects into a pod of a PyTorchJob
with an ``elasticPolicy``, and the command line comes from :func:`command.ft_launcher_argv`, the
same builder the pod spec uses. Output is streamed with a ``[nodeK]`` prefix; SIGINT/SIGTERM or a
deadline stop every agent and every worker they started (nothing is left running).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path

from kfp_nvrx.components.core.events import End, read_events
from kfp_nvrx.components.core.host_copy import remove_run_copy
from kfp_nvrx.components.core.launch_command import (
    TRAINER_MODULE,
    TrainerArgs,
    ft_launcher_argv,
    in_process_env,
    pet_env,
    term_timeout_s,
)
from kfp_nvrx.components.core.ownership import claim_run_dir
from kfp_nvrx.components.core.pod_entry import GAVE_UP, quiet_warnings
from kfp_nvrx.components.core.rundir import CHECKPOINTS_DIR, LOGS_DIR
from kfp_nvrx.components.core.stop_request import (
    SAVE_MARGIN_S,
    STOP_FILE_ENV,
    request_stop,
    stop_file,
)
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.agent_log import AgentLog, DiskFullNotice
from kfp_nvrx.components.launch.gpus import slice_gpus
from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob, resolve_local
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.lifetime import (
    RunDirLock,
    Watchdog,
    die_with_parent,
    processes_with_env,
    stop_leftovers,
)
from kfp_nvrx.components.launch.result import LaunchResult, account

_MARKER = "KFP_NVRX_LOCAL_RUN"
# Without --verbose the stream shows the trainer's lines, faults, failures and restarts ...
_QUIET = re.compile(r"\[trainer\]|error|Error|failed|Traceback|injecting|FT timeout|restart",
                    re.IGNORECASE)
# ... but not ft_launcher's config dump, NVRx's restart-state chatter (``state=aborted`` on every
# clean exit) or a surviving rank reporting that its killed peer went away (gloo's "Connection
# reset by peer ... GLHF!", the expected echo of a fault). logs/node<i>.log keeps every line.
_HIDDEN = re.compile(r"\[NestedRestarter\]|[Pp]eriodic restart check|^\s*(max_restarts|"
                     r"restart_policy)\s*:|Connection (reset|closed) by peer|GLHF")


def free_port() -> int:
    """A TCP port on localhost that is free now (rendezvous and test process groups)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preflight(trainer: TrainerArgs, env: dict[str, str] | None = None) -> None:
    """Runs every check a worker makes before training, once, before any agent starts.

    The checks need the trainer's imports (torch for the dataset, the device and the checkpoint's
    model shapes), so they run in a child interpreter (``--check``) rather than in this one; bad
    input there would otherwise fail every worker once per restart.

    Raises:
        UserError: The first failed check, as the trainer reports it.
    """
    proc = subprocess.run([sys.executable, "-m", TRAINER_MODULE, *trainer.argv(), "--check"],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if proc.returncode == 0:
        return
    for line in reversed(proc.stdout.splitlines()):
        try:
            err = json.loads(line)
        except ValueError:
            continue
        if isinstance(err, dict) and {"field", "message"} <= err.keys():
            raise UserError(str(err["field"]), str(err["message"]))
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    # Only a missing module means a missing install; anything else is reported as it is.
    fix = ("install the trainer with pip install 'kfp-nvrx[trainer]'"
           if re.search(r"ModuleNotFoundError|ImportError", proc.stderr)
           else f"run it alone for the traceback: python -m {TRAINER_MODULE} ... --check")
    raise UserError("trainer", f"its input check exited {proc.returncode} ({last[:300]}); {fix}")


def _ft_launcher() -> str:
    local = Path(sys.executable).parent / "ft_launcher"
    found = str(local) if local.exists() else shutil.which("ft_launcher")
    if not found:
        raise UserError("ft_launcher", "not found; install nvidia-resiliency-ext (pip install "
                        "'kfp-nvrx[trainer]')")
    return found


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


class _Agent:
    def __init__(self, idx: int, argv: list[str], env: dict[str, str], log: Callable[[str], None],
                 verbose: bool, log_path: Path, hold: Path | None = None) -> None:
        self.idx, self.tail = idx, deque(maxlen=40)
        self.exited_at: float | None = None  # when the launcher first saw it gone
        self.gave_up = ""  # a worker's verdict: the job's restart budget is spent, or divergence
        # Set once the launcher stops this agent (a cancel, another node's failure): what it
        # prints while stopping (NVRx's asyncio CancelledError traceback, SignalException
        # lines) is its shutdown, not news; it goes to the node log only.
        self.stopping = False
        self.disk_full = DiskFullNotice(log_path.parent.parent / CHECKPOINTS_DIR)
        # The kernel SIGTERMs the agent when the launcher dies (die_with_parent); its own lock on
        # ``hold`` (the run-dir lock file) keeps the run dir taken until it has stopped its
        # workers. Not our flock's descriptor: ft_launcher's forks would share it and hold the
        # run dir long after the agent (its rank-monitor servers outlive a SIGKILLed agent).
        self.proc = subprocess.Popen(die_with_parent(argv, hold=hold or ""), env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, start_new_session=True)
        self.thread = threading.Thread(target=self._pump, args=(log, verbose, log_path),
                                       daemon=True)
        self.thread.start()

    def _pump(self, log: Callable[[str], None], verbose: bool, log_path: Path) -> None:
        held = None  # a "Traceback" header, shown only if what it led to is shown
        full = AgentLog(log_path, f"[node{self.idx}]", log)  # survives a full disk
        try:
            for line in self.proc.stdout:
                line = line.rstrip()
                full.write(line)
                self.tail.append(line)
                if self.stopping and not verbose:
                    continue
                if GAVE_UP in line and not self.gave_up:
                    self.gave_up = line[line.index(GAVE_UP):]
                notice = self.disk_full.check(line)
                if notice:
                    log(f"[node{self.idx}] {notice}")
                if notice is not None and not verbose:
                    held = None  # torch's torn-write lines and their traceback: said above
                elif verbose:
                    log(f"[node{self.idx}] {line}")
                elif not _QUIET.search(line) or _HIDDEN.search(line):
                    held = None if _HIDDEN.search(line) else held
                elif "Traceback" in line:
                    held = line
                else:
                    if held is not None:
                        log(f"[node{self.idx}] {held}")
                        held = None
                    log(f"[node{self.idx}] {line}")
        finally:
            full.close()

    def terminate(self) -> None:
        self.stopping = True
        if self.proc.poll() is None:
            # ft_launcher alone, as a pod's entry point signals it: it stops its workers (who
            # save first on a stop request) and then its own helpers; SIGTERM to the whole
            # group would kill those helpers (rank monitors, the checkpoint writer) under a save.
            os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self, grace: float) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(max(grace, 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _replace_watchdog(old: Watchdog, marker: str, grace: float, lock_fd: int,
                      log: Callable[[str], None]) -> Watchdog:
    """A new watchdog for a dead one (someone killed it; the run must stay covered)."""
    code = old.dead()
    old.close()
    new = Watchdog(marker, grace, keep_fds=(lock_fd,))
    how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    log(f"[launch-local] the watchdog (pid {old.proc.pid}) died ({how}); started a new one "
        f"(pid {new.proc.pid})")
    return new


def run_local(spec: ResolvedJob | JobSpec, *, log: Callable[[str], None] = print,
              deadline_s: float | None = None, verbose: bool = False,
              on_start: Callable[[list[int]], None] | None = None) -> LaunchResult:
    """Runs one training job on localhost and waits for it.

    Uses the trainer part of the job (:func:`.resolve.resolve_local`): its node range (MAX
    ft_launcher agents are started), workers per agent, run directory, config, overrides, faults
    and env; its name is also the rendezvous id.

    Args:
        spec: The job (a JobSpec is resolved first).
        log: Where streamed output goes.
        deadline_s: Wall-clock limit; exceeded -> agents stopped, state ``DeadlineExceeded``.
        verbose: Stream every launcher line (default: trainer lines and errors only).
        on_start: Called once with the agents' PIDs, node 0 first, after all were started. Each
            agent leads its own process group, so ``os.killpg(pid, SIGKILL)`` takes down one
            whole local node (agent and workers): the fault drills use it.

    Returns:
        The LaunchResult (``Succeeded``, ``Failed``, ``Cancelled`` or ``DeadlineExceeded``).

    Raises:
        UserError: Bad input, before anything is started.
    """
    job = resolve_local(spec) if isinstance(spec, JobSpec) else spec
    lo, hi, nproc_per_node, cfg = job.min_nodes, job.max_nodes, job.procs_per_node, job.config
    if deadline_s is not None and not (math.isfinite(deadline_s) and deadline_s > 0):
        raise UserError("deadline_s", f"must be a finite number of seconds > 0, got {deadline_s}")
    # train.device=cuda on a host without GPUs fails here, naming train.device, before anything.
    slices = slice_gpus(hi, nproc_per_node, cfg.train.device)
    trainer = job.trainer_args()
    preflight(trainer, dict(job.user_env))
    run_path = Path(job.run_dir).resolve()
    trainer.run_dir = str(run_path)
    exe = _ft_launcher()
    name = job.name
    marker = uuid.uuid4().hex
    port = free_port()
    argv = ft_launcher_argv(cfg.resilience, trainer, local_addr="127.0.0.1", executable=exe)
    threads = max(1, (os.cpu_count() or 1) // (hi * nproc_per_node))
    base = {**os.environ, **dict(job.user_env), _MARKER: marker, "PYTHONUNBUFFERED": "1",
            "PYTHONWARNINGS": quiet_warnings({**os.environ, **dict(job.user_env)}),
            # NVRx >= 0.6 closes the rendezvous when two agents share a host unless told this
            # is deliberate (local "nodes" are agents on one machine).
            "NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
            **pet_env(nnodes=f"{lo}:{hi}" if lo != hi else str(hi), nproc_per_node=nproc_per_node,
                      rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=f"{name}-{marker[:8]}",
                      max_restarts=cfg.resilience.max_restarts)}
    claim_run_dir(run_path)
    # One run owns a run dir at a time; taken before anything is written into it, so a launch
    # refused for a run dir in use leaves it as it was.
    lock = RunDirLock(run_path).acquire(marker)
    # Held: no launcher, watchdog or agent of the run before lives. What else it left (it died
    # whole, its watchdog too) would go on beside this run; stopped before anything starts.
    left = stop_leftovers(lock.previous, _MARKER)
    if left:
        log(f"[launch-local] stopped {left} process(es) the run before left behind (launched by "
            f"pid {lock.previous.get('pid')}, which is gone)")
    logs = run_path / LOGS_DIR  # every agent's full output; the stream shows what matters
    logs.mkdir(exist_ok=True)
    grace = term_timeout_s(cfg.resilience) + 10
    # FT: each node's stop request (core.stop_request): a cancelled run, or one past its
    # deadline, lets its workers save first; a failed one stops them at once.
    stops = Path(tempfile.mkdtemp(prefix="kfp-nvrx-stop-"))
    # Stops everything of this run if the launcher itself dies (SIGKILL included); it holds the
    # lock until then. If the watchdog dies first, the loop below starts a new one.
    watchdog = Watchdog(f"{_MARKER}={marker}", grace, keep_fds=(lock.fd,))
    log(f"[launch-local] {name}: {hi} node(s) x {nproc_per_node} proc, run dir {run_path}")
    started = time.time()
    agents: list[_Agent] = []
    state, reason = "Running", ""
    stop = threading.Event()

    received: dict[str, int] = {}

    def _on_signal(signum, _frame):
        nonlocal state, reason
        state, reason = "Cancelled", f"received {signal.Signals(signum).name}"
        received["signal"] = int(signum)
        stop.set()

    old = {}
    if threading.current_thread() is threading.main_thread():
        # SIGHUP: the terminal closed; the run must not go on training unattended.
        old = {s: signal.signal(s, _on_signal)
               for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for i in range(hi):
            agent_env = {**base, "PET_RDZV_CONF": f"is_host={1 if i == 0 else 0}",
                         STOP_FILE_ENV: str(stop_file(stops, f"node{i}"))}
            if slices[i] is not None:
                # Each local node sees only its own GPUs, as a pod would; LOCAL_RANK indexes them.
                agent_env["CUDA_VISIBLE_DEVICES"] = slices[i]
            if cfg.resilience.in_process:  # the pod spec's rule (jobspec/env.py), GPU or CPU
                agent_env.update(in_process_env(gpu=slices[i] is not None))
            agents.append(_Agent(i, argv, agent_env, log, verbose, logs / f"node{i}.log",
                                 hold=lock.path))
        if on_start is not None:
            on_start([a.proc.pid for a in agents])
        while not stop.is_set() and any(a.proc.poll() is None for a in agents):
            for a in agents:
                if a.exited_at is None and a.proc.poll() is not None:
                    a.exited_at = time.time()
            if deadline_s is not None and time.time() - started > deadline_s:
                state, reason = "DeadlineExceeded", f"deadline of {deadline_s:g}s passed"
                break
            if any(a.gave_up for a in agents):  # a final verdict: the other nodes need not wait
                break
            if watchdog.dead() is not None:
                try:
                    watchdog = _replace_watchdog(watchdog, f"{_MARKER}={marker}", grace,
                                                 lock.fd, log)
                except OSError as err:  # without a watchdog a SIGKILLed launcher leaks
                    state = "Failed"
                    reason = f"the watchdog died and no new one could be started: {err}"
                    break
            stop.wait(0.2)
    finally:
        if state in ("Cancelled", "DeadlineExceeded"):  # asked to stop: the workers save first
            for i in range(len(agents)):
                request_stop(stop_file(stops, f"node{i}"), term_timeout_s(cfg.resilience)
                             - SAVE_MARGIN_S)
        # Tell every node first, then wait: stopping them one at a time would take N x grace.
        for a in agents:
            a.terminate()
        stop_by = time.time() + grace
        for a in agents:
            a.stop(grace=stop_by - time.time())
        for a in agents:
            a.thread.join(timeout=5)
        leftovers = _reap(marker)
        # Every worker is gone: the run's node-local host copy (up to two banks of each rank's
        # state in /dev/shm) would hold that RAM until some later run swept it. Ours to delete
        # while we hold the run dir (a relaunch resumes from the committed checkpoints).
        remove_run_copy(run_path)
        shutil.rmtree(stops, ignore_errors=True)
        watchdog.finish()
        lock.release()
        for s, h in old.items():
            signal.signal(s, h)
    result = LaunchResult(name=name, backend="local", state=state, run_dir=str(run_path),
                          reason=reason, started_at=started, finished_at=time.time(),
                          extra={"agents_exit_codes": [a.proc.returncode for a in agents],
                                 "leftover_processes_killed": leftovers, "command": argv,
                                 **received})
    events = read_events(run_path)  # read once: the report and the completion check share it
    account(result, events)
    completed = any(isinstance(e, End) and e.completed for e in events)
    failing = [a for a in agents if a.proc.returncode not in (0, None) and a.proc.returncode > 0]
    tail: list[str] = []
    if state == "Running":
        if completed and not failing:
            state = "Succeeded"
        else:
            state = "Failed"
            # The agent that failed first holds the cause; the others report its consequences.
            failing.sort(key=lambda a: a.exited_at or float("inf"))
            bad = next((a for a in agents if a.gave_up), failing[0] if failing else agents[0])
            tail = bad.disk_full.clean(list(bad.tail)[-20:])
            last_err = bad.disk_full.line or next(
                (ln for ln in reversed(tail) if "error" in ln.lower()), "")
            in_job, most = result.restarts_in_job, cfg.resilience.max_restarts
            gave_up = (f" after {in_job} in-job restart(s), the most resilience.max_restarts="
                       f"{most} allows" if failing and in_job >= most else "")
            reason = (f"node{bad.idx} ft_launcher exited {bad.proc.returncode}{gave_up}"
                      + (f": {last_err.strip()[:300]}" if last_err else ""))
            if bad.gave_up:  # a worker's own verdict (the job's budget, a diverged loss)
                reason = f"node{bad.idx} {bad.gave_up[:400]}"
    result.state, result.reason, result.last_log_lines = state, reason, tail
    return result
