"""Issue 38 item 6: goodput and the launcher agree on a preempted job.

Kueue's preemption stops the pods (the trainer saves and writes ``end`` stopped), holds the job,
and new pods start on its re-admission: from the pods' events alone, a pod restart whose
recovery is the time queued (``restarts {'pod': 1}``, ``recovery_s [72.6]`` of which 53 s
queued, ``queued_s 0``). The launcher sees the queue: it writes each wait into the run dir, or
prints it for ``kfp-nvrx goodput --queued``; with either, goodput counts a preemption (a
resume), no restart and no recovery. A pod deleted by hand (no queue in between) stays a pod
restart with its recovery, as the launcher counts it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kfp_nvrx.components.core.events import EventLog, Queued, parse_events, read_events
from kfp_nvrx.components.core.goodput import summarize_events

T0 = 1_790_000_000.0
STOP_AT = 4
#: Kueue's eviction (just after the stop began) to the re-admission: 53 s queued.
WAIT = (T0 + 5.2, T0 + 58.2)


def _round(t: float, agents: tuple[str, str], pid: int) -> list[dict]:
    """Both nodes' joins of a round (node 0's worker is rank 0, pid ``pid``)."""
    return [{"type": "join", "time": t + 0.1 * n, "agent": a, "node": n, "nodes": 2, "rank": n,
             "pid": pid + n, "run_id": "kq-low"} for n, a in enumerate(agents)]


def _steps(first: int, last: int, t: float, inc: int = 0) -> list[dict]:
    return [{"type": "step", "time": t + n - first + 1, "step": n, "start": t + n - first,
             "end": t + n - first + 1, "incarnation": inc, "loss": 1.0 / n, "tokens": 64}
            for n in range(first, last + 1)]


def _stopped_and_restarted(gap_s: float) -> list[dict]:
    """Steps 1-4, a stop (step 4 saved), ``gap_s`` later new pods on both nodes resume at 4."""
    ev = _round(T0 - 2, ("boot/1/13/100", "boot/2/13/100"), 20)
    ev.append({"type": "start", "time": T0 - 1, "incarnation": 0, "iteration": 0,
               "resumed_from": None, "pid": 20, "run_id": "kq-low", "agent": "boot/1/13/100"})
    ev += _steps(1, STOP_AT, T0)
    ev.append({"type": "end", "time": T0 + STOP_AT + 0.5, "step": STOP_AT, "status": "stopped"})
    t = T0 + STOP_AT + gap_s
    ev += _round(t, ("boot/3/13/200", "boot/4/13/200"), 20)
    ev.append({"type": "start", "time": t + 1, "incarnation": 1, "iteration": 0,
               "resumed_from": STOP_AT, "pid": 20, "run_id": "kq-low", "agent": "boot/3/13/200",
               "layer": "pod"})
    ev.append({"type": "restart", "time": t + 1.5, "kind": "pod", "incarnation": 1,
               "iteration": 0})
    ev += _steps(STOP_AT + 1, 8, t + 2, inc=1)
    ev.append({"type": "end", "time": t + 7, "step": 8, "status": "completed"})
    return ev


def test_a_readmission_is_a_preemption_not_a_pod_restart_nor_a_recovery() -> None:
    events = parse_events(_stopped_and_restarted(gap_s=60.0))
    plain = summarize_events(events)  # what the pods' events alone say (the issue's report)
    assert plain.restarts == {"pod": 1} and plain.recovery_s and plain.queued_s == 0
    rep = summarize_events(events, [WAIT])
    assert rep.restarts == {} and rep.preemptions == 1 and rep.recovery_s == []
    assert rep.queued_s == 53.0 and rep.wall_s == pytest.approx(plain.wall_s - 53.0)
    assert rep.resume_s == [round(plain.recovery_s[0] - 53.0, 3)]  # the stop to the first step
    assert rep.what_happened[0].startswith(f"preempted at step {STOP_AT}, resumed from step "
                                           f"{STOP_AT} in "), rep.what_happened
    assert "after 53 s queued, 0 steps redone" in rep.what_happened[0], rep.what_happened


def test_a_pod_deleted_by_hand_stays_a_pod_restart_with_its_recovery() -> None:
    """No queue held the job between the stop and the new pods: they were recreated for it (the
    launcher counts them); a wait before the run (its first admission) changes nothing."""
    events = parse_events(_stopped_and_restarted(gap_s=20.0))
    before_run = (T0 - 60.0, T0 - 3.0)
    for waits in ([], [before_run]):
        rep = summarize_events(events, waits)
        assert rep.restarts == {"pod": 1} and rep.preemptions == 0 and rep.resume_s == []
        assert len(rep.recovery_s) == 1 and rep.recovery_s[0] > 15, rep.recovery_s
        assert rep.queued_s == 0.0
        assert rep.what_happened[0].startswith(f"pods recreated after step {STOP_AT}")


def test_the_launchers_record_in_the_run_dir_and_the_flag_agree(tmp_path: Path) -> None:
    """The record written into events.jsonl (a KFP task, the volume mounted) and the waits a
    launcher without the volume printed (--queued) give the same report; both at once (a
    re-attached launcher writes a wait again) count it once."""
    raw = _stopped_and_restarted(gap_s=60.0)
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in raw))
    flag = _goodput(tmp_path, "--queued", f"{WAIT[0]}-{WAIT[1]}")
    EventLog(tmp_path).emit(Queued(start=WAIT[0], end=WAIT[1], after="preemption"))
    EventLog(tmp_path).emit(Queued(start=T0 - 30.0, end=T0 - 3.0))  # the first admission's
    recorded = _goodput(tmp_path)
    both = _goodput(tmp_path, "--queued", f"{WAIT[0]}-{WAIT[1]}")
    for rep in (flag, recorded, both):
        assert rep["restarts"] == {} and rep["preemptions"] == 1 and rep["recovery_s"] == []
        assert rep["queued_s"] == 53.0
    assert recorded["wall_s"] == flag["wall_s"] == both["wall_s"]  # a late line adds no time
    assert recorded["queued"] == [[T0 - 30.0, T0 - 3.0], list(WAIT)]


@pytest.mark.parametrize("value", ["soon", "5-3", "1790000000", "1-2,x-y", "-1-5", "1-nan"])
def test_a_bad_queued_flag_is_one_line_naming_it(tmp_path: Path, value: str) -> None:
    (tmp_path / "events.jsonl").write_text(json.dumps(_steps(1, 1, T0)[0]) + "\n")
    proc = _cli(tmp_path, f"--queued={value}")
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "--queued" in err[0] and "START-END" in err[0], err


def test_the_launcher_writes_each_ended_wait_once_into_a_begun_run(tmp_path: Path) -> None:
    """Never before the trainer began the file (a launcher creates no run files), each ended
    wait once, a wait still going on not until it ends."""
    from kfp_nvrx.components.launch.kube.queue_record import QueueRecord

    said: list[str] = []
    record = QueueRecord(tmp_path, said.append)
    first = (T0 - 30.0, T0 - 3.0, "creation", "insufficient unused quota for cpu")
    assert record.write([first]) is False and not (tmp_path / "events.jsonl").exists()
    EventLog(tmp_path).emit(parse_events(_steps(1, 1, T0))[0])
    going = (WAIT[0], 0.0, "preemption", "Preempted: by a higher priority workload")
    assert record.write([first, going]) is True
    assert record.write([first, (WAIT[0], WAIT[1], "preemption", going[3])]) is True
    assert record.write([first, (WAIT[0], WAIT[1], "preemption", going[3])]) is True
    lines = [e for e in read_events(tmp_path) if isinstance(e, Queued)]
    assert [(e.start, e.end, e.after) for e in lines] == [first[:3], (*WAIT, "preemption")]
    assert said == []


def test_a_launcher_without_the_volume_sends_goodput_the_waits(tmp_path: Path) -> None:
    """The hint line of a launcher that could not write the run dir carries the waits after a
    preemption; run as printed, goodput gives the launcher's counts."""
    from kfp_nvrx.components.launch.result import LaunchResult

    run_dir = tmp_path / "fsx" / "runs" / "kq-low"
    queue = {"recorded": False, "waits": [
        {"start": T0 - 30.0, "end": T0 - 3.0, "after": "creation"},
        {"start": WAIT[0], "end": WAIT[1], "after": "preemption"}]}
    result = LaunchResult(name="kq-low", backend="kubernetes", state="Succeeded",
                          run_dir=str(run_dir), extra={"pvc": "fsx-claim", "queue": queue,
                                                       "run_dir_uri": "pvc://fsx-claim/runs/kq-low"})
    hint = result.restarts_hint()
    command = hint.split("`")[1].split()
    assert command[:4] == ["kfp-nvrx", "goodput", "--run-dir", str(run_dir)], hint
    assert command[4:] == ["--queued", f"{WAIT[0]:.1f}-{WAIT[1]:.1f}"], hint
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in _stopped_and_restarted(gap_s=60.0)))
    rep = _goodput(run_dir, *command[4:])
    assert rep["restarts"] == {} and rep["preemptions"] == 1 and rep["queued_s"] == 53.0
    queue["recorded"] = True  # the run dir has them: goodput needs no flag
    assert "--queued" not in result.restarts_hint()


def _cli(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "goodput",
                           "--run-dir", str(run_dir), "--json", *extra], capture_output=True,
                          text=True, timeout=120)


def _goodput(run_dir: Path, *extra: str) -> dict:
    proc = _cli(run_dir, *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_launchers_line_in_the_middle_of_a_step_is_no_disorder(tmp_path: Path) -> None:
    """The launcher appends a wait when it learns of it; a step under way then (logged at its end,
    timed from its start) follows it in the file: neither is out of order."""
    steps = _steps(1, 3, T0)
    lines = [steps[0], {"type": "queued", "time": T0 + 3.5, "start": T0 - 30, "end": T0 - 3},
             steps[1], steps[2]]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    warnings: list[str] = []
    events = read_events(tmp_path, warnings.append)
    assert warnings == [] and len(events) == 4
