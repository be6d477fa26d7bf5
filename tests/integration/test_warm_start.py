"""Issue 37 item 2 on CPU: workers started warm from their agent's zygote.

Real ft_launcher agents (NVRx 0.4.1 here), gloo, 2 local nodes x 1 process, the tiny preset with
``resilience.warm_start=true`` (the default, set explicitly). Every incarnation
must start from the zygote (its ``boot`` has ``handoff``, no ``imports``), and every fault path a
cold worker takes must end the same way: restarts == faults with final weights bitwise equal to a
cold, fault-free run; a stop saves its step; workers name (and, to end the job, signal) their
*agent*, not the zygote that forked them; no zygote or forked worker outlives its launch.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from support.local_runs import assert_bitwise, final_weights, run_local, tiny_dataset, train

from kfp_nvrx.components.core import events as ev
from kfp_nvrx.components.core.events import read_events
from kfp_nvrx.components.launch.jobspec.spec import JobSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 24
BASE = [f"train.steps={STEPS}", "checkpoint.interval=6", "checkpoint.keep=5"]
WARM = "resilience.warm_start=true"
ZYGOTE = b"kfp_nvrx.components.training.trainer.zygote"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return tiny_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    """A cold, fault-free run."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    train(run_dir, dataset, [*BASE, "resilience.warm_start=false"])
    return final_weights(run_dir, STEPS)


@pytest.fixture(autouse=True)
def no_zygote_left():
    yield
    assert _zygotes() == [], "a zygote outlived its launch"


def _zygotes() -> list[int]:
    """Live zygotes started under this file's tests (by this pytest worker).

    Another worker may run a zygote of its own meanwhile (test_pod_child's stand-in runs under
    the zygote's module name): the zygote's environment, inherited from pytest, names the test.
    """
    mine = f"{Path(__file__).name}::".encode()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "").encode()
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
                if ZYGOTE not in cmd.split(b"\0"):
                    continue
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                with open(entry / "environ", "rb") as f:
                    env = dict(kv.partition(b"=")[::2] for kv in f.read(1 << 20).split(b"\0"))
            except (OSError, IndexError):
                continue
            if state != "Z" and mine in env.get(b"PYTEST_CURRENT_TEST", b"") \
                    and env.get(b"PYTEST_XDIST_WORKER", b"") == worker:
                out.append(int(entry.name))
    return out


def _boots(run_dir: Path) -> list[dict[str, float]]:
    return [e.boot for e in read_events(run_dir) if isinstance(e, ev.Start) and e.boot]


def _assert_warm(run_dir: Path, incarnations: int) -> None:
    boots = _boots(run_dir)
    # Both nodes' rank 0 (the event writer): one start per incarnation; each forked.
    assert len(boots) == incarnations, boots
    assert all("handoff" in b and "imports" not in b for b in boots), boots


def test_a_kill_and_a_hang_restart_warm_and_resume_bitwise(tmp_path, dataset, reference):
    run = tmp_path / "run"
    train(run, dataset, [*BASE, WARM], faults=["kill@8/1", "hang@15/0"])
    restarts = [e for e in read_events(run) if isinstance(e, ev.Restart)]
    assert [r.kind for r in restarts] == ["in-job", "in-job"]
    _assert_warm(run, 3)
    assert_bitwise(final_weights(run, STEPS), reference)


def test_an_in_process_restart_of_a_warm_worker(tmp_path, dataset, reference):
    run = tmp_path / "run"
    train(run, dataset, [*BASE, WARM, "resilience.in_process=true"], faults=["raise@9/1"])
    restarts = [e for e in read_events(run) if isinstance(e, ev.Restart)]
    assert [r.kind for r in restarts] == ["in-process"]
    assert_bitwise(final_weights(run, STEPS), reference)


def test_a_stop_reaches_the_warm_worker_which_saves_its_step(tmp_path, dataset):
    run = tmp_path / "run"

    def stop_at_step_8() -> None:
        while not any(isinstance(e, ev.Step) and e.step >= 8 for e in read_events(run)):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # this process is the launcher

    watcher = threading.Thread(target=stop_at_step_8, daemon=True)
    watcher.start()
    spec = JobSpec(nodes="2", run_dir=str(run), config="tiny",
                   overrides=[f"data.path={dataset}", *BASE, WARM, "train.step_sleep=0.3"])
    res = run_local(spec, log=lambda _l: None, deadline_s=480)
    watcher.join(timeout=5)
    assert res.state == "Cancelled", res.reason
    [end] = [e for e in read_events(run) if isinstance(e, ev.End)]
    assert end.status == "stopped" and 8 <= end.step < STEPS
    saves = [e.step for e in read_events(run) if isinstance(e, ev.Checkpoint)]
    assert end.step in saves  # the SIGTERM went through the stand-in to the forked worker


def test_warm_workers_name_their_agent_not_the_zygote(tmp_path, dataset):
    """A forked worker's parent is the zygote; what names or signals the agent (the join record,
    the restart budget's verdict, which SIGTERMs it, the host copy's owner) must reach ft_launcher.
    """
    run = tmp_path / "run"
    lines: list[str] = []
    spec = JobSpec(nodes="2", run_dir=str(run), config="tiny", faults=["kill@8/1"],
                   overrides=[f"data.path={dataset}", *BASE, WARM])
    res = run_local(spec, log=lines.append, deadline_s=480)
    assert res.state == "Succeeded", res.reason
    launchers = {int(m) for line in lines for m in re.findall(r"ft_launcher(\d+)@", line)}
    joins = [e for e in read_events(run) if isinstance(e, ev.Join)]
    starts = [e for e in read_events(run) if isinstance(e, ev.Start)]
    assert len(joins) >= 4 and len(starts) == 2
    for record in (*joins, *starts):
        assert int(record.agent.split("/")[2]) in launchers, (record.agent, launchers)
    _assert_warm(run, 2)
