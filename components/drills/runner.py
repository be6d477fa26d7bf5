"""Runs the drill matrix: a fault-free reference, then every scenario on the same job.

Layout under the output directory: ``data/`` (bundled sample corpus), ``runs/<scenario>/`` (run
directories, kept for inspection), ``logs/<scenario>.log`` (every launcher and trainer line),
``drill.json`` and ``drill.md`` (rewritten after each scenario).
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.events import IN_PROCESS, Event, Step, read_events
from kfp_nvrx.components.core.volume_store import VolumeStore
from kfp_nvrx.components.drills import measure
from kfp_nvrx.components.drills.actions import (
    Action,
    DamageNewest,
    DiskFull,
    DrillSkipped,
    KillNode,
    Watcher,
    first_commit_passed,
    make_action,
)
from kfp_nvrx.components.drills.results import Row, write
from kfp_nvrx.components.drills.scenarios import (
    BASE_OVERRIDES,
    FAIL,
    INTERVAL,
    STEPS,
    SURVIVE,
    Placement,
    Scenario,
    check_config,
    select,
)
from kfp_nvrx.components.launch.local.lifetime import processes_with_env

#: Environment variable every process of a drill run inherits (finds anything left running).
DRILL_ENV = "KFP_NVRX_DRILL"
DEADLINE_S = 300.0


class DrillError(RuntimeError):
    """The drill itself could not run (e.g. the fault-free reference failed)."""


@dataclass(frozen=True)
class _Run:
    """One run of a drill: its run directory, its log file, the token its processes carry."""

    dir: Path
    log_file: Path
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def named(cls, out: Path, name: str) -> _Run:
        """The run ``name`` under the drill's output directory, with a fresh token."""
        return cls(out / "runs" / name, out / "logs" / f"{name}.log")


@dataclass
class _Ctx:
    out: Path
    data: str
    reference: dict[str, Any] | None
    ckpt_bytes: int
    log: Callable[[str], None]
    place: Placement
    config: str = "tiny"

    def overrides(self, sc: Scenario | None) -> list[str]:
        return [f"data.path={self.data}", *BASE_OVERRIDES, *self.place.overrides(sc)]


def _train(run: _Run, config: str, overrides: list[str], faults: list[str], nodes: str,
           action: Action | None = None) -> Any:
    from kfp_nvrx.components.launch.jobspec.resolve import LOCAL, resolve
    from kfp_nvrx.components.launch.jobspec.spec import JobSpec
    from kfp_nvrx.components.launch.local.run import LocalRun

    with open(run.log_file, "a") as fh:
        def log(line: str) -> None:
            fh.write(line + "\n")
            if action is not None:
                action.on_line(line)

        spec = JobSpec(nodes=nodes, run_dir=str(run.dir), config=config, overrides=overrides,
                       faults=faults, env={DRILL_ENV: run.token})
        return LocalRun(resolve(spec, LOCAL), log=log, deadline_s=DEADLINE_S, verbose=True,
                        on_start=action.on_start if action is not None else None).run()


def _hot_spare(action: Any, events: list[Event]) -> bool:
    """The killed local node was a hot spare: the job never ran on it.

    NVRx >= 0.7 closes the first rendezvous round as soon as MIN nodes have joined, so with
    ``--nodes 1:2`` a node that joins a moment later waits as a spare instead of training.
    """
    starts = measure.starts(events)
    return isinstance(action, KillNode) and bool(starts) and \
        (starts[0].world_size or 0) < len(action.pids)


def _common(row: Row, sc: Scenario, ctx: _Ctx, run: _Run, res: Any, action: Any = None) -> None:
    """Figures and expectations every scenario shares."""
    run_dir = run.dir
    events = read_events(run_dir)
    g = res.summary
    row.survived = res.succeeded and g.steps_final == STEPS
    row.restarts, row.steps_redone = dict(g.restarts), int(g.steps_redone)
    row.recovery_s = [float(s) for s in g.recovery_s]
    seen = tuple(action.commits_seen) if action is not None else ()
    row.committed_steps_lost = measure.committed_steps_lost(events, seen)
    resumed = [s.resumed_from for s in measure.starts(events)[1:]]
    if resumed:
        row.notes.append(f"restarts resumed from steps {resumed}")
    reaped = int(res.extra.get("leftover_processes_killed", 0))
    if reaped:
        row.notes.append(f"launcher reaped {reaped} straggler process(es) after the agents stopped")
    left = processes_with_env(DRILL_ENV, run.token)
    row.check(not left, f"processes still running after the launcher returned: {left}")
    # The drill's own damage stays in the run dir when nothing rewrote that step since: it is no
    # inconsistency once the trainer said it skipped it.
    skipped = action.damaged if isinstance(action, DamageNewest) and action.fallback_logged else None
    for problem in measure.run_dir_problems(run_dir, skip=skipped):
        row.check(False, problem)
    if sc.expect == SURVIVE:
        row.check(row.survived, f"expected to finish {STEPS} steps, got {res.state}: {res.reason}")
        least = 0 if _hot_spare(action, events) else sc.least_restarts()
        row.check(sum(row.restarts.values()) >= least,
                  f"expected >= {least} restart(s), saw {row.restarts}")
    elif sc.expect == FAIL:
        row.check(res.state == "Failed", f"expected Failed, got {res.state}")
        row.check(bool(res.reason), "failed without a reason")
        row.check(not measure.completed(events), "trainer logged a completed end")
        row.notes.append(f"reason: {res.reason}")
    if sc.bitwise and row.survived:
        row.bitwise = measure.bitwise_equal(measure.final_weights(run_dir, STEPS), ctx.reference)
        row.check(row.bitwise, "final weights differ from the fault-free reference")


def _specific(row: Row, sc: Scenario, run_dir: Path, action: Any) -> None:
    """Checks that belong to one scenario."""
    events = read_events(run_dir)
    starts = measure.starts(events)
    if isinstance(action, KillNode):
        sizes = [s.world_size or 0 for s in starts]
        row.notes.append(f"world sizes {sizes}")
        if _hot_spare(action, events):
            row.notes.append("the killed node was a hot spare (NVRx >= 0.7 starts an elastic job "
                             "once MIN nodes joined); the job lost nothing")
            row.check(action.done, "the node was not killed")
        else:
            row.check(action.done and sizes[-1] < sizes[0],
                      "training did not continue on fewer nodes")
    if isinstance(action, DamageNewest):
        resumed = [s.resumed_from for s in starts[1:]]
        row.check(action.fallback_logged, "the fallback past the damaged checkpoint was not logged")
        # The durable writes run at their own pace, so the damaged commit may be the only one:
        # then the restart must start fresh (never load it), else from the commit before it.
        row.check(action.damaged is not None and bool(resumed) and resumed[0] == action.older,
                  f"resumed from {resumed} although step {action.damaged} was damaged and "
                  f"{action.older} is the newest intact commit before it")
        if action.fallback_logged:
            row.notes.append(f"trainer logged: checkpoint step {action.damaged} is damaged; "
                             "falling back")
    if isinstance(action, DiskFull):
        row.check(action.enospc_seen, "no 'No space left on device' error surfaced")
    for torn in sc.torn_steps():
        # The write of the torn step is never loaded; its snapshot in host memory may be, when
        # every rank sealed it before the kill (CRC-checked; the run must still end bitwise).
        from_volume = [s.resumed_from for s in starts[1:] if not s.from_memory]
        row.check(torn not in from_volume, f"resumed from the torn step {torn} on the volume")
        if any(s.resumed_from == torn for s in starts[1:]):
            row.notes.append(f"step {torn}'s snapshot was sealed in host memory before the "
                             "kill: the restart loaded it from there")
    if "resilience.in_process=true" in sc.extra:
        row.check(set(row.restarts) == {IN_PROCESS}, f"expected in-process only: {row.restarts}")
        row.check(len({s.pid for s in starts}) == 1, "in-process restart changed worker PIDs")


def _scenario(sc: Scenario, ctx: _Ctx) -> Row:
    row = Row(sc.name, sc.what, sc.expect)
    run = _Run.named(ctx.out, sc.name)
    action = make_action(sc.action, run.dir, ctx.ckpt_bytes)
    t0 = time.time()
    nodes = ctx.place.nodes(sc.nodes)
    try:
        if nodes is None:
            raise DrillSkipped(f"needs {sc.nodes} nodes, this placement has {ctx.place.world}")
        action.setup()
    except DrillSkipped as err:
        row.state, row.passed = "skipped", None
        row.notes.append(str(err))
        return row
    try:
        with Watcher(action):
            res = _train(run, ctx.config, ctx.overrides(sc), ctx.place.faults(sc), nodes, action)
    finally:
        action.teardown()
    row.state = res.state
    row.notes.extend(action.notes)
    _common(row, sc, ctx, run, res, action)
    _specific(row, sc, run.dir, action)
    row.wall_s = round(time.time() - t0, 1)
    row.passed = not row.failures
    return row


def _sigterm(sc: Scenario, ctx: _Ctx, relaunch: bool) -> Row:
    """SIGTERM to the ``kfp-nvrx launch-local`` process, checks, then a relaunch to the end."""
    row = Row(sc.name, sc.what, sc.expect)
    run = _Run.named(ctx.out, sc.name)
    t0 = time.time()
    nodes = str(ctx.place.world)
    argv = [sys.executable, "-m", "kfp_nvrx.components.cli", "launch-local", "--nodes", nodes,
            "--run-dir", str(run.dir), "--config", ctx.config, "--verbose"]
    for item in ctx.overrides(sc):
        argv += ["--set", item]
    rc, t_sig = _launch_then_stop(argv, run, row, t0)
    events = _check_stopped(row, run, rc, t_sig)
    row.state = "Cancelled"
    if not relaunch:  # drill --quick: the stop and the run dir checks only
        row.survived = None
        row.notes.append("no relaunch (--quick)")
        row.wall_s = round(time.time() - t0, 1)
        row.passed = not row.failures
        return row
    res = _train(run, ctx.config, ctx.overrides(sc), [], nodes)
    row.state = f"Cancelled, relaunch {res.state}"
    _common(row, sc, ctx, run, res)
    first = next((e for e in read_events(run.dir)[len(events):] if isinstance(e, Step)), None)
    if first is not None:
        row.recovery_s = [round(first.end - t_sig, 3)]
        row.notes.append("recovery = SIGTERM -> first step of the relaunch")
    row.check(bool(row.survived), f"relaunch did not finish: {res.state} {res.reason}")
    row.wall_s = round(time.time() - t0, 1)
    row.passed = not row.failures
    return row


def _launch_then_stop(argv: list[str], run: _Run, row: Row, t0: float) -> tuple[int, float]:
    """Runs ``argv`` (launch-local) until its first commit, then SIGTERMs it: (exit code, when)."""
    with open(run.log_file, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, DRILL_ENV: run.token})
        while proc.poll() is None and time.time() - t0 < DEADLINE_S:
            if first_commit_passed(read_events(run.dir)):
                break
            time.sleep(0.05)
        row.check(proc.poll() is None, "launch-local ended before the first commit")
        t_sig = time.time()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            row.check(False, "launch-local did not stop within 120 s of SIGTERM")
    return rc, t_sig


def _check_stopped(row: Row, run: _Run, rc: int, t_sig: float) -> list[Event]:
    """Checks the stopped run (nothing left running, exit 143, intact run dir); its events."""
    stop_s = time.time() - t_sig
    left = processes_with_env(DRILL_ENV, run.token)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    row.check(not left, f"{len(left)} process(es) still running after launch-local exited")
    row.check(rc == 128 + signal.SIGTERM, f"launch-local exited {rc} after SIGTERM, not 143")
    events = read_events(run.dir)
    row.check(not measure.completed(events), "trainer logged a completed end before SIGTERM")
    problems = measure.run_dir_problems(run.dir)
    for problem in problems:
        row.check(False, problem)
    kept = VolumeStore(run.dir).committed_steps()
    steps_before = max((e.step for e in events if isinstance(e, Step)), default=0)
    row.notes.append(f"stopped {stop_s:.1f} s after SIGTERM (exit code {rc}) at step "
                     f"{steps_before}; nothing left running; committed {sorted(kept)} all verify")
    return events


def _reference(ctx_out: Path, data: str, place: Placement,
               config: str) -> tuple[dict[str, Any] | None, int, float]:
    run = _Run.named(ctx_out, "reference")
    run_dir = run.dir
    t0 = time.time()
    res = _train(run, config, [f"data.path={data}", *BASE_OVERRIDES, *place.overrides(None)], [],
                 str(place.world))
    if not res.succeeded:
        raise DrillError(f"the fault-free reference run {res.state}: {res.reason} (see "
                         f"{ctx_out / 'logs' / 'reference.log'})")
    # The size of one checkpoint: the final step's (always written; which periodic snapshots
    # were written depends on the writer's pace).
    record = VolumeStore(run_dir).record(STEPS) or {}
    return measure.final_weights(run_dir, STEPS), int(record.get("bytes", 0)), time.time() - t0


def _gpu_line(place: Placement) -> str:
    """Machine, driver, CUDA, NCCL and GPU names for a CUDA drill's setup line."""
    if place.device == "cpu":
        return ""
    import torch

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = "unknown"
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return (f" {place.world} x {torch.cuda.get_device_name(0)}, driver {driver}, CUDA "
            f"{torch.version.cuda}, NCCL {nccl}, host {platform.node()}.")


def run_drill(out: str | os.PathLike, *, quick: bool = False, names: list[str] | None = None,
              log: Callable[[str], None] = print, place: Placement | None = None,
              config: str = "tiny") -> tuple[list[Row], dict[str, Any]]:
    """Runs the reference and the chosen scenarios; writes ``drill.json``/``drill.md`` as it goes.

    Args:
        out: Output directory (its ``runs/``, ``logs/`` and reports are replaced).
        quick: Only the CI subset.
        names: Only these scenarios (overrides ``quick``).
        log: Progress lines.
        place: CPU (default) or CUDA with 1-2 GPUs.
        config: The job's preset (:data:`...scenarios.CONFIGS`; the larger ones on CUDA only).

    Returns:
        (rows, meta) as written to the reports.

    Raises:
        UserError: Unknown scenario names, or a preset the placement cannot run.
        DrillError: The fault-free reference did not succeed.
    """
    import torch

    from kfp_nvrx.components.data.prepare import prepare_dataset

    scenarios = select(names, quick)
    place = place or Placement()
    check_config(config, place)
    from kfp_nvrx.components.core.ownership import reset_out_dir

    out = reset_out_dir(Path(out).absolute(), ("runs", "logs"), "out")  # only a folder we made
    for sub in ("runs", "logs"):
        (out / sub).mkdir(parents=True)
    data = out / "data"
    from kfp_nvrx.components.core.config import load_config

    # The bundled sample wraps around: it holds ~70k tokens, enough for any preset's seq_len.
    prepare_dataset("sample:400", data, seq_len=load_config(config).data.seq_len,
                    log=lambda _m: None)
    log(f"drill: reference run ({STEPS} steps, {place.label}, {config}) ...")
    reference, ckpt_bytes, ref_s = _reference(out, str(data), place, config)
    ctx = _Ctx(out, str(data), reference, ckpt_bytes, log, place, config)
    from importlib.metadata import version

    meta = {
        "mode": "quick" if quick and not names else ("selected" if names else "full"),
        "setup": f"{config} preset, {place.label}, {STEPS} steps, a committed "
                 f"checkpoint every {INTERVAL}; fault-free reference {ref_s:.0f} s. "
                 f"{os.cpu_count()} CPUs, Python {platform.python_version()}, torch "
                 f"{torch.__version__}, nvidia-resiliency-ext {version('nvidia-resiliency-ext')}, "
                 f"{time.strftime('%Y-%m-%d')}.{_gpu_line(place)}",
        "config": config, "steps": STEPS, "interval": INTERVAL, "reference_s": round(ref_s, 1),
    }
    rows: list[Row] = []
    for sc in scenarios:
        log(f"drill: {sc.name}: {sc.what} ...")
        row = _sigterm(sc, ctx, relaunch=meta["mode"] != "quick") if sc.action == "sigterm" \
            else _scenario(sc, ctx)
        rows.append(row)
        write(out, rows, meta)
        verdict = "skipped" if row.passed is None else ("passed" if row.passed else "FAILED")
        log(f"drill: {sc.name}: {verdict} in {row.wall_s:.0f} s"
            + (f" ({'; '.join(row.failures)})" if row.failures else ""))
    return rows, meta
