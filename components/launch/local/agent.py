"""One local node: an ``ft_launcher`` agent, its output streamed and kept, stopped on request.

Every line an agent prints goes to ``<run_dir>/logs/node<i>.log`` (:class:`.agent_log.AgentLog`);
the stream shows the trainer's lines, faults, failures and restarts (:class:`Shown`), or every line
with ``verbose``. An agent leads its own process group, so ``os.killpg(pid, SIGKILL)`` takes down
one whole local node (agent and workers): the fault drills use it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kfp_nvrx.components.core.ckpt_store import open_store
from kfp_nvrx.components.core.exits import GAVE_UP
from kfp_nvrx.components.launch.local.agent_log import AgentLog, DiskFullNotice
from kfp_nvrx.components.launch.local.lifetime import die_with_parent

# Without --verbose the stream shows the trainer's lines, faults, failures and restarts ...
_QUIET = re.compile(r"\[trainer\]|error|Error|failed|Traceback|injecting|FT timeout|restart",
                    re.IGNORECASE)
# ... but not ft_launcher's config dump, NVRx's restart-state chatter (``state=aborted`` on every
# clean exit) or a surviving rank reporting that its killed peer went away (gloo's "Connection
# reset by peer ... GLHF!", the expected echo of a fault). logs/node<i>.log keeps every line.
_HIDDEN = re.compile(r"\[NestedRestarter\]|[Pp]eriodic restart check|^\s*(max_restarts|"
                     r"restart_policy)\s*:|Connection (reset|closed) by peer|GLHF")
#: Lines of an agent's output kept for a failure report.
TAIL_LINES = 40


@dataclass(frozen=True)
class NodeOutput:
    """Where one local node's output goes.

    Attributes:
        log: The stream (the lines that matter, ``[node<i>]`` first).
        verbose: Stream every line.
        path: The node's own log file, which keeps every line.
    """

    log: Callable[[str], None]
    verbose: bool
    path: Path


class Shown:
    """Which of an agent's lines the stream shows.

    A ``Traceback`` header only with what it led to; torch's torn-write lines only as the one
    disk-full notice.
    """

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.held: str | None = None  # a "Traceback" header, shown only if what it led to is

    def lines(self, line: str, notice: str | None) -> list[str]:
        """The lines to show for ``line`` (``notice``: what the disk-full check made of it)."""
        out = [notice] if notice else []
        if notice is not None and not self.verbose:
            self.held = None  # torch's torn-write lines and their traceback: said above
        elif self.verbose:
            out.append(line)
        elif not _QUIET.search(line) or _HIDDEN.search(line):
            self.held = None if _HIDDEN.search(line) else self.held
        elif "Traceback" in line:
            self.held = line
        else:
            if self.held is not None:
                out.append(self.held)
                self.held = None
            out.append(line)
        return out


class Agent:
    """One ``ft_launcher`` agent (a local node), started at once.

    Args:
        idx: The node's index (node 0 hosts the rendezvous).
        argv: The ft_launcher command line.
        env: Its environment (``PET_*`` as a pod gets it).
        out: Where its output goes.
        hold: The run-dir lock file the agent takes a lock of its own on (see below).
    """

    def __init__(self, idx: int, argv: list[str], env: dict[str, str], out: NodeOutput,
                 hold: Path | None = None) -> None:
        self.idx = idx
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.exited_at: float | None = None  # when the launcher first saw it gone
        self.gave_up = ""  # a worker's verdict: the job's restart budget is spent, or divergence
        self.verdict_tail: list[str] = []  # its last lines up to the verdict (then: its shutdown)
        # SIGTERMed once (by us, or by the worker that gave up: job.give_up): a second SIGTERM
        # while ft_launcher exits is raised in its exit handlers as a SignalException traceback.
        self.signalled = False
        # Set once the launcher stops this agent (a cancel, another node's failure): what it
        # prints while stopping (NVRx's asyncio CancelledError traceback, SignalException
        # lines) is its shutdown, not news; it goes to the node log only.
        self.stopping = False
        self.disk_full = DiskFullNotice(Path(open_store(out.path.parent.parent).where))
        # The kernel SIGTERMs the agent when the launcher dies (die_with_parent); its own lock on
        # ``hold`` (the run-dir lock file) keeps the run dir taken until it has stopped its
        # workers. Not our flock's descriptor: ft_launcher's forks would share it and hold the
        # run dir long after the agent (its rank-monitor servers outlive a SIGKILLed agent).
        self.proc = subprocess.Popen(die_with_parent(argv, hold=hold or ""), env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, start_new_session=True)
        self.thread = threading.Thread(target=self._pump, args=(out,), daemon=True)
        self.thread.start()

    @property
    def exit_code(self) -> int | None:
        """The agent's exit code (None while it runs)."""
        return self.proc.returncode

    @property
    def failed(self) -> bool:
        """It exited with an error of its own (not a signal: ours when we stopped it)."""
        return self.proc.returncode is not None and self.proc.returncode > 0

    def _pump(self, out: NodeOutput) -> None:
        shown = Shown(out.verbose)
        full = AgentLog(out.path, f"[node{self.idx}]", out.log)  # survives a full disk
        stdout = self.proc.stdout
        try:
            for raw in stdout if stdout is not None else ():
                line = raw.rstrip()
                full.write(line)
                self.tail.append(line)
                if self.stopping and not out.verbose:
                    continue
                if GAVE_UP in line and not self.gave_up:
                    self.gave_up = line[line.index(GAVE_UP):]
                    self.verdict_tail = list(self.tail)
                    self.signalled = True  # the worker that said it stops this agent
                for shown_line in shown.lines(line, self.disk_full.check(line)):
                    out.log(f"[node{self.idx}] {shown_line}")
        finally:
            full.close()

    def terminate(self) -> None:
        """Ask the agent to stop (it stops its workers, who save first on a stop request)."""
        self.stopping = True
        if self.proc.poll() is None and not self.signalled:
            self.signalled = True
            # ft_launcher alone, as a pod's entry point signals it: it stops its workers (who
            # save first on a stop request) and then its own helpers; SIGTERM to the whole
            # group would kill those helpers (rank monitors, the checkpoint writer) under a save.
            os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self, grace: float) -> None:
        """Stop the agent, its whole process group after ``grace`` seconds."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(max(grace, 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
