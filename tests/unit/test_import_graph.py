"""Imports run one way: launcher side -> core <- trainer, and the launcher side never needs torch.

The launcher/component image ships without torch, so a launcher-side module that imports torch
(or a trainer module, which does) at import time breaks ``kfp-nvrx`` there. Each check imports the
modules in a fresh interpreter where ``import torch`` fails.

The module graph (every import: top-level, lazy, ``TYPE_CHECKING``, and a registry's imports by
name) has no circle, and no arrow runs back up: from a subfolder into its parent folder's modules,
other than the ones the parent keeps for its subfolders to stand on (:data:`FLOORS`). The rooms
(top-level folders) import one another only along :data:`ALLOWED`.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
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


# --- The module graph: no circle, no arrow back up -------------------------------------------------

#: A folder's modules sit above its subfolders (the folder composes them: ``launch/backends.py``
#: over ``launch/local`` and ``launch/kube``), but for the ones it keeps as the floor its
#: subfolders stand on: the vocabulary they share. A subfolder's module importing any other module
#: of an ancestor folder is an arrow back up. ``*``: every module of the folder (core is the floor
#: of every room, ``core/events`` included). A floor module imports no other module of its folder.
FLOORS: dict[str, set[str]] = {
    "components": {"__init__", "errors", "images", "redaction"},  # the version; ``shared``
    "components/core": {"*"},
    # How a job is launched, what a launch reports, what a job API is: what the backends
    # (local/, kube/) and the job API folders share. The registry (job_apis.py, which names the
    # job API folders) and what picks and runs a job API (cluster_launch.py) sit above them.
    "components/launch": {"options", "result", "job_api"},
    # The rank helpers and the model: what trainer/, checkpoint/ and export/ share.
    "components/training": {"ranks", "model"},
}
#: Registries that import by name (``importlib``): the module that imports -> the registry's
#: targets, read from the registry itself so a new entry is an arrow too.
BY_NAME = {
    "kfp_nvrx.components.launch.job_apis": lambda: list(_registry("launch.job_apis", "REGISTRY").values()),
    "kfp_nvrx.components.core.ckpt_store": lambda: [
        f.partition(":")[0] for f in _registry("core.store_kinds", "_FACTORIES").values()
        if isinstance(f, str)],
    "kfp_nvrx.components.cli.main": lambda: list(_registry("cli.main", "COMMAND_MODULES")),
    "kfp_nvrx.pipelines.compile": lambda: [
        v.partition(":")[0] for v in _registry("pipelines.compile", "PIPELINES").values()],
}
#: By-name imports of what is not in the package (a user's model factory, NVRx's writer module in
#: its own process): no arrow inside the package.
BY_NAME_OUTSIDE = {"kfp_nvrx.components.training.model",
                   "kfp_nvrx.components.training.checkpoint.writer"}


def _registry(module: str, name: str) -> dict[str, str] | tuple[str, ...]:
    """The registry ``name`` of ``module`` (``kfp_nvrx.components.`` implied, not for pipelines)."""
    import importlib

    full = module if module.startswith("pipelines") else f"components.{module}"
    return getattr(importlib.import_module(f"kfp_nvrx.{full}"), name)  # type: ignore[no-any-return]


def _modules() -> dict[str, Path]:
    """Every module of the package, by import name."""
    out = {}
    for top in ("components", "pipelines"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(("kfp_nvrx", *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def _imported(tree: ast.AST) -> Iterator[str]:
    """Every ``kfp_nvrx`` name an import statement of ``tree`` names, wherever it stands."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from (f"{node.module}.{a.name}" for a in node.names)


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (``from pkg import mod`` names ``pkg.mod``)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = {resolve(n) for n in _imported(ast.parse(path.read_text()))
                 if n.startswith("kfp_nvrx.")}
        found |= {resolve(n) for n in BY_NAME.get(name, lambda: [])()}
        graph[name] = {m for m in found if m and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _folder(module: str, modules: dict[str, Path]) -> str:
    return modules[module].parent.relative_to(ROOT).as_posix()


def _on_floor(module: str, folder: str) -> bool:
    floor = FLOORS.get(folder, set())
    return "*" in floor or module.rpartition(".")[2] in floor or (
        module.rpartition(".")[2] == "components" and "__init__" in floor)


def arrows_back_up(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a subfolder into its ancestor folder's modules off the floor, and from a
    floor module into its own folder's other modules."""
    modules = _modules()
    out = []
    for src in sorted(graph):
        here = _folder(src, modules)
        for dst in sorted(graph[src]):
            there = _folder(dst, modules)
            if here.startswith(f"{there}/") and not _on_floor(dst, there):
                out.append(f"{src} -> {dst} (from {here} up into {there})")
            elif here == there and _on_floor(src, here) and not _on_floor(dst, here):
                out.append(f"{src} -> {dst} (the floor of {here} onto the rest of it)")
    return out


def test_no_import_circle() -> None:
    graph = import_graph()
    assert len(graph) > 150 and sum(map(len, graph.values())) > 500  # the walk found the tree
    assert circles(graph) == []


def test_no_arrow_back_up() -> None:
    assert arrows_back_up(import_graph()) == []


def test_every_floor_is_a_folder_of_modules() -> None:
    """A floor names modules that exist (a moved or renamed one is renamed here too)."""
    modules = _modules()
    for folder, floor in FLOORS.items():
        names = {m.rpartition(".")[2] if m != f"kfp_nvrx.{folder.replace('/', '.')}" else "__init__"
                 for m in modules if _folder(m, modules) == folder}
        assert floor - {"*"} <= names, f"{folder}: no module {floor - {'*'} - names}"


def test_every_import_by_name_is_known() -> None:
    """A module that imports by name (importlib) gives its arrows in BY_NAME, or says why not."""
    using = {name for name, path in _modules().items() if "import_module" in path.read_text()}
    assert using == set(BY_NAME) | BY_NAME_OUTSIDE


def test_the_graph_checks_would_catch_a_circle_and_an_arrow_up() -> None:
    """Not vacuous: the old circle (bootstrap -> train -> loop -> bootstrap) and the old chooser
    in kube/ (kube/launch.py -> job_apis) are caught."""
    trainer = f"{TRAINER}."
    graph = {f"{trainer}bootstrap": {f"{trainer}train"}, f"{trainer}train": {f"{trainer}loop"},
             f"{trainer}loop": {f"{trainer}bootstrap"}}
    assert circles(graph) == [sorted(graph)]
    kube = "kfp_nvrx.components.launch.kube.job_run"  # a module of kube/, importing the registry
    found = arrows_back_up({kube: {"kfp_nvrx.components.launch.job_apis",
                                   "kfp_nvrx.components.launch.options"}})
    assert found == [f"{kube} -> kfp_nvrx.components.launch.job_apis (from components/launch/kube "
                     "up into components/launch)"]
