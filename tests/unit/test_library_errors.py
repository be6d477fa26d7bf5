"""No library error names a ``--flag``: each surface words the field for its own user.

The libraries under ``components/`` raise :class:`UserError` naming the domain field (``run_dir``,
``train.steps``) and refer to other fields as `` `run_dir` `` or `` `overrides=train.device=cpu` ``;
the CLI says ``--run-dir`` / ``--set train.device=cpu``, the KFP component ``workspace`` /
``overrides=...``, a pipeline run ``--param ...`` (``errors.Surface``, ``core.fields``). A flag
written into a library message reaches a KFP user who has no such flag.

The check reads the source (every raise site, not only those a test happens to reach): the
string parts of each ``UserError(...)`` call, the local or module-level string a name in it was
assigned, and every literal passed as the ``field``/``flag`` argument of a library function
that raises with it. ``components/cli/`` is the CLI's own surface and may name its flags; so may a
module that parses its own command line (``core/runtime_entry.py`` reads the ``TrainerArgs`` a
TrainJob passes), for the flags its own ``add_argument`` (or ``add_trainer_flags``) calls
declare.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kfp_nvrx.components.core import trainer_flags
from kfp_nvrx.components.core.fields import CLI, COMPONENT, PIPELINE
from kfp_nvrx.components.errors import Surface, UserError

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = sorted(p for p in (ROOT / "components").rglob("*.py") if "cli" not in
                 p.relative_to(ROOT / "components").parts[:1])
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
#: Parameters whose value a function raises UserError with as the field.
FIELD_PARAMS = ("field", "flag")
#: Offenders in rooms this change may not edit (components/launch/ is being rebuilt under issue
#: 32 items 1-2): (function, flag). Its owners reword them and drop the entry; a fixed one fails
#: here until it is dropped, so the list only shrinks.
KNOWN = {
    ("preflight", "--check"),  # a command line to run, not a field: `python -m ... --check`
}


#: The trainer's flags, declared once (``core/trainer_flags.py``) for every parser that calls
#: ``add_trainer_flags``.
TRAINER_FLAGS = {v for k, v in vars(trainer_flags).items() if k.endswith("_FLAG")}


def _declared(tree: ast.AST) -> set[str]:
    """The flags the ``add_argument`` (and ``add_trainer_flags``) calls in ``tree`` declare."""
    flags = set()
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and _callee(call) == "add_argument":
            flags |= {a.value for a in call.args if isinstance(a, ast.Constant)
                      and isinstance(a.value, str) and a.value.startswith("--")}
        elif isinstance(call, ast.Call) and _callee(call) == "add_trainer_flags":
            flags |= TRAINER_FLAGS
    return flags


def _our_flags() -> set[str]:
    """Every flag of our command lines (``kfp-nvrx``, the trainer, ``python -m ...images``).

    Read from their ``add_argument`` calls; ft_launcher's own flags (``--local-addr``) may be
    named, they are not ours to word.
    """
    flags: set[str] = set()
    for path in (ROOT / "components").rglob("*.py"):
        flags |= _declared(ast.parse(path.read_text()))
    return flags


def _strings(node: ast.AST) -> list[str]:
    """The literal text of ``node``: a string, or the constant parts of an f-string."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _assigned(scope: ast.AST) -> dict[str, list[ast.AST]]:
    """Name -> the values assigned to it in ``scope``: a function's body, a module's top level."""
    out: dict[str, list[ast.AST]] = {}
    nodes = scope.body if isinstance(scope, ast.Module) else ast.walk(scope)
    for node in nodes:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out.setdefault(target.id, []).append(node.value)
    return out


def _field_positions(trees: dict[Path, ast.Module]) -> dict[str, int]:
    """Library function name -> the position of its ``field``/``flag`` parameter."""
    out = {"UserError": 0}
    for tree in trees.values():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in fn.args.args]
                skip = 1 if names[:1] in (["self"], ["cls"]) else 0
                for param in FIELD_PARAMS:
                    if param in names:
                        out[fn.name] = names.index(param) - skip
    return out


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _texts_of_call(call: ast.Call, where: int | None, names: dict[str, list[ast.AST]]) -> list[str]:
    """What a call writes into an error: all its strings (UserError), else its field argument."""
    if _callee(call) == "UserError":
        parts = list(call.args) + [k.value for k in call.keywords]
    else:
        parts = [k.value for k in call.keywords if k.arg in FIELD_PARAMS]
        if where is not None and where < len(call.args):
            parts.append(call.args[where])
    texts = []
    for part in parts:
        texts += _strings(part)
        for name in (n.id for n in ast.walk(part) if isinstance(n, ast.Name)):
            for value in names.get(name, []):
                texts += _strings(value)
    return texts


def _offenders(root: Path = ROOT, files: list[Path] = LIBRARY,
               ours: set[str] | None = None) -> set[tuple[str, str, str]]:
    """(file, function, flag) for every flag of ``ours`` a library error in ``files`` may name."""
    ours = _our_flags() if ours is None else ours
    trees = {p: ast.parse(p.read_text(), str(p)) for p in files}
    positions = _field_positions(trees)
    found = set()
    for path, tree in trees.items():
        module_names = _assigned(tree)
        # A module's own parser is its user's surface: its errors may name what it declares.
        named = ours - _declared(tree)
        scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for scope in [tree, *scopes]:
            names = {**module_names, **_assigned(scope)} if scope is not tree else module_names
            for call in (n for n in ast.walk(scope) if isinstance(n, ast.Call)):
                if _callee(call) not in positions:
                    continue
                for text in _texts_of_call(call, positions[_callee(call)], names):
                    for flag in set(FLAG.findall(text)) & named:
                        name = scope.name if scope is not tree else "<module>"
                        found.add((str(path.relative_to(root)), name, flag))
    # A call inside a function is also seen from the module scope: keep the innermost.
    inner = {(f, flag) for f, name, flag in found if name != "<module>"}
    return {o for o in found if o[1] != "<module>" or (o[0], o[2]) not in inner}


def test_no_library_error_names_a_flag() -> None:
    offenders = _offenders()
    unknown = sorted(o for o in offenders if (o[1], o[2]) not in KNOWN)
    assert not unknown, ("library errors naming a CLI flag; name the field and refer to others as "
                         f"`field` or `field=value` (errors.Surface): {unknown}")
    fixed = KNOWN - {(o[1], o[2]) for o in offenders}
    assert not fixed, f"fixed, drop them from KNOWN: {sorted(fixed)}"


def test_the_scan_sees_each_kind_of_raise_site(tmp_path: Path) -> None:
    """A flag in a message, in a field, in a local name, and passed as a helper's field."""
    planted = tmp_path / "components" / "planted.py"
    planted.parent.mkdir()
    planted.write_text(
        "def check(path, field):\n    raise UserError(field, 'bad')\n\n"
        "def a():\n    raise UserError('out', f'use --force {1}')\n\n"
        "def b():\n    raise UserError('--out', 'bad')\n\n"
        "def c(x):\n    field = '--registry' if x else 'ENV'\n    raise UserError(field, 'bad')\n\n"
        "def d():\n    check('p', '--out')\n\n"
        "def e():\n    raise UserError('out', 'use `force`')\n")
    found = _offenders(tmp_path, [planted], ours={"--force", "--out", "--registry"})
    assert sorted((name, flag) for _, name, flag in found) == [
        ("a", "--force"), ("b", "--out"), ("c", "--registry"), ("d", "--out")]


def test_a_module_may_name_only_the_flags_its_own_parser_declares(tmp_path: Path) -> None:
    planted = tmp_path / "components" / "entry.py"
    planted.parent.mkdir()
    planted.write_text(
        "def parser(p):\n    p.add_argument('--config')\n\n"
        "def a():\n    raise UserError('args', 'take --config or --force')\n")
    found = _offenders(tmp_path, [planted], ours={"--config", "--force"})
    assert sorted((name, flag) for _, name, flag in found) == [("a", "--force")]


@pytest.mark.parametrize(("surface", "field", "message"), [
    (CLI, "--run-dir", "use a fresh --run-dir or --set train.device=cpu"),
    (COMPONENT, "workspace", "use a fresh workspace or overrides=train.device=cpu"),
    (PIPELINE, "--param workspace", "use a fresh --param workspace or --param "
                                    "overrides=train.device=cpu"),
])
def test_each_surface_words_a_library_message(surface: Surface, field: str, message: str) -> None:
    said = surface.reword(UserError("run_dir", "use a fresh `run_dir` or `overrides=train.device=cpu`"))
    assert (said.field, said.message) == (field, message)
