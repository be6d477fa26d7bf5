"""Learned NVRx timeouts come from steady steps only, with the floor, sent through the state API;
every step runs under the bound of its kind (issue 37: start-up, pinning, steady)."""

from __future__ import annotations

from types import SimpleNamespace

from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.training.trainer.resilience import Monitor


class _Client:
    """Stands in for NVRx's RankMonitorClient: its current timeouts and what it was sent."""

    CURRENT_TIMEOUTS_STATE_KEY = "current_timeouts"

    def __init__(self) -> None:
        self.hb_timeouts = SimpleNamespace(initial=600.0, subsequent=300.0)
        self.section_timeouts = SimpleNamespace(
            section={"setup": 600.0, "step": 300.0, "checkpoint": 600.0}, out_of_section=300.0,
            calculated_sections=set(), is_out_of_section_calculated=False)
        self.loaded: list[dict] = []
        self.opened: list[str] = []
        self.is_initialized = True

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)

    def start_section(self, name: str) -> None:
        self.opened.append(name)

    def end_section(self, name: str) -> None:
        pass

    def send_heartbeat(self) -> None:
        pass

    @property
    def bounds(self) -> list[tuple[float, float]]:
        """The (step section, heartbeat) bounds sent so far, in order."""
        return [(state["current_timeouts"]["section"]["section"]["step"],
                 state["current_timeouts"]["heartbeat"]["subsequent"]) for state in self.loaded]


def _monitor(*sets: str) -> tuple[Monitor, _Client]:
    cfg = load_config("tiny", ["resilience.learn_after=3", "resilience.safety_factor=5",
                               *sets]).resilience
    m = Monitor(cfg, "nccl")
    m.enabled, m.client = True, _Client()
    return m, m.client


def test_only_steady_steps_count_and_the_floor_holds() -> None:
    m, client = _monitor("resilience.safety_factor=5", "resilience.min_learned_timeout=4")
    m.observe(9.0, None, steady=False)  # first step: compile, allocations
    m.observe(3.0, 3.1, steady=False)  # pinning the staging buffer in the background
    for _ in range(2):
        m.observe(0.30, 0.31, steady=True)
    assert not m.maybe_learn(lambda v: v)  # two steady steps: not yet
    m.observe(1.0, 1.02, steady=True)
    assert m.maybe_learn(lambda v: v) and m.learned
    state = client.loaded[-1]["current_timeouts"]
    # The configured start-up values (tiny preset), with the learned step and heartbeat.
    assert state["heartbeat"] == {"initial": 120.0, "subsequent": 5 * 1.02, "were_calculated": True}
    assert state["section"]["section"] == {"setup": 120.0, "step": 5.0, "checkpoint": 120.0}
    assert state["section"]["calculated_sections"] == ["step"]
    m.observe(50.0, 50.0, steady=True)  # after learning nothing moves them
    assert not m.maybe_learn(lambda v: v) and len(client.loaded) == 1


def test_fast_steps_get_the_floor_and_other_ranks_count() -> None:
    m, client = _monitor("resilience.min_learned_timeout=4")
    for _ in range(3):
        m.observe(0.05, 0.06, steady=True)
    # Another rank saw a 1.2 s steady step: the element-wise maximum over ranks decides.
    assert m.maybe_learn(lambda v: [max(a, b) for a, b in zip(v, [0.0, 1.2, 1.3], strict=True)])
    state = client.loaded[-1]["current_timeouts"]
    assert state["section"]["section"]["step"] == 5 * 1.2
    assert state["heartbeat"]["subsequent"] == 5 * 1.3
    m2, client2 = _monitor("resilience.min_learned_timeout=4")
    for _ in range(3):
        m2.observe(0.05, 0.06, steady=True)
    assert m2.maybe_learn(lambda v: v)
    got = client2.loaded[-1]["current_timeouts"]
    assert got["section"]["section"]["step"] == 4.0 and got["heartbeat"]["subsequent"] == 4.0


def test_a_rank_that_is_not_ready_holds_every_rank_back() -> None:
    m, client = _monitor()
    for _ in range(3):
        m.observe(0.1, 0.1, steady=True)
    assert not m.maybe_learn(lambda v: [1.0, *v[1:]])  # the reduced "not ready" flag is set
    assert client.loaded == [] and not m.learned


class _Server(_Client):
    """A client whose monitor server kept the last incarnation's learned timeouts (NVRx does)."""

    def __init__(self) -> None:
        super().__init__()
        self.is_initialized = False
        self.sent_at_init: list[dict] = []

    def init_workload_monitoring(self) -> None:
        self.is_initialized = True
        self.hb_timeouts = SimpleNamespace(initial=600.0, subsequent=4.0)  # what the server kept

    def end_all_sections(self) -> None:
        pass

    def shutdown_workload_monitoring(self) -> None:
        self.is_initialized = False


def _restarted(*sets: str) -> tuple[Monitor, _Server]:
    cfg = load_config("tiny", ["resilience.learn_after=3", "resilience.safety_factor=5",
                               "resilience.min_learned_timeout=4", *sets]).resilience
    m = Monitor(cfg, "nccl")
    m.enabled, m.client = True, _Server()
    return m, m.client


def _learned_4s() -> dict:
    return {"current_timeouts": {
        "heartbeat": {"initial": 120.0, "subsequent": 4.0, "were_calculated": True},
        "section": {"section": {"setup": 120.0, "step": 4.0, "checkpoint": 120.0},
                    "out_of_section": 60.0, "calculated_sections": ["step"],
                    "is_out_of_section_calculated": False}}}


def _step(m: Monitor, index: int, seconds: float, gap: float | None = None, *,
          pinning: bool = False, steady: bool = False) -> None:
    """Step ``index`` of the incarnation, as the trainer's loop runs it."""
    with m.step_section(index, pinning):
        pass
    m.observe(seconds, gap, steady)


def test_a_restarted_incarnation_connects_under_the_configured_timeouts() -> None:
    """Issue 29: the 4 s learned step timeout came back at once and killed the start-up."""
    m, client = _restarted()
    m.connect()
    startup = client.loaded[-1]["current_timeouts"]
    assert startup["heartbeat"] == {"initial": 120.0, "subsequent": 60.0, "were_calculated": False}
    assert startup["section"]["section"] == {"setup": 120.0, "step": 60.0, "checkpoint": 120.0}
    m.load_state_dict(_learned_4s())  # the resumed checkpoint's: kept, not sent (set-up follows)
    assert len(client.loaded) == 1 and not m.learned and m.restored == (4.0, 4.0)


def test_a_restarted_incarnation_is_judged_by_the_restored_rhythm_from_its_third_step() -> None:
    """Issue 37: restored, not relearned; its start-up and pinning steps have bounds of their own."""
    m, client = _restarted("resilience.first_steps_timeout=30")
    m.connect()
    m.load_state_dict({**_learned_4s(), "measured_steps": {"startup": 2.0, "pinning": 1.5}})
    _step(m, 0, 9.0)  # the first step after the restore: 30 s, the configured least
    _step(m, 1, 0.3, 0.4, pinning=True)  # 9 s measured now: 5 x 9 s
    _step(m, 2, 2.0, 2.1, pinning=True)  # the run's pinning steps: 5 x 1.5 s (the floor: 4 s)
    _step(m, 3, 0.2, 0.21, pinning=True)  # its own, slower pinning step: 5 x 2.1 s
    for index in (4, 5, 6):
        _step(m, index, 0.2, 0.21, steady=True)  # the restored rhythm, at once
    assert client.bounds[1:] == [(30.0, 30.0), (45.0, 45.0), (7.5, 7.5), (10.5, 10.5), (4.0, 4.0)]
    assert client.opened == ["step"] * 7  # every step in the step section, the first too
    assert m.maybe_learn(lambda v: v) and len(client.loaded) == 6  # relearned: the same 4 s
    assert m.measured.startup == 9.0 and m.measured.pinning == 2.1


def test_a_fresh_runs_first_steps_are_bounded_by_its_own_start_up() -> None:
    """Before anything is learned, safety_factor x its steps after the first, never 60 s."""
    m, client = _restarted("resilience.first_steps_timeout=30")
    m.connect()
    _step(m, 0, 0.5)
    _step(m, 1, 0.3, 1.5, pinning=True)  # its gap holds the staging banks' set-up: not counted
    _step(m, 2, 0.3, 0.35, pinning=True)  # the floor: 5 x 0.35 s is less
    _step(m, 3, 1.0, 1.2)  # a slower one raises the bound of the next: 5 x 1.2 s
    _step(m, 4, 0.3, 0.3)
    assert client.bounds[1:] == [(30.0, 30.0), (4.0, 4.0), (6.0, 6.0)]
    assert m.bounds().startswith("hang bounds: step 6.0 s, heartbeat gap 6.0 s (from this")


def test_measured_steps_persist_and_only_grow() -> None:
    m, _ = _restarted()
    m.connect()
    _step(m, 0, 3.0)
    _step(m, 1, 0.5, 0.6)
    _step(m, 2, 1.0, 1.1, pinning=True)
    saved = m.state_dict()
    assert saved["measured_steps"] == {"startup": 3.0, "pinning": 1.1}
    m2, _ = _restarted()
    m2.connect()
    m2.load_state_dict(saved)
    m2.load_state_dict({"measured_steps": {"startup": 1.0, "pinning": float("nan")}})
    m2.load_state_dict({"measured_steps": {"startup": "x"}})
    assert (m2.measured.startup, m2.measured.pinning) == (3.0, 1.1)
    assert set(m2.state_dict()) == set(saved)  # the same keys at every save


def test_without_learned_timeouts_the_configured_ones_judge_every_step() -> None:
    m, client = _restarted("resilience.learn_timeouts=false")
    m.connect()
    for index in range(4):
        _step(m, index, 0.1, 0.1, steady=index >= 2)
    assert len(client.loaded) == 1 and client.opened == ["setup", "step", "step", "step"]


def test_restored_timeouts_are_a_floor_and_persist_until_relearned() -> None:
    m, client = _restarted()
    m.connect()
    m.load_state_dict({"current_timeouts": {
        "heartbeat": {"initial": 120.0, "subsequent": 7.5, "were_calculated": True},
        "section": {"section": {"setup": 120.0, "step": 6.0, "checkpoint": 120.0},
                    "out_of_section": 60.0, "calculated_sections": ["step"],
                    "is_out_of_section_calculated": False}}})
    # A save during the start-up persists what was restored, not the start-up values.
    saved = m.state_dict()["current_timeouts"]
    assert saved["section"]["section"]["step"] == 6.0 and saved["heartbeat"]["subsequent"] == 7.5
    for _ in range(3):
        m.observe(0.1, 0.1, steady=True)
    assert m.maybe_learn(lambda v: v)
    got = client.loaded[-1]["current_timeouts"]
    assert got["section"]["section"]["step"] == 6.0 and got["heartbeat"]["subsequent"] == 7.5


def test_unlearned_state_is_not_taken_for_learned() -> None:
    m, client = _restarted()
    m.connect()
    before = m.state_dict()  # nothing learned yet: the start-up values, flagged as such
    assert before["current_timeouts"]["heartbeat"]["were_calculated"] is False
    m.load_state_dict(before)
    assert m.restored is None
    assert set(before["current_timeouts"]) == set(_learned_4s()["current_timeouts"])


def test_an_in_process_restart_relearns_with_the_last_learning_as_floor() -> None:
    m, client = _restarted()
    m.connect()
    for _ in range(3):
        m.observe(1.0, 1.0, steady=True)
    assert m.maybe_learn(lambda v: v)  # 5.0 s
    m.connect()  # in-process re-entry
    assert not m.learned and m.restored == (5.0, 5.0)
    m.load_state_dict(_learned_4s())  # its snapshot was saved before the 5 s were learned
    assert m.restored == (5.0, 5.0)
    assert client.loaded[-1]["current_timeouts"]["section"]["section"]["step"] == 60.0
    for _ in range(3):
        m.observe(0.1, 0.1, steady=True)
    assert m.maybe_learn(lambda v: v)
    assert client.loaded[-1]["current_timeouts"]["section"]["section"]["step"] == 5.0


class _StrictClient(_Client):
    """Refuses what NVRx's client refuses: anything after shutdown_workload_monitoring."""

    def __init__(self) -> None:
        super().__init__()
        self.after_shutdown: list[str] = []

    def _alive(self, what: str) -> None:
        if not self.is_initialized:
            self.after_shutdown.append(what)
            raise RuntimeError(f"{what} after shutdown")

    def end_all_sections(self) -> None:
        self._alive("end_all_sections")

    def shutdown_workload_monitoring(self) -> None:
        self._alive("shutdown")
        self.is_initialized = False

    def end_section(self, name: str) -> None:
        self._alive("end_section")

    def send_heartbeat(self) -> None:
        self._alive("heartbeat")

    def load_state_dict(self, state: dict) -> None:
        self._alive("load_state_dict")
        super().load_state_dict(state)


def test_the_wrappers_abort_disconnects_a_rank_blocked_inside_its_step() -> None:
    """Issue 37: a healthy rank blocked in a collective with the faulted one (gloo waits
    pg_timeout) must not be judged by its step rhythm once the in-process restart is decided:
    the wrapper's abort, on its monitor thread, disconnects it; the main thread's section then
    ends without another call to the client (the step's heartbeat and bounds neither)."""
    import nvidia_resiliency_ext.inprocess as inprocess

    from kfp_nvrx.components.training.trainer.restart_clock import RestartClock, clock_hooks

    m, _ = _monitor()
    client = m.client = _StrictClient()
    clock = RestartClock()
    _, _, abort = clock_hooks(inprocess, clock, on_abort=m.disconnect)
    with m.section("step"):  # the main thread, blocked in its step's collective
        abort(None)  # the monitor thread decides the restart
        assert not client.is_initialized
        m.heartbeat()
        m._send((30.0, 30.0))
    m.disconnect()  # the main thread's error path, after the collective gave up
    assert client.after_shutdown == [] and clock.abort_s is not None
