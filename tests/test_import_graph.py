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

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER = "kfp_nvrx.components.train_fsdp.trainer"

#: Folders (relative to the repo root) of the launcher side and of the core, with their package.
LAUNCHER_SIDE = {
    "components/core": "kfp_nvrx.components.core",
    "components/train_fsdp/jobspec": "kfp_nvrx.components.train_fsdp.jobspec",
    "components/train_fsdp/launcher": "kfp_nvrx.components.train_fsdp.launcher",
    "components/prepare_dataset": "kfp_nvrx.components.prepare_dataset",
    "pipelines": "kfp_nvrx.pipelines",
    "pipelines/commands": "kfp_nvrx.pipelines.commands",
}
#: Single launcher-side modules outside those folders.
LAUNCHER_MODULES = [
    "kfp_nvrx.components.errors",
    "kfp_nvrx.components.images",
    "kfp_nvrx.components.train_fsdp.component",
    "kfp_nvrx.components.train_fsdp.ui_outputs",
    "kfp_nvrx.components.export_checkpoint.component",
    "kfp_nvrx.components.evaluate_promote.component",
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
    result = _probe([f"{TRAINER}.model"])
    assert "import of torch halted" in result["failed"][f"{TRAINER}.model"]


@pytest.mark.parametrize("folder", ["components/train_fsdp/jobspec", "components/core"])
def test_no_arrow_back_up(folder: str) -> None:
    """jobspec and core never import the launcher (nor the core the trainer or jobspec)."""
    banned = ["kfp_nvrx.components.train_fsdp.launcher", TRAINER]
    if folder == "components/core":
        banned.append("kfp_nvrx.components.train_fsdp.jobspec")
    imports = re.compile(r"^\s*(?:from|import)\s+(\S+)", re.MULTILINE)
    offenders = [f"{path.name}: {found}" for path in sorted((ROOT / folder).glob("*.py"))
                 for found in imports.findall(path.read_text())
                 if any(found.startswith(name) for name in banned)]
    assert offenders == []
