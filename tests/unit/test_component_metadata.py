"""Every KFP component folder has a ``metadata.yaml`` in the kubeflow/pipelines-components form.

The form (``scripts/validate_metadata`` there): ``name``, ``stability``, ``dependencies``,
optional ``tags``, ``lastVerified``, in that order; stability one of experimental, alpha, beta,
stable; dependencies ``kubeflow`` (Pipelines among them) and optional ``external_services``, each a
list of ``name`` + ``version`` (semantic version, optionally after ``>=``, ``<=`` or ``==``);
``lastVerified`` an RFC 3339 time within a year. Here each version must also equal the pin this
repository holds for that dependency, so a bumped pin fails until the metadata says it too.
"""

from __future__ import annotations

import configparser
import re
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
#: A component folder: one that holds a KFP component definition.
FOLDERS = sorted(p.parent for p in (ROOT / "components").glob("*/component.py"))
STABILITY = {"experimental", "alpha", "beta", "stable"}
VERSION = re.compile(r"^(?:>=|<=|==)?(\d+\.\d+\.\d+)$")


def _setup_cfg_pin(package: str) -> str:
    """The lower bound setup.cfg pins ``package`` to, as MAJOR.MINOR.PATCH."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    for line in "\n".join(extras.values()).splitlines():
        m = re.match(rf"^\s*{re.escape(package)}\s*>=\s*([\d.]+)", line)
        if m:
            parts = m[1].split(".")
            return ".".join((parts + ["0", "0"])[:3])
    raise AssertionError(f"setup.cfg pins no {package}>=")


def _go_mod_pin(controller: str, module: str) -> str:
    """The version ``tests/harness/controllers/<controller>/go.mod`` requires of ``module``."""
    text = (ROOT / "tests" / "harness" / "controllers" / controller / "go.mod").read_text()
    m = re.search(rf"^require {re.escape(module)} v(\d+\.\d+\.\d+)$", text, re.M)
    assert m, f"{controller}/go.mod requires no {module}"
    return m[1]


#: Dependency name -> where this repository pins it.
PINS = {
    "Pipelines": lambda: _setup_cfg_pin("kfp"),
    "Trainer": lambda: _go_mod_pin("trainer", "github.com/kubeflow/trainer/v2"),
    "Training Operator": lambda: _go_mod_pin("training-operator",
                                             "github.com/kubeflow/training-operator"),
    "NVIDIA Resiliency Extension": lambda: _setup_cfg_pin("nvidia-resiliency-ext"),
    "PyTorch": lambda: _setup_cfg_pin("torch"),
    "safetensors": lambda: _setup_cfg_pin("safetensors"),
    "Hugging Face Tokenizers": lambda: _setup_cfg_pin("tokenizers"),
}


def _metadata(folder: Path) -> dict:
    path = folder / "metadata.yaml"
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), path
    return data


def test_the_component_folders_are_found() -> None:
    assert [f.name for f in FOLDERS] == ["evaluate_promote", "export_checkpoint", "prepare_dataset",
                                         "train_fsdp"]


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.name)
def test_fields_in_the_upstream_form(folder: Path) -> None:
    meta = _metadata(folder)
    assert [k for k in meta if k != "tags"] == ["name", "stability", "dependencies", "lastVerified"]
    assert meta["name"] == folder.name
    assert meta["stability"] in STABILITY
    tags = meta.get("tags", [])
    assert isinstance(tags, list) and all(isinstance(t, str) and t for t in tags), tags
    verified = meta["lastVerified"]  # YAML reads an RFC 3339 time as a datetime
    assert isinstance(verified, datetime) and verified.tzinfo is not None, verified
    age = (datetime.now(timezone.utc) - verified).days
    assert 0 <= age < 365, f"{folder.name}: lastVerified {verified} (re-verify, then bump it)"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.name)
def test_dependencies_are_versioned_as_we_pin_them(folder: Path) -> None:
    deps = _metadata(folder)["dependencies"]
    assert isinstance(deps, dict) and set(deps) in ({"kubeflow"}, {"kubeflow", "external_services"})
    assert "Pipelines" in [d.get("name") for d in deps["kubeflow"]]
    for dep in [*deps["kubeflow"], *deps.get("external_services", [])]:
        assert set(dep) == {"name", "version"}, dep
        m = VERSION.match(str(dep["version"]))
        assert m, f"{folder.name}: {dep} is not a semantic version"
        assert dep["name"] in PINS, f"{folder.name}: {dep['name']} has no pin in this repository"
        assert m[1] == PINS[dep["name"]](), f"{folder.name}: {dep} differs from its pin"
