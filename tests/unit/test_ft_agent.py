"""The agent's replacements for NVRx 0.7's fixed restart-path waits (``ft_agent``).

The process-group part runs real processes. NVRx 0.7 does not install on these machines, so the
patching is checked against the installed 0.4.1 (nothing replaced) and against a module shaped as
0.7's (names and signatures as in its source); ``tests/gpu/test_ft_agent_nvrx07.py`` applies it to
the real 0.7 on the GPU machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import ModuleType, SimpleNamespace

import pytest

from kfp_nvrx.components.training import ft_agent
from kfp_nvrx.components.training.ft_agent import group_alive, patch_launcher, terminate_groups

#: A child in its own process group: ``term`` exits on SIGTERM, ``stubborn`` ignores it.
CHILD = {
    "term": "import time\nprint('up', flush=True)\ntime.sleep(300)\n",
    "stubborn": ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                 "print('up', flush=True)\ntime.sleep(300)\n"),
}


def _group(kind: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD[kind]], start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"  # its handler is installed
    return proc


def test_a_group_that_ends_on_sigterm_is_not_waited_for() -> None:
    proc = _group("term")
    t0 = time.monotonic()
    terminate_groups([proc.pid], grace_s=60.0, poll_s=0.01)
    # Far below the grace: it returned once the group was gone, not when the grace ended.
    assert time.monotonic() - t0 < 30.0
    assert proc.wait(timeout=10) == -signal.SIGTERM


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    proc = _group("stubborn")
    terminate_groups([proc.pid], grace_s=0.3, poll_s=0.01)
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_group_one_means_hands_off_as_in_nvrx() -> None:
    proc = _group("term")
    try:
        terminate_groups([proc.pid, 1], grace_s=0.1)
        assert proc.poll() is None and group_alive(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert not group_alive(proc.pid)


def test_a_group_of_zombies_is_gone() -> None:
    """An exited member nobody reaped yet (an orphan waits for init) holds nothing."""
    proc = _group("term")
    os.killpg(proc.pid, signal.SIGKILL)
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    assert not group_alive(proc.pid)
    proc.wait(timeout=10)


def test_a_group_inside_our_session_is_seen() -> None:
    """A worker's group need not lead a session (its group id is not its session id)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD["stubborn"]], process_group=0,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        assert os.getsid(proc.pid) != proc.pid and group_alive(proc.pid)
    finally:
        terminate_groups([proc.pid], grace_s=0.2)
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_gone_groups_and_reused_ids_are_no_error() -> None:
    proc = _group("term")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    terminate_groups([proc.pid], grace_s=5.0)  # nothing to signal, nothing raised


def test_installed_nvrx_041_runs_unchanged() -> None:
    """0.4.1's terminate_mp_processes takes (allowed_ppids, allowed_pgids) and it has no
    barrier rendezvous: nothing is replaced."""
    from nvidia_resiliency_ext.fault_tolerance import launcher

    before = launcher.terminate_mp_processes
    try:
        from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier as barrier
    except ImportError:
        barrier = None
    if barrier is not None:
        pytest.skip("this NVRx has the barrier rendezvous: tests/gpu covers it")
    assert patch_launcher(launcher, None) == []
    assert launcher.terminate_mp_processes is before


def _nvrx07_shaped() -> tuple[ModuleType, ModuleType, list[str]]:
    """Modules with 0.7's names and signatures; the wait records what ran before it."""
    calls: list[str] = []
    launcher = ModuleType("launcher")

    def terminate_mp_processes(allowed_pgids):  # noqa: ANN001, ANN202
        calls.append("nvrx terminate")

    launcher.terminate_mp_processes = terminate_mp_processes

    class _RendezvousBarrierState:
        def _sync_from_per_round_state(self) -> bool:
            calls.append("sync")
            return True

        def _wait_for_rendezvous_open(self, node_desc, stop_event=None):  # noqa: ANN001, ANN202
            calls.append(f"wait {node_desc} {stop_event}")
            return "opened"

    barrier = ModuleType("ft_rendezvous_barrier")
    barrier._RendezvousBarrierState = _RendezvousBarrierState
    return launcher, barrier, calls


def test_nvrx07_shaped_modules_get_both_replacements_once() -> None:
    launcher, barrier, calls = _nvrx07_shaped()
    assert patch_launcher(launcher, barrier) == ["terminate_mp_processes",
                                                 "_wait_for_rendezvous_open"]
    assert launcher.terminate_mp_processes is terminate_groups
    state = barrier._RendezvousBarrierState()
    assert state._wait_for_rendezvous_open("node0", stop_event="ev") == "opened"
    assert calls == ["sync", "wait node0 ev"]  # the round synced before the first wait
    # Patching twice (a second import of the agent in one process) replaces nothing again.
    assert patch_launcher(launcher, barrier) == []
    calls.clear()
    state._wait_for_rendezvous_open("node0")
    assert calls == ["sync", "wait node0 None"]


def test_another_shape_is_left_alone() -> None:
    """A future NVRx whose functions changed shape runs unpatched rather than misdriven."""
    launcher, barrier, _ = _nvrx07_shaped()
    launcher.terminate_mp_processes = lambda allowed_pgids, grace: None
    barrier._RendezvousBarrierState._sync_from_per_round_state = None
    assert patch_launcher(launcher, barrier) == []
    assert patch_launcher(SimpleNamespace(), None) == []  # type: ignore[arg-type]


def test_the_agent_is_nvrx_ft_launcher_under_our_name(tmp_path) -> None:  # noqa: ANN001
    """The console script runs NVRx's own parser and usage (same flags, same help)."""
    out = subprocess.run([sys.executable, "-m", ft_agent.__name__, "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: ft_launcher")
    assert "--ft-rank-heartbeat-timeout" in out.stdout.replace("_", "-")


def test_the_pod_env_and_the_local_agents_ask_for_warm_starts_as_the_config_says() -> None:
    from kfp_nvrx.components.core.config import ResilienceConfig
    from kfp_nvrx.components.core.launch_command import WARM_START_ENV, agent_env
    from kfp_nvrx.components.core.pod_env import default_env

    on, off = ResilienceConfig(), ResilienceConfig(warm_start=False)  # on by default
    assert agent_env(on) == {WARM_START_ENV: "1"} and agent_env(off) == {}
    for gpu in (False, True):
        assert default_env(gpu, on, "/fsx/run")[WARM_START_ENV] == "1"
        assert WARM_START_ENV not in default_env(gpu, off, "/fsx/run")
