"""The typed events of a run and the one place restarts are counted from (issue 24 item 5).

The trainer's events are typed classes whose on-disk form is the JSON the trainer always wrote
(old run dirs read, old readers read ours); every launcher's result takes restarts by layer,
goodput and recovery from them, and log lines count nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kfp_nvrx.components.core.events import (
    End,
    EventLog,
    Fault,
    Other,
    Restart,
    Start,
    Step,
    parse_event,
    read_events,
)
from kfp_nvrx.components.launch.kube.logs import Progress
from kfp_nvrx.components.launch.result import (
    LaunchResult,
    RestartsSoFar,
    account_run_dir,
)

T0 = 1_790_000_000.0


def test_the_written_lines_are_the_dicts_the_trainer_always_wrote(tmp_path: Path) -> None:
    log = EventLog(tmp_path)
    log.emit(Start(time=T0, incarnation=0, iteration=0, world_size=2, resumed_from=None,
                   load_s=0.1, run_id="r1"))
    log.emit(Step(time=T0 + 2, step=1, start=T0 + 1, end=T0 + 2, loss=float("inf"), tokens=8))
    log.emit(Fault(time=T0 + 3, kind="kill", step=1, rank=1))
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert lines[0] == {"type": "start", "time": T0, "incarnation": 0, "iteration": 0,
                        "world_size": 2, "resumed_from": None, "load_s": 0.1, "run_id": "r1"}
    assert "layer" not in lines[0]  # only a restart's start names its layer, as before
    assert lines[1]["loss"] is None and lines[1]["type"] == "step"  # no Infinity: no JSON
    assert lines[2] == {"type": "fault", "time": T0 + 3, "kind": "kill", "step": 1, "rank": 1}


def test_an_old_run_dir_reads_typed_and_keeps_what_this_version_does_not_name(
        tmp_path: Path) -> None:
    old = [  # as an earlier trainer wrote them: no layer, fields added later missing
        {"type": "start", "time": T0, "incarnation": 0, "iteration": 0, "world_size": 2,
         "resumed_from": None, "load_s": 0.1, "boot": {"total": 1.5}, "someday": 1},
        {"type": "step", "time": T0 + 2, "step": 1, "start": T0 + 1, "end": T0 + 2,
         "incarnation": 0, "iteration": 0, "loss": 5.0, "tokens": 64},
        {"type": "checkpoint_v9", "time": T0 + 3, "whatever": [1]},
        {"type": "end", "time": T0 + 4, "step": 1, "status": "completed"},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in old))
    start, step, other, end = read_events(tmp_path)
    assert isinstance(start, Start) and start.boot == {"total": 1.5} and start.layer is None
    assert start.unnamed == {"someday": 1}
    assert isinstance(step, Step) and step.seconds == 1.0 and step.loss == 5.0
    assert isinstance(other, Other) and other.to_dict() == old[2]
    assert isinstance(end, End) and end.completed


def test_a_required_field_is_named_when_missing() -> None:
    with pytest.raises(ValueError, match="no kind"):
        parse_event({"type": "restart", "time": T0})
    with pytest.raises(ValueError, match="no end"):
        parse_event({"type": "step", "time": T0, "step": 1, "start": T0})


def _run_dir(tmp_path: Path, layers: list[str]) -> Path:
    log = EventLog(tmp_path)
    log.emit(Start(time=T0, run_id="r1"))
    log.emit(Step(time=T0 + 2, step=1, start=T0 + 1, end=T0 + 2))
    for i, layer in enumerate(layers, start=1):
        log.emit(Restart(time=T0 + 10 * i, kind=layer, incarnation=i))
        log.emit(Start(time=T0 + 10 * i, incarnation=i, run_id="r1", resumed_from=1, layer=layer))
        log.emit(Step(time=T0 + 10 * i + 2, step=2, start=T0 + 10 * i + 1, end=T0 + 10 * i + 2,
                      incarnation=i))
    return tmp_path


def test_every_layer_is_a_named_field_of_the_result(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, ["in-job", "pod", "in-job", "in-process"])
    result = LaunchResult(name="j", backend="kubernetes", state="Succeeded", run_dir=str(run_dir))
    account_run_dir(result, run_dir)
    assert (result.restarts, result.restarts_in_job, result.restarts_pod,
            result.restarts_in_process) == (4, 2, 1, 1)
    assert len(result.recovery_s) == 4 and 0 < result.goodput < 1
    assert result.restarts_text() == "4 (in-job 2, in-process 1, pod 1)"
    assert result.to_dict()["summary"]["restarts"] == {"in-job": 2, "pod": 1, "in-process": 1}
    live = RestartsSoFar(run_dir, chunk=256)  # a small chunk: the lines come over several reads
    assert [live.count() for _ in range(40)][-1] == 4
    with open(run_dir / "events.jsonl", "a") as fh:  # a restart being written: not yet counted
        fh.write('{"type":"restart","time":1790000100,"kind":"pod"')
    assert live.count() == 4
    with open(run_dir / "events.jsonl", "a") as fh:
        fh.write("}\n")
    assert live.count() == 5 and live.count() == 5  # counted once


def test_a_run_dir_the_launcher_cannot_see_leaves_restarts_unknown(tmp_path: Path) -> None:
    result = LaunchResult(name="j", backend="kubernetes", state="Succeeded",
                          run_dir=str(tmp_path / "on-the-pvc"))
    assert account_run_dir(result, result.run_dir) is None
    assert result.restarts is None and result.goodput is None
    assert result.restarts_text().startswith("unknown")
    assert RestartsSoFar(result.run_dir).count() is None


def test_log_lines_count_no_restart() -> None:
    progress = Progress()
    for line in ("[trainer] start: world_size=2 incarnation=0.0",
                 "[trainer] start: world_size=2 incarnation=3.1",
                 "3/3 attempts left; will restart worker group",
                 "[trainer] step 6/12 loss 3.0"):
        progress.feed(line)
    assert progress.summary() == "step 6/12 (50%)"  # the step only: restarts are events
    assert progress.summary(restarts=1) == "step 6/12 (50%), restarts 1"


def test_restarts_unknown_is_a_few_words_and_the_way_to_know_them_a_line_of_its_own(
        capsys) -> None:
    """Issue 38 item 8: every launch without the volume ended with a ~300-character line."""
    from kfp_nvrx.components.cli.commands.launch import _report

    result = LaunchResult(name="llm", backend="kubernetes", state="Succeeded",
                          run_dir="/fsx/runs/llm",
                          extra={"pvc": "fsx-claim", "run_dir_uri": "pvc://fsx-claim/runs/llm"})
    assert result.restarts_text() == "unknown (PVC 'fsx-claim' is not mounted here)"
    assert _report(result) == 0
    summary, hint = capsys.readouterr().out.splitlines()
    assert len(summary) < 160, summary
    assert hint == ("restart counts: mount PVC 'fsx-claim' here at /fsx, or run `kfp-nvrx "
                    "goodput --run-dir /fsx/runs/llm` where it is mounted")
