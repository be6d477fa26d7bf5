"""The wheel ships every package folder: packages are found on disk (setup.py), not listed.

The test builds the wheel the way the images do (``pip wheel --no-deps``; offline: no build
isolation, no index) from a copy of what the image builds copy, with one new folder planted in the
copy, and checks that every folder of ``components/`` and ``pipelines/`` holding ``.py`` files is
in it, with every ``.py`` file, and so are the data files shipped today (the config presets, the
job APIs' schemas, the compiled pipelines).

Why it fails when a folder is not packaged: the expected folders are read from the disk, not from
setup.cfg, so a folder the build misses (as the planted one would have been with the hand-written
``packages =`` list setup.cfg held before) is reported by :func:`missing`, which
:func:`test_missing_names_a_folder_the_wheel_lacks` checks on the same listing with that folder
taken out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What the image builds copy into their wheel stage (images/*/Dockerfile), and the import name of
#: each mapped folder (setup.cfg's package_dir).
COPIED = ("pyproject.toml", "setup.cfg", "setup.py", "README.md", "components", "pipelines")
MAPPED = {"components": "kfp_nvrx/components", "pipelines": "kfp_nvrx/pipelines"}
#: The data files shipped beside the modules (setup.cfg's package_data), folder glob by folder glob.
DATA = ("components/core/configs/*.yaml", "components/launch/*/schemas/*.yaml",
        "pipelines/compiled/*.yaml")
#: A folder no setup.cfg line names: a new room of the launcher, one module, no __init__.py.
PLANTED = "components/launch/planted_api"


def expected(src: Path) -> dict[str, set[str]]:
    """Every folder that must ship (relative to ``src``) -> its files, as wheel paths."""
    files = [p for top in MAPPED for p in (src / top).rglob("*.py") if "__pycache__" not in p.parts]
    files += [p for pattern in DATA for p in src.glob(pattern)]
    out: dict[str, set[str]] = {}
    for path in files:
        rel = PurePosixPath(path.relative_to(src).as_posix())
        wheel_path = PurePosixPath(MAPPED[rel.parts[0]], *rel.parts[1:])
        out.setdefault(rel.parent.as_posix(), set()).add(wheel_path.as_posix())
    return out


def missing(folders: dict[str, set[str]], names: set[str]) -> dict[str, list[str]]:
    """The folders with files the wheel (its member ``names``) lacks, and those files."""
    return {folder: sorted(files - names) for folder, files in sorted(folders.items())
            if files - names}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    """The source copy (with the planted folder) and the member names of the wheel built from it."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, out = tmp / "src", tmp / "dist"
    for name in COPIED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    (src / PLANTED).mkdir()
    (src / PLANTED / "render.py").write_text('"""A job API nobody listed."""\n')
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1",
           "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(out), str(src)],
                   check=True, capture_output=True, text=True, timeout=300, env=env)
    (wheel,) = out.glob("kfp_nvrx-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return src, set(zf.namelist())


def test_the_wheel_ships_every_package_folder(built: tuple[Path, set[str]]) -> None:
    src, names = built
    folders = expected(src)
    # The disk walk found the tree, its data folders and the planted folder.
    assert {"components/cli/commands", "components/core/configs", "pipelines/compiled",
            "components/launch/trainjob/schemas", PLANTED} <= set(folders)
    assert missing(folders, names) == {}


def test_missing_names_a_folder_the_wheel_lacks(built: tuple[Path, set[str]]) -> None:
    """The check is not vacuous: a wheel without the planted folder fails it, naming the folder."""
    src, names = built
    planted = f"{MAPPED['components']}/launch/planted_api/render.py"
    assert planted in names
    assert missing(expected(src), names - {planted}) == {PLANTED: [planted]}
