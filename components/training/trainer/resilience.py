"""NVRx integration: the rank monitor client (the in-process restart wrapper: :mod:`.inprocess_restart`).

The client opens sections and sends heartbeats, learns timeouts from observed times and persists
them in checkpoints.

Every step runs in the ``step`` section under the bound of its kind (:mod:`.rhythm`): an
incarnation's first steps under a start-up bound of their own, steps while the staging banks pin
under a pinning bound, every other step under the run's learned rhythm from an incarnation's
third step on (a restarted incarnation, a new worker process or an in-process re-entry, takes
the rhythm restored from its checkpoint or kept in the process). The bounds are sent to the rank
monitor when the kind of step changes.

Why the start-up pieces are kept out of the learned rhythm: the rank monitor server keeps the
last timeouts it was sent across worker restarts and NVRx's client re-sends loaded ones at every
``init_workload_monitoring``. A restarted worker that got the learned 4 s rhythm back at once had
its start-up (allocating and pinning its staging banks, its first save, a recompile) judged by
it and was killed, again and again (issue 29). So every incarnation still connects under the
*configured* timeouts, its set-up and saves are phases that heartbeat on their own, its first
steps are start-up steps, and its pinning steps are bounded by the pinning steps the run measured.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kfp_nvrx.components.core.config import ResilienceConfig
from kfp_nvrx.components.training.trainer.inprocess_restart import in_process_wrapper
from kfp_nvrx.components.training.trainer.rhythm import (
    STARTUP_STEPS,
    Kind,
    Limits,
    Measured,
    bounds_line,
    kind_of,
)
from kfp_nvrx.components.training.trainer.timeouts_text import describe_timeouts

__all__ = ["Monitor", "in_process_wrapper", "under_ft_launcher"]

log = logging.getLogger(__name__)

#: Where :meth:`Monitor.state_dict` keeps the measured start-up and pinning steps, beside NVRx's
#: own ``current_timeouts``.
MEASURED_KEY = "measured_steps"


def env_rank() -> int:
    """This worker's global rank (0 outside a launcher)."""
    return int(os.environ.get("RANK", "0") or 0)


def under_ft_launcher() -> bool:
    """True when a rank monitor is reachable (the worker was started by ft_launcher)."""
    return bool(os.environ.get("FT_RANK_MONITOR_IPC_SOCKET"))


class Monitor:
    """Rank-monitor client: sections ``setup``/``step``/``checkpoint`` and/or heartbeats.

    A no-op when ``resilience.monitor`` is ``off`` or no ft_launcher is around (plain torchrun).

    Args:
        cfg: The ``resilience`` config section.
        backend: The process group's backend (``nccl`` or ``gloo``), which bounds learned timeouts.
    """

    SECTIONS = ("setup", "step", "checkpoint")

    def __init__(self, cfg: ResilienceConfig, backend: str) -> None:
        self.cfg = cfg
        self.enabled = cfg.monitor != "off" and under_ft_launcher()
        self.client: Any = None  # NVRx's RankMonitorClient (untyped) when enabled
        self.learned = False  # this incarnation applies learned timeouts
        # Learned (step, heartbeat) timeouts an earlier incarnation persisted: applied (as a
        # floor) once this one is past its start-up, never during it.
        self.restored: tuple[float, float] | None = None
        self._current: tuple[float, float] | None = None  # what this incarnation learned
        self._steady_steps: list[float] = []
        self._steady_gaps: list[float] = []
        self._open: set[str] = set()
        # Set (from a signal handler) when this node is being stopped: ft_launcher is shutting
        # down and its rank monitors with it, and the save that follows is bounded by its
        # --term-timeout, not by sections or heartbeats: nothing more is sent.
        self.quiet = False
        # The least a learned timeout may be (resilience.min_learned_timeout). Under in-process
        # restart NCCL collectives blocked on a failed peer are aborted by the wrapper at once;
        # gloo's cannot be, so a surviving rank waits up to ``pg_timeout`` inside its step, which
        # a learned step timeout below that would take for a hang.
        self.floor = cfg.min_learned_timeout
        if backend == "gloo" and cfg.in_process:
            self.floor = max(self.floor, cfg.pg_timeout + 2.0)
        self.limits = Limits(cfg.safety_factor, self.floor, cfg.first_steps_timeout)
        self.measured = Measured()  # the run's start-up and pinning steps (persisted)
        self._index, self._kind = -1, Kind.STARTUP  # the step running now in this incarnation
        self._early = 0.0  # the longest step of this incarnation after its first
        self._sent: tuple[float, float] | None = None  # the step bound the monitor holds
        # The client's socket carries one message at a time: keepalive heartbeats come from a
        # second thread while the main thread is inside a long phase.
        self._lock = threading.Lock()
        if self.enabled:
            # FT: the client talks to this rank's monitor process started by ft_launcher.
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.client = RankMonitorClient()

    def connect(self) -> None:
        """(Re)connects to the rank monitor; called at every (in-process) restart.

        The incarnation connects under the configured timeouts (see the module docstring); its
        steps then run under the bounds of their kinds (:meth:`step_section`), from the rhythm
        this process learned before an in-process restart or restores from a checkpoint.
        """
        if not self.enabled:
            return
        self.disconnect()
        if self._current is not None:  # an in-process restart: the last incarnation's learning
            before = self.restored or self._current
            self.restored = (max(before[0], self._current[0]), max(before[1], self._current[1]))
        self.learned, self._current = False, None
        self._steady_steps.clear()
        self._steady_gaps.clear()
        self._index, self._early, self._sent = -1, 0.0, None
        with self._lock:
            # FT: init_workload_monitoring; NVRx re-sends timeouts loaded earlier and the server
            # kept the last ones it got: both are replaced by the start-up ones right away.
            self.client.init_workload_monitoring()
            self.client.load_state_dict(self._startup_state())
        self._open.clear()

    def _startup_state(self) -> dict[str, Any]:
        """The configured timeouts in NVRx's state format (what an incarnation starts under)."""
        cfg = self.cfg
        key = self.client.CURRENT_TIMEOUTS_STATE_KEY
        state: dict[str, Any] = {key: {"heartbeat": {
            "initial": cfg.initial_heartbeat_timeout, "subsequent": cfg.heartbeat_timeout,
            "were_calculated": False}}}
        if cfg.monitor == "sections":
            state[key]["section"] = {
                "section": {"setup": cfg.setup_timeout, "step": cfg.step_timeout,
                            "checkpoint": cfg.checkpoint_timeout},
                "out_of_section": cfg.out_of_section_timeout,
                "calculated_sections": [], "is_out_of_section_calculated": False}
        return state

    def disconnect(self) -> None:
        """Closes every section and leaves the rank monitor (before an in-process restart).

        Between a fault and the re-entry of the training function the in-process wrapper aborts
        the process group, checks health and waits at its barriers: seconds without heartbeats.
        The wrapper's own soft/hard timeouts bound that phase, so the rank monitor must not
        apply its learned step rhythm to it (it would SIGKILL the rank and turn the in-process
        restart into an in-job one). Called by the wrapper's abort on its monitor thread as soon
        as a restart is decided (a healthy rank's main thread may still be blocked in a
        collective with the faulted peer: gloo's cannot be aborted and wait ``pg_timeout``),
        and again by the error path on the main thread; every client call holds the lock.
        """
        if not self.enabled:
            return
        with self._lock:
            if self.client.is_initialized:
                with contextlib.suppress(Exception):
                    self.client.end_all_sections()
                with contextlib.suppress(Exception):
                    self.client.shutdown_workload_monitoring()
            self._open.clear()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """An NVRx timed section (no-op in heartbeats mode)."""
        if not self.enabled or self.cfg.monitor != "sections" or self.quiet:
            yield
            return
        # FT: start_section/end_section bound each phase by its (learned) timeout.
        with self._lock:
            self.client.start_section(name)
            self._open.add(name)
        try:
            yield
        finally:
            # Not when the in-process wrapper's abort disconnected the client meanwhile (it
            # runs on another thread, see disconnect) or the node is being stopped.
            with self._lock:
                if name in self._open and not self.quiet and self.client.is_initialized:
                    self.client.end_section(name)
                self._open.discard(name)

    @property
    def adaptive(self) -> bool:
        """Whether steps run under bounds measured from the run (``resilience.learn_timeouts``)."""
        return self.enabled and self.cfg.learn_timeouts

    @contextlib.contextmanager
    def step_section(self, index: int, pinning: bool) -> Iterator[None]:
        """Step ``index`` (0-based) of this incarnation, begun while the staging banks ``pinning``.

        Runs in the ``step`` section under the bound of its kind (:mod:`.rhythm`), sent to the
        rank monitor first when it differs from the bound the monitor holds. Without learned
        timeouts the configured ones judge every step, the first in a ``setup`` phase.
        """
        if not self.adaptive:
            first = index == 0
            with self.phase("setup", bound=self.cfg.setup_timeout) if first else self.section("step"):
                yield
            return
        self._index, self._kind = index, kind_of(index, pinning)
        self._send(self.limits.bound(self._kind, self.measured, self._early, self._steady()))
        if index == STARTUP_STEPS and env_rank() == 0:
            print(f"[trainer] {self.bounds()}", flush=True)
        with self.section("step"):
            yield

    def _steady(self) -> tuple[float, float] | None:
        """The learned (step, heartbeat) timeouts in force: this incarnation's or restored ones."""
        return self._current or self.restored

    def bounds(self) -> str:
        """The bounds of every kind of step in words (logged at an incarnation's third step)."""
        return bounds_line(self.limits, self.measured, self._early, self._steady(),
                           restored=self._current is None)

    def _send(self, bound: tuple[float, float]) -> None:
        """Hands the rank monitor a (step section, heartbeat gap) bound unless it holds it."""
        if bound == self._sent or self.quiet:
            return
        # FT: load_state_dict sends the timeouts to the rank monitor right away.
        with self._lock:
            if not self.client.is_initialized:
                return
            self.client.load_state_dict(self._learned_state(*bound))
        self._sent = bound

    @contextlib.contextmanager
    def phase(self, name: str | None, bound: float) -> Iterator[None]:
        """A phase outside the step rhythm: setup, a save, the final wait for the writer.

        Heartbeat timeouts are learned from the gaps between steps; a phase such as a checkpoint
        load or the final wait for the writer can take far longer than that without anything
        being wrong. While the phase runs, a thread keeps heartbeating for at most ``bound``
        seconds (then stops, so a phase that hangs is still caught by the heartbeat timeout), and
        ``name``, when given, is also opened as a section (bounded by its own timeout).
        """
        stop = threading.Event()
        beat = None
        if self.enabled:
            period = max(0.05, min(1.0, self.cfg.min_learned_timeout / 4))
            deadline = time.monotonic() + bound

            def keepalive() -> None:
                while not stop.wait(period) and time.monotonic() < deadline:
                    self.heartbeat()

            beat = threading.Thread(target=keepalive, name=f"ft-keepalive-{name}", daemon=True)
            beat.start()
        try:
            if name is None:
                yield
            else:
                with self.section(name):
                    yield
        finally:
            stop.set()
            if beat is not None:
                beat.join()
                self.heartbeat()  # the phase's end restarts the step rhythm from now

    def heartbeat(self) -> None:
        """One heartbeat per step (both modes: in sections mode it backs up the sections)."""
        if self.enabled and not self.quiet:
            # FT: heartbeat; a rank that stops sending is killed after the heartbeat timeout.
            with self._lock:
                if self.client.is_initialized:  # not after the wrapper's abort (disconnect)
                    self.client.send_heartbeat()

    def go_quiet(self) -> None:
        """This node is being stopped: send nothing more (signal-handler safe: sets a flag)."""
        self.quiet = True

    def stop(self) -> None:
        """Stops heartbeats and sections (before a deliberate hang, or at shutdown)."""
        if not self.enabled:
            return
        with self._lock:  # as disconnect: the wrapper's abort may disconnect meanwhile
            if self.client.is_initialized:
                with contextlib.suppress(Exception):
                    self.client.end_all_sections()
            self._open.clear()

    def observe(self, step_s: float, gap_s: float | None, steady: bool) -> None:
        """Records one step: its ``step`` section's seconds and the gap since the last step's beat.

        Only ``steady`` steps are learned from (the trainer leaves out an incarnation's first
        steps, steps next to a save or a commit and steps while the staging buffers are being
        pinned): those are what a healthy run repeats, so a timeout learned from them is tight,
        and the rare long ones it must still survive are covered by the safety factor and the
        floor. Every step also counts towards the measure of its kind (:mod:`.rhythm`).
        """
        # The kinds' measures: a gap holds its step, and the first step of an incarnation has
        # none (the set-up phase ended with a heartbeat just before it).
        seconds = max(step_s, gap_s or 0.0)
        if self._index >= 0:  # under step_section's bounds
            self.measured.add(self._kind, seconds)
            # The second step's gap also holds the one-time start of the staging banks' set-up
            # (the trainer builds the state dict for it after the first step): its step counts.
            if self._index >= 1:
                self._early = max(self._early, step_s if self._index == 1 else seconds)
        if steady and not self.learned:
            self._steady_steps.append(step_s)
            if gap_s is not None:
                self._steady_gaps.append(gap_s)

    def maybe_learn(self, reduce_max: Callable[[list[float]], list[float]]) -> bool:
        """Collective: sets the step and heartbeat timeouts once ``learn_after`` steady steps ran.

        Each is ``safety_factor`` x the longest steady step (or gap between step heartbeats) on
        any rank, at least ``self.floor`` and at least what an earlier incarnation learned
        (:attr:`restored`, which judges this incarnation's steady steps until then): never a
        tighter rhythm than a run before it survived. NVRx's own calculation takes the
        longest gap it ever saw (the first steps, a compile, the pinning of the staging buffers:
        a 21 s step timeout for 0.3 s steps); ours come from steady steps only and are handed to
        the monitor through the client's state API. The ``setup`` and ``checkpoint`` sections and
        the out-of-section timeout keep their configured values: loads and writes vary with the
        storage, and the gaps between sections are tiny.

        Args:
            reduce_max: Element-wise maximum over every rank (a collective every rank calls).
        """
        if not self.enabled or not self.cfg.learn_timeouts or self.learned:
            return False
        ready = len(self._steady_steps) >= max(1, self.cfg.learn_after)
        # Every rank must take part in the reduction, or none: its count is reduced first.
        longest = reduce_max([0.0 if ready else 1.0, max(self._steady_steps, default=0.0),
                              max(self._steady_gaps, default=0.0)])
        if longest[0] > 0:
            return False
        factor = self.cfg.safety_factor
        before_step, before_beat = self.restored or (0.0, 0.0)
        step_to = max(self.floor, factor * longest[1], before_step)
        beat_to = max(self.floor, factor * max(longest[2], longest[1]), before_beat)
        # FT: sent to the rank monitor at once; checkpoints persist them (state_dict) for the
        # next incarnations.
        self._current = (step_to, beat_to)
        self._send(self._current)
        self.learned = True
        return True

    def _learned_state(self, step_to: float, beat_to: float) -> dict[str, Any]:
        """The start-up timeouts with learned ``step`` and subsequent-heartbeat ones (NVRx format)."""
        state = self._startup_state()
        current = state[self.client.CURRENT_TIMEOUTS_STATE_KEY]
        current["heartbeat"].update(subsequent=beat_to, were_calculated=True)
        if "section" in current:
            current["section"]["section"]["step"] = step_to
            current["section"]["calculated_sections"] = ["step"]
        return state

    def timeouts(self) -> str:
        """Current timeouts in words, for the log ("hang detection after 4.0 s without a step")."""
        if not self.enabled:
            return "no rank monitor"
        return describe_timeouts(self.client.hb_timeouts, getattr(self.client, "section_timeouts", None))

    def state_dict(self) -> dict[str, Any]:
        """What checkpoints persist: the learned (or restored) timeouts and the measured steps."""
        if not self.enabled:
            return {}
        # The same keys at every save (a save plan is reused while the layout holds).
        learned = self._steady()
        state = self._learned_state(*learned) if learned else self._startup_state()
        state[MEASURED_KEY] = self.measured.state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keeps a checkpoint's learned timeouts and measured steps for this incarnation's steps.

        Nothing is sent now: the set-up that follows is a phase of its own, and each step sends
        the bound of its kind (:meth:`step_section`); measured steps only ever grow.
        """
        if not self.enabled or not state:
            return
        self.measured.merge(Measured.from_state(state.get(MEASURED_KEY)))
        # FT: persisted learned timeouts survive restarts: they judge this incarnation's steady
        # steps from its third step and are the floor of its own learning.
        current = state.get(self.client.CURRENT_TIMEOUTS_STATE_KEY) or {}
        hb, sec = current.get("heartbeat") or {}, current.get("section") or {}
        beat = hb.get("subsequent") if hb.get("were_calculated") else None
        step = (sec.get("section") or {}).get("step") if "step" in (
            sec.get("calculated_sections") or ()) else None
        if beat is None and step is None:  # saved before anything was learned
            return
        either = float(beat if beat is not None else step)  # type: ignore[arg-type]
        loaded = (float(step) if step is not None else either,
                  float(beat) if beat is not None else either)
        # After an in-process restart this process may have learned a longer rhythm than the
        # snapshot it reloads holds: the longer one judges (never tighter than one survived).
        before = self.restored or loaded
        self.restored = (max(before[0], loaded[0]), max(before[1], loaded[1]))

    def close(self) -> None:
        """Closes every section and shuts the client down."""
        self.disconnect()
