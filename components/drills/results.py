"""One row per drill scenario, written as ``drill.json`` and ``drill.md`` and printed as a table."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.atomic import write_atomic

JSON_FILE, MD_FILE = "drill.json", "drill.md"


@dataclass
class Row:
    """The result of one scenario.

    Attributes:
        scenario: Scenario name.
        what: What was done to the job.
        expect: What should happen (survive / fail cleanly / stop cleanly, then resume).
        state: Final launcher state (``Succeeded``, ``Failed``, ``Cancelled``, ``skipped``).
        survived: The job reached its last step (after a relaunch for ``launcher-sigterm``;
            None: not relaunched).
        passed: Every expectation of the scenario held (None: skipped).
        restarts: Restarts by kind (``in-job``, ``in-process``).
        committed_steps_lost: Committed progress thrown away (newest commit - step resumed).
        steps_redone: Step executions rolled back by a restart.
        recovery_s: Fault -> first step of the next incarnation, one figure per restart.
        bitwise: Final weights bitwise equal to the fault-free reference (None: not comparable).
        wall_s: Wall time of the scenario.
        notes: What the drill saw and checked.
        failures: Expectations that did not hold (empty when passed).
    """

    scenario: str
    what: str
    expect: str
    state: str = ""
    survived: bool | None = False
    passed: bool | None = False
    restarts: dict[str, int] = field(default_factory=dict)
    committed_steps_lost: int = 0
    steps_redone: int = 0
    recovery_s: list[float] = field(default_factory=list)
    bitwise: bool | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def check(self, ok: bool, failure: str) -> None:
        """Records an expectation; a false one fails the row."""
        if not ok:
            self.failures.append(failure)


def _yes(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "no")


def table(rows: list[Row]) -> str:
    """The markdown table (one row per scenario)."""
    head = ("| scenario | expected | outcome | survived | committed steps lost | steps redone | "
            "recovery s | bitwise = reference | passed |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        rec = ", ".join(f"{s:.1f}" for s in r.recovery_s) or "-"
        restarts = ", ".join(f"{k} {v}" for k, v in sorted(r.restarts.items()))
        outcome = r.state + (f" ({restarts})" if restarts else "")
        passed = "skipped" if r.passed is None else ("yes" if r.passed else "**NO**")
        lines.append(f"| {r.scenario} | {r.expect} | {outcome} | {_yes(r.survived)} | "
                     f"{r.committed_steps_lost} | {r.steps_redone} | {rec} | {_yes(r.bitwise)} | "
                     f"{passed} |")
    return "\n".join(lines)


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    """The whole report: setup line, table, then per-scenario notes."""
    out = [f"# Fault drill ({meta.get('mode', '')})", "",
           f"{meta.get('setup', '')}", "", table(rows), ""]
    for r in rows:
        out.append(f"- **{r.scenario}**: {r.what}. {'; '.join(r.notes)}"
                   + (f". FAILED: {'; '.join(r.failures)}" if r.failures else ""))
    return "\n".join(out) + "\n"


def write(out_dir: Path, rows: list[Row], meta: dict[str, Any]) -> tuple[Path, Path]:
    """Writes ``drill.json`` and ``drill.md`` (each atomically) and returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {**meta, "rows": [dataclasses.asdict(r) for r in rows]}
    paths = []
    for name, text in ((JSON_FILE, json.dumps(payload, indent=2) + "\n"),
                       (MD_FILE, markdown(rows, meta))):
        paths.append(write_atomic(out_dir / name, text))
    return paths[0], paths[1]
