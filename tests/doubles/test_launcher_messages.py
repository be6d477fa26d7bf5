"""What the launcher says when a job name is taken (issue 30 item 8), against the API double."""

from __future__ import annotations

import pytest
from support.k8s_launch import launch_on

from kfp_nvrx.components.core.fields import CLI
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec.resolve import resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.pytorchjob.render import render

SPEC = dict(image="img:1", pvc="fsx", instance_type="cpu", nodes="1", name="reused")


def _existing(double, owner: str) -> None:
    job = render(resolve(JobSpec(**SPEC))).to_dict()
    job["metadata"]["namespace"] = "default"
    annotations = job["metadata"].setdefault("annotations", {})
    annotations.pop(naming.RUN_ID_KEY, None)
    if owner:
        annotations[naming.RUN_ID_KEY] = owner
    double.put_job(job)


@pytest.mark.parametrize(("owner", "run_id", "says"), [
    ("", "", "neither it nor this launch has a run id"),
    ("run-a", "", "belongs to run 'run-a'; give --run-id run-a to follow it"),
    ("", "run-b", "was made without a run id, not by run 'run-b'"),
    ("run-a", "run-b", "belongs to run 'run-a', not 'run-b'"),
])
def test_a_taken_name_says_whose_it_is(double, owner: str, run_id: str, says: str) -> None:
    """Without --run-id it said "belongs to run '(none)', not '(none)'"."""
    _existing(double, owner)
    with pytest.raises(UserError) as err:
        launch_on(double, JobSpec(**SPEC, run_id=run_id), log=lambda _l: None)
    line = CLI.reword(err.value).one_line()
    assert line.startswith("--name: ") and says in line and "(none)" not in line, line
    assert not double.calls("POST") and not double.calls("DELETE")


def test_demo_picks_its_fault_from_steps_and_blames_only_what_was_given() -> None:
    """``demo --steps 10`` was refused for a default --fault kill@25/1 the user never gave,
    after the data had been written (issue 30.17)."""
    import argparse

    from kfp_nvrx.components.cli.commands.demo import _checked

    assert _checked(argparse.Namespace(steps=10, fault=None)) == "kill@4/1"
    assert _checked(argparse.Namespace(steps=60, fault=None)) == "kill@25/1"  # as documented
    with pytest.raises(UserError) as err:
        _checked(argparse.Namespace(steps=10, fault="kill@25/1"))
    assert err.value.field == "--fault" and "after the last step (10)" in err.value.message


def test_a_stopped_agents_shutdown_noise_stays_in_its_node_log(tmp_path) -> None:
    """Every normal cancel printed NVRx's CancelledError traceback and SignalException lines
    from the agents the launcher itself stopped (issue 30.17)."""
    import os
    import sys
    import time

    from kfp_nvrx.components.launch.local.agent import Agent, NodeOutput

    script = ("import signal, sys, time\n"
              "def stop(*_):\n"
              "    print('[ERROR] Exception in callback StreamReaderProtocol', flush=True)\n"
              "    print('Traceback (most recent call last):', flush=True)\n"
              "    print('asyncio.exceptions.CancelledError', flush=True)\n"
              "    print('[ERROR] Agent .run() raised SignalException: got signal: 15', flush=True)\n"
              "    sys.exit(1)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "print('[trainer] step 1/9 loss 2.0', flush=True)\n"
              "time.sleep(60)\n")
    shown: list[str] = []
    (tmp_path / "logs").mkdir()
    agent = Agent(0, [sys.executable, "-c", script], dict(os.environ),
                  NodeOutput(shown.append, False, tmp_path / "logs" / "node0.log"))
    deadline = time.monotonic() + 30
    while not shown and time.monotonic() < deadline:
        time.sleep(0.05)
    agent.stop(grace=10)
    agent.thread.join(10)
    assert shown == ["[node0] [trainer] step 1/9 loss 2.0"], shown
    kept = (tmp_path / "logs" / "node0.log").read_text()
    assert "CancelledError" in kept and "SignalException" in kept  # nothing lost


def test_ctrl_c_while_the_commands_load_is_one_line(monkeypatch, capsys) -> None:
    """Ctrl-C in the first moments printed a KeyboardInterrupt traceback (issue 30.17)."""
    from kfp_nvrx.components.cli import main as cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["goodput", "--run-dir", "x"]) == 130
    assert capsys.readouterr().err == "kfp-nvrx: interrupted (SIGINT)\n"
