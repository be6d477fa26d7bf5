"""``kfp-nvrx goodput`` on damaged, hostile and multi-session ``events.jsonl`` files.

Each bad line gives exactly one warning naming its line, the report stays sane, ``--json`` is
strict JSON (no NaN), and the idle time between two launcher invocations is not lost time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kfp_nvrx.components.core.events import EventLog, Step, read_events

T0 = 1_790_000_000.0  # a real Unix time (2026)


def _steps(run_id: str, first: int, last: int, t: float, inc: int = 0) -> list[dict]:
    out = [{"type": "start", "time": t, "incarnation": inc, "iteration": 0, "run_id": run_id,
            "resumed_from": first - 1 if first > 1 else None}]
    for n in range(first, last + 1):
        t0 = t + (n - first) * 1.0 + 0.5
        out.append({"type": "step", "time": t0 + 1.0, "step": n, "start": t0, "end": t0 + 1.0,
                    "incarnation": inc, "iteration": 0, "loss": 1.0 / n, "tokens": 64})
    return out


def _write(run_dir: Path, lines: list[str]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(line + "\n" for line in lines))


def _goodput(run_dir: Path) -> tuple[dict, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "goodput", "--run-dir",
                           str(run_dir), "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr

    def strict(name: str) -> None:
        raise ValueError(f"{name} in --json output")

    return json.loads(proc.stdout, parse_constant=strict), proc.stderr.splitlines()


def test_every_bad_line_is_one_warning_and_the_report_stays_sane(tmp_path: Path) -> None:
    good = [json.dumps(e) for e in _steps("r1", 1, 5, T0)]
    bad = [
        '{"type": "step", "time": NaN, "step": 6, "start": 1, "end": 2}',
        '{"type": "step", "time": Infinity, "step": 6, "start": 1, "end": 2}',
        json.dumps({"type": "step", "time": T0 + 9, "step": 6, "start": "soon", "end": T0 + 9}),
        json.dumps({"type": "step", "time": T0 + 9, "step": 6, "start": -1e18, "end": T0 + 9}),
        json.dumps({"type": "step", "time": 1e300, "step": 6, "start": T0, "end": T0 + 9}),
        json.dumps({"type": "step", "time": T0 + 9, "step": 1e300, "start": T0, "end": T0 + 9}),
        json.dumps({"type": "step", "time": T0 + 9, "step": 6.5, "start": T0, "end": T0 + 9}),
        json.dumps({"type": "step", "time": T0 + 9, "step": 7, "start": T0 + 9, "end": T0}),
        json.dumps({"type": "start", "time": T0, "incarnation": "two"}),
        json.dumps({"type": "restart", "time": T0 + 3}),  # no kind
        '{"type": "step", "time": 17900000',  # torn by a killed writer
        "[1, 2, 3]",
        "not json at all",
    ]
    _write(tmp_path, good[:3] + bad + good[3:])
    report, stderr = _goodput(tmp_path)
    assert len(stderr) == len(bad), stderr
    assert all(line.startswith("kfp-nvrx goodput: warning:") and "line " in line
               for line in stderr)
    assert report["steps_final"] == 5 and report["steps_run"] == 5
    assert 0.5 < report["goodput"] <= 1.0 and 0 < report["wall_s"] < 10


def test_a_nan_loss_is_reported_as_null_and_the_writer_never_writes_nan(tmp_path: Path) -> None:
    EventLog(tmp_path).emit(Step(time=T0 + 2, step=1, start=T0, end=T0 + 1,
                                 loss=float("nan"), tokens=8))
    text = (tmp_path / "events.jsonl").read_text()
    assert "NaN" not in text and '"loss":null' in text
    # A file written by something else with NaN in the loss keeps the step.
    with open(tmp_path / "events.jsonl", "a") as fh:
        fh.write(f'{{"type":"step","time":{T0 + 3},"step":2,"start":{T0 + 1.5},'
                 f'"end":{T0 + 2.5},"loss":NaN}}\n')
    report, _ = _goodput(tmp_path)
    assert report["steps_final"] == 2 and report["final_loss"] is None


def test_lines_out_of_order_are_reported_and_counted_in_time_order(tmp_path: Path) -> None:
    events = _steps("r1", 1, 6, T0)
    _write(tmp_path / "ordered", [json.dumps(e) for e in events])
    shuffled = [events[0], events[4], events[1], events[6], events[2], events[3], events[5]]
    _write(tmp_path / "shuffled", [json.dumps(e) for e in shuffled])
    ordered, quiet = _goodput(tmp_path / "ordered")
    report, warnings = _goodput(tmp_path / "shuffled")
    assert quiet == [] and warnings and all("time order" in w for w in warnings)
    assert report == ordered


def test_idle_time_between_two_invocations_of_a_resumed_run_is_not_lost(tmp_path: Path) -> None:
    day = 86_400.0
    first = _steps("run-aaaa", 1, 5, T0) + [{"type": "end", "time": T0 + 6, "step": 5,
                                             "status": "completed"}]
    second = _steps("run-bbbb", 6, 10, T0 + day)  # relaunched a day later with more steps
    _write(tmp_path, [json.dumps(e) for e in first + second])
    report, stderr = _goodput(tmp_path)
    assert stderr == []
    assert report["goodput"] > 0.7, report  # was ~0.01: the day counted as wall time
    assert report["wall_s"] < 20 and report["recovery_s"] == []
    assert report["steps_final"] == 10 and report["steps_redone"] == 0
    assert report["what_happened"] == ["relaunched, resumed from step 5, 0 steps redone"]


def test_an_in_job_restart_within_one_invocation_still_counts_its_recovery(tmp_path: Path) -> None:
    events = _steps("run-aaaa", 1, 4, T0)
    events.append({"type": "fault", "time": T0 + 5, "kind": "kill", "step": 5, "rank": 1})
    events += _steps("run-aaaa", 3, 6, T0 + 20, inc=1)
    _write(tmp_path, [json.dumps(e) for e in events])
    report, _ = _goodput(tmp_path)
    assert len(report["recovery_s"]) == 1 and report["recovery_s"][0] > 15
    assert report["steps_redone"] == 2  # steps 3 and 4 ran twice


def test_a_stopped_node_that_saved_does_not_end_the_session(tmp_path: Path) -> None:
    """An evicted pod's workers save and log end(stopped); the job restarts in the same launch,
    so its recovery still counts (the cluster e2e once read an empty recovery_s)."""
    events = _steps("run-aaaa", 1, 4, T0)
    events.append({"type": "end", "time": T0 + 5, "step": 4, "status": "stopped"})
    events += _steps("run-aaaa", 5, 7, T0 + 20, inc=1)
    _write(tmp_path, [json.dumps(e) for e in events])
    report, _ = _goodput(tmp_path)
    assert len(report["recovery_s"]) == 1 and report["recovery_s"][0] > 15
    assert report["steps_redone"] == 0  # the stop saved step 4: nothing is trained twice


def test_time_a_queue_held_the_job_is_kept_apart_in_goodput_metrics_and_timeline(
        tmp_path: Path) -> None:
    """Issue 31 item 4: a preemption's wait for quota is no wall time, no recovery, no lost work;
    it is its own figure in the summary, the KFP Metrics and the timeline. Issue 38 item 6: the
    re-admission is a resume, not a failure's recovery (its seconds, queue apart: resume_s)."""
    from kfp_nvrx.components.core.events import parse_events
    from kfp_nvrx.components.core.goodput import summarize_events
    from kfp_nvrx.components.launch.ui_outputs import metrics_from_summary, render_timeline

    raw = _steps("run-aaaa", 1, 4, T0)
    raw.append({"type": "end", "time": T0 + 5, "step": 4, "status": "stopped"})
    raw += _steps("run-aaaa", 5, 7, T0 + 105, inc=1)  # re-admitted 100 s later
    events = parse_events(raw)
    wait = (T0 + 5.5, T0 + 100.5)
    held = summarize_events(events, [wait])
    plain = summarize_events(events)
    assert held.queued_s == 95.0 and plain.queued_s == 0.0
    assert held.wall_s == round(plain.wall_s - 95.0, 6)
    assert held.goodput > 0.5 > plain.goodput  # the wait no longer reads as lost time
    assert held.recovery_s == [] and held.preemptions == 1
    assert held.resume_s == [round(plain.recovery_s[0] - 95.0, 3)]
    assert held.lost_work_s == plain.lost_work_s == 0
    assert any("held 95 s in the queue" in line for line in held.what_happened)
    summary = held.to_dict()
    assert metrics_from_summary(summary)["queued_s"] == 95.0
    page = render_timeline(events, summary)
    assert "queued 95 s (Kueue held the job)" in page and "Queued" in page


def test_a_huge_line_is_skipped_without_being_held(tmp_path: Path) -> None:
    good = [json.dumps(e) for e in _steps("r1", 1, 3, T0)]
    _write(tmp_path, [good[0], '{"type": "x", "pad": "' + "a" * (1 << 20) + '"}', *good[1:]])
    warnings: list[str] = []
    events = read_events(tmp_path, warnings.append)
    assert len(events) == 4 and len(warnings) == 1 and "longer than" in warnings[0]


# -- issue 30 items 14 and 15: what is in events.jsonl's place, and a file with no events ------


def _goodput_line(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "goodput",
                           "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=60)


def test_goodput_of_an_events_file_without_events_is_refused_not_zero(tmp_path: Path) -> None:
    """An empty events.jsonl printed goodput 0.0000 with exit 0: a run that wasted all its time."""
    for name, text in (("empty", ""), ("blank", "\n\n"), ("damaged", '{"type": broken\n')):
        _write(tmp_path / name, [text] if text else [])
        proc = _goodput_line(tmp_path / name)
        assert proc.returncode == 2 and proc.stdout == "", (name, proc.stdout, proc.stderr)
        assert proc.stderr.strip().splitlines()[-1].startswith(
            "kfp-nvrx goodput: error: --run-dir: "), proc.stderr
        assert "holds no events" in proc.stderr and "goodput" not in proc.stdout


def test_goodput_refuses_a_fifo_or_folder_at_events_jsonl_without_waiting(tmp_path: Path) -> None:
    import os

    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "events.jsonl")  # nobody writes: a plain open would block
    (tmp_path / "folder" / "events.jsonl").mkdir(parents=True)
    for name, kind in (("fifo", "FIFO"), ("folder", "directory")):
        proc = _goodput_line(tmp_path / name)
        assert proc.returncode == 2 and kind in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_an_event_is_never_written_into_a_fifo_or_device(tmp_path: Path) -> None:
    """A FIFO at events.jsonl blocked the first event of every rank forever (issue 30.14)."""
    import errno
    import os
    import threading

    os.mkfifo(tmp_path / "events.jsonl")
    log, raised = EventLog(tmp_path), []

    def emit() -> None:
        try:
            log.emit(Step(time=T0, step=1, start=T0, end=T0, incarnation=0, iteration=0))
        except OSError as err:
            raised.append(err)

    writer = threading.Thread(target=emit, daemon=True)
    writer.start()
    writer.join(10)
    assert not writer.is_alive() and raised and raised[0].errno == errno.ENXIO
    reader = os.open(tmp_path / "events.jsonl", os.O_RDONLY | os.O_NONBLOCK)  # one that reads
    try:
        raised.clear()
        emit()
        assert raised and raised[0].errno == errno.EEXIST
        assert os.read(reader, 100) == b""  # nothing went down the pipe
    finally:
        os.close(reader)
