"""Imports run one way: launcher side -> core <- trainer, and the launcher side never needs torch.

The launcher/component image ships without torch, so a launcher-side module that imports torch
(or a trainer module, which does) at import time breaks ``kfp-nvrx`` there. Each check imports the
modules in a fresh interpreter where ``import torch`` fails.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINER = "kfp_nvrx.components.training.trainer"

#: Folders (relative to the repo root) of the launcher side and of the core, with their package.
LAUNCHER_SIDE = {
    "components/core": "kfp_nvrx.components.core",
    "components/core/events": "kfp_nvrx.components.core.events",
    "components/data": "kfp_nvrx.components.data",
    "components/launch": "kfp_nvrx.components.launch",
    "components/launch/jobspec": "kfp_nvrx.components.launch.jobspec",
    "components/launch/kube": "kfp_nvrx.components.launch.kube",
    "components/launch/local": "kfp_nvrx.components.launch.local",
    "components/launch/pytorchjob": "kfp_nvrx.components.launch.pytorchjob",
    "components/launch/trainjob": "kfp_nvrx.components.launch.trainjob",
    "components/drills": "kfp_nvrx.components.drills",
    "components/cli": "kfp_nvrx.components.cli",
    "components/cli/commands": "kfp_nvrx.components.cli.commands",
    "components/prepare_dataset": "kfp_nvrx.components.prepare_dataset",
    "pipelines": "kfp_nvrx.pipelines",
}
#: Single launcher-side modules outside those folders.
LAUNCHER_MODULES = [
    "kfp_nvrx.components.errors",
    "kfp_nvrx.components.images",
    "kfp_nvrx.components.core.ownership",
    "kfp_nvrx.components.redaction",
    "kfp_nvrx.components.train_fsdp.component",
    "kfp_nvrx.components.export_checkpoint.component",
    "kfp_nvrx.components.evaluate_promote.component",
    "kfp_nvrx.components.training.export.promote",
]

_PROBE = """
import importlib, json, sys
sys.modules["torch"] = None  # `import torch` raises ImportError from here on
loaded, failed = [], {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
        loaded.append(name)
    except Exception as err:  # noqa: BLE001 - reported by the test
        failed[name] = f"{type(err).__name__}: {err}"
print(json.dumps({"loaded": loaded, "failed": failed,
                  "trainer": sorted(m for m in sys.modules if m.startswith(sys.argv[2]))}))
"""


def launcher_side_modules() -> list[str]:
    """Every module of the launcher side and the core, found on disk (new files included)."""
    names = list(LAUNCHER_MODULES)
    for folder, package in LAUNCHER_SIDE.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.stem == "__main__":  # runs the CLI when imported
                continue
            names.append(package if path.stem == "__init__" else f"{package}.{path.stem}")
    return names


def _probe(modules: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(modules), TRAINER],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_core_imports_without_torch() -> None:
    core = [m for m in launcher_side_modules() if m.startswith("kfp_nvrx.components.core")]
    assert "kfp_nvrx.components.core.rundir" in core and "kfp_nvrx.components.core.config" in core
    result = _probe(core)
    assert result["failed"] == {} and result["trainer"] == []


def test_launcher_side_imports_without_torch_or_the_trainer() -> None:
    modules = launcher_side_modules()
    assert len(modules) > 30  # the glob found the tree
    result = _probe(modules)
    assert result["failed"] == {}, result["failed"]
    assert sorted(result["loaded"]) == sorted(modules)
    assert result["trainer"] == [], f"launcher side pulled in trainer modules: {result['trainer']}"


def test_the_probe_would_catch_a_torch_import() -> None:
    """The torch blocker works: a trainer module fails to import under it."""
    result = _probe([f"{TRAINER}.build"])
    assert "import of torch halted" in result["failed"][f"{TRAINER}.build"]


#: The rooms of kfp_nvrx.components (and the pipelines) and the rooms each may import: every arrow
#: runs down, towards core. The four KFP component folders are thin: they call the library rooms,
#: and nothing but the pipelines and the CLI calls them. ``shared`` is components/*.py (errors,
#: images, redaction): below everything but core's own helpers.
ALLOWED = {
    "core": {"shared"},
    "shared": {"core"},
    "data": {"core", "shared"},
    "training": {"core", "shared", "data"},
    "launch": {"core", "shared"},
    "drills": {"core", "shared", "data", "launch", "training"},
    "prepare_dataset": {"shared", "data"},
    "train_fsdp": {"shared", "core", "launch"},
    "export_checkpoint": {"shared", "core", "training"},
    "evaluate_promote": {"shared", "core", "training"},
    "pipelines": {"shared", "core", "prepare_dataset", "train_fsdp", "export_checkpoint",
                  "evaluate_promote"},
    "cli": {"shared", "core", "data", "launch", "training", "drills", "pipelines"},
}
_IMPORT = re.compile(r"^\s*(?:from|import)\s+(kfp_nvrx(?:\.\w+)*)", re.MULTILINE)


def _room(module: str) -> str:
    """The room of a module name (kfp_nvrx.components.<room>... or kfp_nvrx.pipelines...)."""
    parts = module.split(".")
    if parts[1] == "pipelines":
        return "pipelines"
    if len(parts) < 3 or parts[2] in {"errors", "images", "redaction"}:
        return "shared"
    return parts[2]


def test_every_room_imports_only_down() -> None:
    """Every import in the package, lazy ones too, runs along an arrow of ``ALLOWED``."""
    offenders, rooms = [], set()
    for path in sorted([*(ROOT / "components").rglob("*.py"), *(ROOT / "pipelines").rglob("*.py")]):
        rel = path.relative_to(ROOT).with_suffix("").parts
        src = "pipelines" if rel[0] == "pipelines" else ("shared" if len(rel) == 2 else rel[1])
        rooms.add(src)
        for found in _IMPORT.findall(path.read_text()):
            dst = _room(found)
            if dst != src and dst not in ALLOWED[src]:
                offenders.append(f"{path.relative_to(ROOT)}: {found} ({src} -> {dst})")
    assert rooms == set(ALLOWED), "a room was added or renamed: give it its arrows in ALLOWED"
    assert offenders == []


def test_the_room_check_would_catch_an_upward_arrow() -> None:
    """The rule table is not vacuous: the torch side may not import the launcher side."""
    assert _room("kfp_nvrx.components.launch.local.run") not in ALLOWED["training"]
    assert _room("kfp_nvrx.components.cli.main") not in ALLOWED["pipelines"]
    assert _room("kfp_nvrx.components.train_fsdp.component") not in ALLOWED["drills"]
