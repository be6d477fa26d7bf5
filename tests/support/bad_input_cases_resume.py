"""Bad-input sweep cases for the run's records (issue 30 item 13), through the real commands.

Same format as tests/support/bad_input_cases.py; tests/integration/test_bad_inputs.py collects ``CASES`` and
``fixtures(fx)``. A resume must find the data its checkpoints were trained on (by content, not
only by path), and a run dir holding committed checkpoints must hold its records, complete:
the launcher's preflight and the trainer refuse, naming the field, before any worker starts,
and never write a new record over the checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from support.bad_input_cases import Case, _c

#: Run dirs of ours with committed step 4, each with one thing wrong with its records.
_BROKEN = {  # fixture -> (what is done to the recorded run dir, words the line must hold)
    "norecord": ("rm config.yaml", "config.yaml is missing"),
    "emptyrecord": ("config.yaml {}", "cut down"),
    "modelonlyrecord": ("config.yaml model only", "cut down"),
    "nodatarecord": ("rm dataset.json", "dataset.json is missing"),
    "baddatarecord": ("dataset.json not json", "dataset.json"),
}

CASES: list[Case] = [
    # the same data.path, other data: prepare-data --overwrite wrote another corpus there
    _c("resume-data-overwritten", "data.path", "launch-local", "--run-dir", "{swaprun}", "--set",
       "data.path={swapdata}", says="other data"),
    _c("trainer-resume-data-overwritten", "data.path", "--config", "tiny", "--run-dir",
       "{swaprun}", "--set", "data.path={swapdata}", program="trainer",
       says="checkpoint.allow_changes=data.path"),
    *[_c(f"resume-{name}", "--run-dir", "launch-local", "--run-dir", f"{{{name}}}", "--set",
         "data.path={data}", says=says) for name, (_, says) in _BROKEN.items()],
    *[_c(f"trainer-{name}", "--run-dir", "--config", "tiny", "--run-dir", f"{{{name}}}", "--set",
         "data.path={data}", program="trainer", says=says)
      for name, (_, says) in list(_BROKEN.items())[:2]],
]


def _committed_run(run_dir: Path, data: Path) -> None:
    """A run dir recorded by the real writer, with a committed step 4 (sizes only)."""
    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.core.run_record import record_config
    from kfp_nvrx.components.core.rundir import COMMIT_MARKER, DCP_METADATA, step_dir

    record_config(load_config("tiny", [f"data.path={data}"]), run_dir)
    step = step_dir(run_dir / "checkpoints", 4)
    step.mkdir(parents=True)
    (step / DCP_METADATA).write_bytes(b"meta")
    (step / "__0_0.distcp").write_bytes(b"x" * 16)
    files = {p.name: p.stat().st_size for p in step.iterdir()}
    (step / COMMIT_MARKER).write_text(json.dumps({"step": 4, "world_size": 1, "files": files}))


def _break(run_dir: Path, how: str) -> None:
    if how.startswith("rm "):
        (run_dir / how[3:]).unlink()
    elif how == "config.yaml {}":
        (run_dir / "config.yaml").write_text("{}\n")
    elif how == "config.yaml model only":
        (run_dir / "config.yaml").write_text("model: {dim: 64}\n")
    else:
        (run_dir / "dataset.json").write_text("not json")


def fixtures(fx: Path) -> dict[str, str]:
    """A run whose data folder was re-prepared with other data; run dirs with broken records."""
    from kfp_nvrx.components.data.prepare import prepare_dataset

    swap = fx / "swapdata"
    prepare_dataset("sample:150", swap, seq_len=64)
    _committed_run(fx / "swaprun", swap)
    prepare_dataset("sample:170", swap, seq_len=64, overwrite=True)
    out = {"swaprun": str(fx / "swaprun"), "swapdata": str(swap)}
    for name, (how, _) in _BROKEN.items():
        _committed_run(fx / name, fx / "data")
        _break(fx / name, how)
        out[name] = str(fx / name)
    return out
