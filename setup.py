"""The package list, found on disk: setup.cfg holds the metadata and the folder mapping.

``setup.cfg`` maps the one import name onto the top-level folders (``package_dir``:
``kfp_nvrx.components = components``, ``kfp_nvrx.pipelines = pipelines``), and setuptools'
``find_namespace:`` cannot put that prefix on what it finds, so the list is computed here: every
folder below a mapped one is a package (a folder of data files such as ``core/configs`` too, so
its ``package_data`` ships). A new folder is in the wheel without an edit
(``tests/unit/test_packaging.py`` builds the wheel and checks).
"""

from __future__ import annotations

import configparser
from pathlib import Path

from setuptools import find_namespace_packages, setup

HERE = Path(__file__).resolve().parent


def package_dir() -> dict[str, str]:
    """setup.cfg's ``[options] package_dir`` mapping: import name -> folder."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(HERE / "setup.cfg")
    pairs = (line.split("=", 1) for line in cfg["options"]["package_dir"].splitlines() if line)
    return {name.strip(): folder.strip() for name, folder in pairs}


def packages() -> list[str]:
    """Every mapped package and every folder below it, as import names."""
    found = []
    for name, folder in package_dir().items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in
                  find_namespace_packages(str(HERE / folder), exclude=["*__pycache__*"])]
    return sorted(found)


setup(packages=packages())
