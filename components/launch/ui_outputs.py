"""What the training task shows in the Kubeflow UI: ``Metrics`` values and a goodput timeline.

:func:`metrics_from_summary` maps a goodput summary (``GoodputReport.to_dict()``) onto flat numeric
``Metrics`` entries. :func:`render_timeline` turns ``<run_dir>/events.jsonl`` into one
self-contained HTML page (inline SVG and CSS; no script, no network) that shows, on a time axis,
the steps that were kept, the steps that were redone after a restart, checkpoints, faults and
restarts, with a legend and the headline numbers. Hovering a shape shows its details (SVG
``<title>``), which works in the UI's sandboxed HTML viewer.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.events import (
    RESTART_LAYERS,
    Checkpoint,
    Event,
    Fault,
    Restart,
    Start,
    Step,
)
from kfp_nvrx.components.core.goodput import kept_steps, recovery_windows, sessions, training
from kfp_nvrx.components.core.restart_counts import restart_kinds, unstarted_restarts

#: Colours of the timeline (also used by the legend).
COLORS = {
    "kept": "#2e9d57",
    "redone": "#e8833a",
    "ckpt": "#3a6fd8",
    "ckpt_block": "#173f8f",
    "fault": "#d62d2d",
    "restart": "#8a3ad8",
    "recovery": "#f3c6c6",
    "queued": "#c9ced6",
}
_LANES = ("Steps kept", "Steps redone", "Checkpoints", "Faults", "Restarts")
_W, _LEFT, _RIGHT, _TOP, _LANE_H, _AXIS_H = 1000, 120, 985, 10, 34, 30
#: Summary keys logged as they are (missing: 0), with their number type, before and after the
#: restart counts (the order the UI lists them in).
_HEAD_METRICS = (("goodput", float), ("wall_s", float), ("productive_s", float),
                 ("lost_work_s", float), ("steps_final", int), ("steps_run", int),
                 ("steps_redone", int))
_TAIL_METRICS = (("recovery_mean_s", float), ("recovery_max_s", float), ("queued_s", float),
                 ("checkpoint_stall_s", float), ("checkpoints", int), ("snapshots", int),
                 ("snapshots_skipped", int), ("snapshot_stall_s", float),
                 ("snapshot_stall_max_s", float), ("faults", int),
                 ("peer_restore_bytes", int), ("peer_copies", int), ("peer_copy_stall_s", float))
#: Where restarts took their state from (``restores_from_peer``: a lost node restored from copies).
RESTORE_TIERS = ("memory", "peer", "volume")


def metrics_from_summary(summary: dict[str, Any]) -> dict[str, float]:
    """Flattens a goodput summary into the numbers logged as KFP ``Metrics``.

    Args:
        summary: ``GoodputReport.to_dict()`` (keys ``goodput``, ``restarts`` by kind, ...).

    Returns:
        Metric name -> number. Restarts appear per layer (``restarts_in_process``,
        ``restarts_in_job``, ``restarts_pod``) and in total; ``final_loss`` only when a step was logged.

    """
    restarts = dict(summary.get("restarts") or {})
    out: dict[str, float] = {key: kind(summary.get(key, 0)) for key, kind in _HEAD_METRICS}
    out["restarts_total"] = int(sum(restarts.values()))
    # Every layer is named, even without a restart of it ("restarts_pod": 0 is an answer).
    out.update({restart_metric(layer): int(restarts.pop(layer, 0)) for layer in RESTART_LAYERS})
    out.update({key: kind(summary.get(key, 0)) for key, kind in _TAIL_METRICS})
    for kind, count in restarts.items():  # kinds added later still show up
        out[restart_metric(kind)] = int(count)
    restores = dict(summary.get("restores") or {})
    out.update({f"restores_from_{tier}": int(restores.get(tier, 0)) for tier in RESTORE_TIERS})
    if summary.get("final_loss") is not None:
        out["final_loss"] = float(summary["final_loss"])
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in out.items()}


def restart_metric(layer: str) -> str:
    """The ``Metrics`` name of the restarts of ``layer`` (``in-job`` -> ``restarts_in_job``)."""
    return "restarts_" + "".join(c if c.isalnum() else "_" for c in layer)


def _segments(steps: list[Step], tol: float) -> list[dict[str, Any]]:
    """Merge consecutive steps of one incarnation into segments (keeps the SVG small)."""
    segs: list[dict[str, Any]] = []
    for e in sorted(steps, key=lambda s: s.start):
        inc = (e.incarnation, e.iteration)
        cur = segs[-1] if segs else None
        if cur and cur["inc"] == inc and e.start - cur["end"] <= tol:
            cur["end"], cur["last"], cur["n"] = max(cur["end"], e.end), e.step, cur["n"] + 1
        else:
            segs.append({"start": e.start, "end": e.end, "first": e.step,
                         "last": e.step, "n": 1, "inc": inc})
    return segs


def _headline(summary: dict[str, Any]) -> list[tuple[str, str]]:
    restarts = summary.get("restarts") or {}
    rs = ", ".join(f"{k} {v}" for k, v in sorted(restarts.items())) or "none"
    loss = summary.get("final_loss")
    return [
        ("Goodput", f"{100 * float(summary.get('goodput', 0)):.1f}%"),
        ("Wall time", f"{float(summary.get('wall_s', 0)):.1f} s"),
        ("Steps", f"{summary.get('steps_final', 0)} final, "
                  f"{summary.get('steps_redone', 0)} redone"),
        ("Lost work", f"{float(summary.get('lost_work_s', 0)):.2f} s"),
        *((("Queued", f"{float(summary['queued_s']):.0f} s (not in the wall time)"),)
          if summary.get("queued_s") else ()),
        ("Restarts", rs),
        ("Recovery", f"mean {float(summary.get('recovery_mean_s', 0)):.2f} s, "
                     f"max {float(summary.get('recovery_max_s', 0)):.2f} s"),
        ("Checkpoint stall", f"{float(summary.get('checkpoint_stall_s', 0)):.3f} s "
                             f"({summary.get('snapshots', 0)} snapshots, worst "
                             f"{float(summary.get('snapshot_stall_max_s', 0)):.3f} s; "
                             f"{summary.get('checkpoints', 0)} written)"),
        ("Final loss", "n/a" if loss is None else f"{float(loss):.4f}"),
        *(("What happened", line) for line in summary.get("what_happened") or []),
    ]


def _ticks(span: float) -> list[float]:
    raw = span / 8
    for unit in (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600,
                 7200, 14400, 21600, 43200, 86400):
        if unit >= raw:
            break
    return [i * unit for i in range(int(span / unit) + 1)]


def _fmt_t(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.0f} min"
    return f"{s:g} s"


class _Axis:
    """Maps Unix times onto the SVG's x coordinate."""

    def __init__(self, events: list[Event]) -> None:
        starts = [e.start for e in events if isinstance(e, Step)]
        ends = [e.end for e in events if isinstance(e, Step)]
        times = [e.time for e in events] + starts
        self.t0 = min(times) if times else 0.0
        self.span = max((max(times + ends) if times else 1.0) - self.t0, 1e-6)
        self.scale = (_RIGHT - _LEFT) / self.span

    def x(self, t: float) -> float:
        return round(_LEFT + (t - self.t0) * self.scale, 2)

    def w(self, seconds: float, least: float = 1.0) -> float:
        return round(max(seconds * self.scale, least), 2)


def _lane_y(i: int) -> int:
    return _TOP + i * _LANE_H


def _rect(box: tuple[float, float, float, float], fill: str, tip: str = "",
          extra: str = "") -> str:
    """An SVG rectangle; ``box`` is (x, y, width, height)."""
    x, y, w, h = box
    title = f"<title>{html.escape(tip)}</title>" if tip else ""
    return f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}"{extra}>{title}</rect>'


def _step_shapes(events: list[Event], ax: _Axis) -> list[str]:
    out = []
    classified = kept_steps(events)
    for lane, kept, color in ((0, True, COLORS["kept"]), (1, False, COLORS["redone"])):
        for s in _segments([e for e, k in classified if k == kept], 1.0 / ax.scale):
            label = f"steps {s['first']}-{s['last']}" if s["n"] > 1 else f"step {s['first']}"
            tip = (f"{label} {'kept' if kept else 'redone'} (incarnation {s['inc'][0]}, "
                   f"iteration {s['inc'][1]}), {s['end'] - s['start']:.2f} s")
            out.append(_rect((ax.x(s["start"]), _lane_y(lane) + 5, ax.w(s["end"] - s["start"]),
                              _LANE_H - 14), color, tip))
    return out


def _checkpoint_shapes(e: Checkpoint, ax: _Axis) -> list[str]:
    total, block = float(e.total_s or 0), float(e.blocking_s)
    start, y = e.time - total, _lane_y(2) + 5
    tip = (f"checkpoint step {e.step}: {total:.3f} s total, {block:.3f} s blocking, "
           f"{int(e.bytes or 0) / 2**20:.1f} MiB")
    return [_rect((ax.x(start), y, ax.w(total, 2), _LANE_H - 14), COLORS["ckpt"], tip,
                  ' opacity="0.55"'),
            _rect((ax.x(start), y, ax.w(block, 2), _LANE_H - 14), COLORS["ckpt_block"])]


def _fault_shapes(e: Fault, ax: _Axis, body_h: int) -> list[str]:
    cx, y = ax.x(e.time), _lane_y(3) + _LANE_H / 2 - 2
    tip = html.escape(f"fault: {e.kind} at step {e.step}, rank {e.rank}")
    return [f'<line x1="{cx}" y1="{_TOP}" x2="{cx}" y2="{body_h - 4}" '
            f'stroke="{COLORS["fault"]}" stroke-dasharray="4 3"/>',
            f'<path d="M{cx} {y - 9} L{cx + 8} {y} L{cx} {y + 9} L{cx - 8} {y} Z" '
            f'fill="{COLORS["fault"]}"><title>{tip}</title></path>',
            f'<text x="{cx + 11}" y="{y + 4}" font-size="11" fill="{COLORS["fault"]}">'
            f'{html.escape(e.kind)} @{e.step}</text>']


def _restart_dot(when: float, kind: str, what: str, ax: _Axis) -> list[str]:
    """A restart of layer ``kind`` at ``when``; ``what`` goes into the hover text."""
    cx, y = ax.x(when), _lane_y(4) + _LANE_H / 2 - 2
    tip = html.escape(f"{kind} restart ({what})")
    return [f'<circle cx="{cx}" cy="{y}" r="7" fill="{COLORS["restart"]}">'
            f"<title>{tip}</title></circle>",
            f'<text x="{cx - 10}" y="{y + 4}" font-size="11" text-anchor="end" '
            f'fill="{COLORS["restart"]}">{html.escape(kind)} restart</text>']


def _restart_shapes(e: Restart | Start, ax: _Axis, kind: str = "") -> list[str]:
    cx, y = ax.x(e.time), _lane_y(4) + _LANE_H / 2 - 2
    if isinstance(e, Restart):  # ``kind``: the layer the rounds give it (goodput's count)
        return _restart_dot(e.time, kind or e.kind,
                            f"incarnation {e.incarnation}, iteration {e.iteration}", ax)
    origin = "fresh" if e.resumed_from is None else f"resumed from step {e.resumed_from}"
    tip = (f"start: incarnation {e.incarnation}, iteration {e.iteration}, world size "
           f"{e.world_size}, {origin} (load {float(e.load_s or 0):.2f} s)")
    return [_rect((cx - 1.5, y - 9, 3, 18), COLORS["restart"], tip)]


def _axis_shapes(ax: _Axis, axis_y: int) -> list[str]:
    out = [f'<line x1="{_LEFT}" y1="{axis_y}" x2="{_RIGHT}" y2="{axis_y}" stroke="#444"/>']
    for t in _ticks(ax.span):
        tx = ax.x(ax.t0 + t)
        out.append(f'<line x1="{tx}" y1="{axis_y}" x2="{tx}" y2="{axis_y + 5}" stroke="#444"/>'
                   f'<text x="{tx}" y="{axis_y + 18}" font-size="11" text-anchor="middle" '
                   f'fill="#444">'
                   f"{_fmt_t(round(t, 3))}</text>")
    return out


def render_svg(events: list[Event], queued: Sequence[Sequence[float]] = ()) -> str:
    """Draw the timeline lanes of one run as an inline ``<svg>`` element.

    ``queued``: the waits in a queue (``[start, end]``), drawn as their own bands (a
    re-admission after a preemption draws no recovery window).
    """
    waits = [(float(a), float(b)) for a, b in queued]
    events = training(events)  # the launcher's record of the waits: ``queued`` draws them
    ax = _Axis(events)
    body_h = _TOP + len(_LANES) * _LANE_H
    svg: list[str] = []
    for i, name in enumerate(_LANES):
        y = _lane_y(i)
        svg.append(_rect((_LEFT, y, _RIGHT - _LEFT, _LANE_H - 4),
                         "#f6f6f6" if i % 2 else "#fbfbfb"))
        svg.append(f'<text x="{_LEFT - 8}" y="{y + _LANE_H / 2 + 2}" font-size="12" '
                   f'text-anchor="end">{name}</text>')
    for a, b in recovery_windows(events, waits=waits):
        svg.append(_rect((ax.x(a), _TOP, ax.w(b - a), len(_LANES) * _LANE_H - 4),
                         COLORS["recovery"], f"recovery {b - a:.2f} s", ' opacity="0.6"'))
    for a, b in waits:  # drawn over the recovery it interrupts: that time is the queue's
        a, b = max(a, ax.t0), min(b, ax.t0 + ax.span)
        if b > a:
            svg.append(_rect((ax.x(a), _TOP, ax.w(b - a), len(_LANES) * _LANE_H - 4),
                             COLORS["queued"], f"queued {b - a:.0f} s (Kueue held the job)",
                             ' opacity="0.8"'))
    svg += _step_shapes(events, ax)
    sess = sessions(events)
    kinds = restart_kinds(events, sess)  # the layers goodput counts, not rank 0's word alone
    for e in events:
        if isinstance(e, Checkpoint):
            svg += _checkpoint_shapes(e, ax)
        elif isinstance(e, Fault):
            svg += _fault_shapes(e, ax, body_h)
        elif isinstance(e, (Restart, Start)):
            svg += _restart_shapes(e, ax, kinds.get(id(e), ""))
    for when, layer in unstarted_restarts(events, sess):
        svg += _restart_dot(when, layer, "its workers never started training", ax)
    svg += _axis_shapes(ax, body_h + 4)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {body_h + 4 + _AXIS_H}" '
            f'role="img" aria-label="goodput timeline">{"".join(svg)}</svg>')


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px;color:#222}
h1{font-size:18px;margin:0 0 10px} h1 small{color:#777;font-weight:normal}
.cards{display:flex;flex-wrap:wrap;gap:8px;margin-bottom:10px}
.card{border:1px solid #ddd;border-radius:6px;padding:6px 10px;min-width:110px}
.card .k{font-size:11px;color:#666;text-transform:uppercase} .card .v{font-size:15px}
svg{width:100%;height:auto;max-width:1000px;font-family:inherit}
.legend span{margin-right:14px;font-size:12px;white-space:nowrap}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px}
.empty{color:#a00} .note{font-size:12px;color:#555;max-width:1000px}
"""
_LEGEND = (("kept", "step kept"), ("redone", "step redone (rolled back)"),
           ("ckpt", "checkpoint save"), ("ckpt_block", "training blocked by save"),
           ("fault", "fault"), ("restart", "restart (dot) / workers start (bar)"),
           ("recovery", "recovery window"), ("queued", "queued (Kueue held the job)"))


def render_timeline(events: list[Event], summary: dict[str, Any], title: str = "") -> str:
    """Render the goodput timeline page.

    Args:
        events: Typed events of one run in time order (:func:`.events.read_events`).
        summary: ``GoodputReport.to_dict()`` for the same run (the headline numbers).
        title: Shown after the heading (e.g. the run name).

    Returns:
        A complete HTML document.

    """
    esc = html.escape
    cards = "".join(f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{esc(v)}'
                    f"</div></div>" for k, v in _headline(summary))
    legend = "".join(f'<span><i style="background:{COLORS[c]}"></i>{esc(n)}</span>'
                     for c, n in _LEGEND)
    empty = "" if events else '<p class="empty">No events were recorded for this run.</p>'
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>Goodput timeline {esc(title)}</title><style>{_CSS}</style></head><body>\n"
            f"<h1>Goodput timeline <small>{esc(title)}</small></h1>\n"
            f'<div class="cards">{cards}</div>{empty}\n'
            f'{render_svg(events, summary.get("queued") or ())}\n'
            '<p class="note">Goodput = time inside steps that were kept / wall time, without the '
            "time a queue held the job. A restart rolls training back to the newest saved state; "
            "the steps after it are run again (redone). Hover a shape for details.</p>\n"
            f'<div class="legend">{legend}</div>\n</body></html>\n')


def write_timeline(run_dir: str | os.PathLike, out_path: str | os.PathLike,
                   summary: dict[str, Any], title: str = "") -> Path:
    """Read ``<run_dir>/events.jsonl`` and writes the timeline page to ``out_path``."""
    from kfp_nvrx.components.core.atomic import write_atomic
    from kfp_nvrx.components.core.events import read_events

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, render_timeline(read_events(run_dir), summary, title))


def publish(run_dir: str | os.PathLike, result: Any, *, run: Any, metrics: Any, timeline: Any,
            title: str = "") -> dict[str, Any]:
    """Write the training task's outputs: run artifact, ``Metrics`` and the timeline page.

    Args:
        run_dir: The run directory on the shared volume.
        result: The launcher's ``LaunchResult``.
        run: ``Output[Artifact]``: gets ``events.jsonl`` and ``summary.json`` copies, and metadata
            ``path`` (the run directory, which the export step reads), ``state``, ``restarts``
            (every layer's, from the events: the number ``restarts_total`` of the Metrics).
        metrics: ``Output[Metrics]``: :func:`metrics_from_summary` of the run.
        timeline: ``Output[HTML]``: :func:`render_timeline` of the run.
        title: Heading of the timeline page.

    Returns:
        The goodput summary (``GoodputReport.to_dict()``).

    """
    import json
    import shutil

    from kfp_nvrx.components.core.goodput import summarize
    from kfp_nvrx.components.core.rundir import EVENTS_FILE

    # The launcher read the events once already where it could (every backend, this task's
    # mount included); the run dir is read here only for a result that lacks them.
    summary = (result.summary or summarize(run_dir)).to_dict()
    for key, value in metrics_from_summary(summary).items():
        metrics.log_metric(key, value)
    write_timeline(run_dir, timeline.path, summary, title)
    out = Path(run.path)
    out.mkdir(parents=True, exist_ok=True)
    events = Path(run_dir) / EVENTS_FILE
    if events.is_file():
        shutil.copyfile(events, out / EVENTS_FILE)
    (out / "summary.json").write_text(json.dumps(
        {"summary": summary, "launch": result.to_dict()}, indent=1, default=str))
    run.metadata.update({"path": str(Path(run_dir).resolve()), "state": result.state,
                         "backend": result.backend, "job": result.name,
                         "restarts": int(sum(summary["restarts"].values())),
                         "goodput": summary["goodput"],
                         "steps_final": summary["steps_final"]})
    if "queue" in result.extra:  # the launcher's facts, not events: how long Kueue held it
        # (queued_s is among the summary's Metrics: the waits while the run's clock ran)
        metrics.log_metric("preemptions", int(result.preemptions))
        run.metadata["queued_s"] = result.queued_s
    # Words for the run's story (the UI and `kfp-nvrx run-local` show them; Metrics take numbers).
    story = "; ".join(summary.get("what_happened") or [])
    run.metadata["what_happened"] = story
    timeline.metadata["what_happened"] = story
    return summary
