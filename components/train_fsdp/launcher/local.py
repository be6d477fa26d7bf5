"""The ``local`` backend: N ``ft_launcher`` agents on this machine, as a PyTorchJob would run them.

Each agent gets the ``PET_*`` environment the Training Operator injects into a pod of a PyTorchJob
with an ``elasticPolicy``, and the command line comes from :func:`command.ft_launcher_argv`, the
same builder the pod spec uses. Output is streamed with a ``[nodeK]`` prefix; SIGINT/SIGTERM or a
deadline stop every agent and every worker they started (nothing is left running).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.train_fsdp.launcher.command import (
    TrainerArgs,
    ft_launcher_argv,
    in_process_env,
    pet_env,
)
from kfp_nvrx.components.train_fsdp.launcher.gpus import slice_gpus
from kfp_nvrx.components.train_fsdp.launcher.result import LaunchResult

_MARKER = "KFP_NVRX_LOCAL_RUN"
_QUIET = re.compile(r"\[trainer\]|error|Error|failed|Traceback|injecting|FT timeout|restart",
                    re.IGNORECASE)


def parse_nodes(nodes: str | int) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> (min, max); raises UserError naming ``--nodes``."""
    m = re.fullmatch(r"(\d+)(?::(\d+))?", str(nodes).strip())
    if not m:
        raise UserError("--nodes", f"expected N or MIN:MAX, got {nodes!r}")
    lo, hi = int(m[1]), int(m[2] or m[1])
    if lo < 1:
        raise UserError("--nodes", f"needs at least 1 node, got {nodes!r}")
    if lo > hi:
        raise UserError("--nodes", f"MIN must not exceed MAX, got {nodes!r}")
    return lo, hi


def free_port() -> int:
    """A TCP port on localhost that is free now (rendezvous and test process groups)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ft_launcher() -> str:
    local = Path(sys.executable).parent / "ft_launcher"
    found = str(local) if local.exists() else shutil.which("ft_launcher")
    if not found:
        raise UserError("ft_launcher", "not found; install nvidia-resiliency-ext (pip install "
                        "'kfp-nvrx[trainer]')")
    return found


def _reap(marker: str) -> int:
    """Kills any process still carrying this run's marker in its environment (Linux /proc)."""
    killed = 0
    needle = f"{_MARKER}={marker}".encode()
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (pid_dir / "environ").read_bytes().split(b"\0"):
                os.kill(int(pid_dir.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):
            continue
    return killed


class _Agent:
    def __init__(self, idx: int, argv: list[str], env: dict[str, str], log: Callable[[str], None],
                 verbose: bool) -> None:
        self.idx, self.tail = idx, deque(maxlen=40)
        self.exited_at: float | None = None  # when the launcher first saw it gone
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     start_new_session=True)
        self.thread = threading.Thread(target=self._pump, args=(log, verbose), daemon=True)
        self.thread.start()

    def _pump(self, log: Callable[[str], None], verbose: bool) -> None:
        for line in self.proc.stdout:
            line = line.rstrip()
            self.tail.append(line)
            if verbose or _QUIET.search(line):
                log(f"[node{self.idx}] {line}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # ft_launcher stops its workers on SIGTERM

    def stop(self, grace: float) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(max(grace, 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def run_local(nodes: str, nproc_per_node: int, run_dir: str, config: str,
              overrides: list[str] | None = None, faults: list[str] | None = None, *,
              name: str | None = None, env: dict[str, str] | None = None,
              log: Callable[[str], None] = print, deadline_s: float | None = None,
              verbose: bool = False,
              on_start: Callable[[list[int]], None] | None = None) -> LaunchResult:
    """Runs one training job on localhost and waits for it.

    Args:
        nodes: ``N`` or ``MIN:MAX`` local "nodes" (ft_launcher agents; MAX are started).
        nproc_per_node: Worker processes per agent.
        run_dir: Run directory shared by all workers.
        config: Trainer preset or YAML path.
        overrides: ``--set`` items.
        faults: ``--fault`` items.
        name: Run name (also the rendezvous id); derived from run_dir when omitted.
        env: Extra environment for the agents.
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
    from kfp_nvrx.components.train_fsdp.trainer.events import read_events
    from kfp_nvrx.components.train_fsdp.trainer.goodput import summarize_events
    from kfp_nvrx.components.train_fsdp.trainer.setup import (
        check_checkpoint_model,
        check_run_dir,
        validate_inputs,
    )

    overrides, faults = list(overrides or []), list(faults or [])
    lo, hi = parse_nodes(nodes)
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise UserError("--nproc-per-node", f"must be an integer >= 1, got {nproc_per_node!r}")
    if deadline_s is not None and deadline_s <= 0:
        raise UserError("--deadline", f"must be > 0 seconds, got {deadline_s}")
    cfg, _ = validate_inputs(config, overrides, faults)
    run_path = check_run_dir(Path(run_dir)).resolve()
    check_checkpoint_model(cfg, run_path)
    slices = slice_gpus(hi, nproc_per_node, cfg.train.device)
    exe = _ft_launcher()
    name = name or re.sub(r"[^a-z0-9-]", "-", run_path.name.lower()) or "run"
    marker = uuid.uuid4().hex
    port = free_port()
    argv = ft_launcher_argv(cfg.resilience, TrainerArgs(config, str(run_path), overrides, faults),
                            local_addr="127.0.0.1", executable=exe)
    threads = max(1, (os.cpu_count() or 1) // (hi * nproc_per_node))
    base = {**os.environ, **(env or {}), _MARKER: marker, "PYTHONUNBUFFERED": "1",
            # NVRx >= 0.6 closes the rendezvous when two agents share a host unless told this
            # is deliberate (local "nodes" are agents on one machine).
            "NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
            **pet_env(nnodes=f"{lo}:{hi}" if lo != hi else str(hi), nproc_per_node=nproc_per_node,
                      rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=f"{name}-{marker[:8]}",
                      max_restarts=cfg.resilience.max_restarts)}
    run_path.mkdir(parents=True, exist_ok=True)
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
        old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i in range(hi):
            agent_env = {**base, "PET_RDZV_CONF": f"is_host={1 if i == 0 else 0}"}
            if slices[i] is not None:
                # Each local node sees only its own GPUs, as a pod would; LOCAL_RANK indexes them.
                agent_env["CUDA_VISIBLE_DEVICES"] = slices[i]
                agent_env.update(in_process_env(gpu=True) if cfg.resilience.in_process else {})
            agents.append(_Agent(i, argv, agent_env, log, verbose))
        if on_start is not None:
            on_start([a.proc.pid for a in agents])
        while not stop.is_set() and any(a.proc.poll() is None for a in agents):
            for a in agents:
                if a.exited_at is None and a.proc.poll() is not None:
                    a.exited_at = time.time()
            if deadline_s is not None and time.time() - started > deadline_s:
                state, reason = "DeadlineExceeded", f"deadline of {deadline_s:g}s passed"
                break
            stop.wait(0.2)
    finally:
        # Every node is told at once (one by one, each waited for, took up to N x grace).
        for a in agents:
            a.terminate()
        stop_by = time.time() + float(cfg.resilience.workers_stop_timeout) + 10
        for a in agents:
            a.stop(grace=stop_by - time.time())
        for a in agents:
            a.thread.join(timeout=5)
        leftovers = _reap(marker)
        for s, h in old.items():
            signal.signal(s, h)
    events = read_events(run_path)  # read once: the report and the completion check share it
    report = summarize_events(events)
    completed = any(e["type"] == "end" and e.get("status") == "completed" for e in events)
    failing = [a for a in agents if a.proc.returncode not in (0, None) and a.proc.returncode > 0]
    tail: list[str] = []
    if state == "Running":
        if completed and not failing:
            state = "Succeeded"
        else:
            state = "Failed"
            # The agent that failed first holds the cause; the others report its consequences.
            failing.sort(key=lambda a: a.exited_at or float("inf"))
            bad = failing[0] if failing else agents[0]
            tail = list(bad.tail)[-20:]
            last_err = next((ln for ln in reversed(tail) if "error" in ln.lower()), "")
            in_job, most = report.restarts.get("in-job", 0), cfg.resilience.max_restarts
            gave_up = (f" after {in_job} in-job restart(s), the most resilience.max_restarts="
                       f"{most} allows" if failing and in_job >= most else "")
            reason = (f"node{bad.idx} ft_launcher exited {bad.proc.returncode}{gave_up}"
                      + (f": {last_err.strip()[:300]}" if last_err else ""))
    return LaunchResult(
        name=name, backend="local", state=state, run_dir=str(run_path), reason=reason,
        restarts=sum(report.restarts.values()), started_at=started, finished_at=time.time(),
        last_log_lines=tail,
        extra={"goodput": report.to_dict(), "agents_exit_codes": [a.proc.returncode for a in agents],
               "leftover_processes_killed": leftovers, "command": argv, **received},
    )
