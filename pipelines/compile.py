"""The pipelines this package ships and how they are compiled to the YAML users upload.

``pipelines/compiled/<name>.yaml`` is committed and shipped; a test fails when it differs from a
fresh compile. Component images are named from the package version and ``KFP_NVRX_REGISTRY``
(``kfp_nvrx.components.images``), which the component modules read when first imported, so
:func:`compile_pipelines` sets the registry before importing them.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from kfp_nvrx.components.core.atomic import AtomicFile
from kfp_nvrx.components.errors import UserError

#: Pipeline name -> ``module:function``.
PIPELINES = {
    "fsdp-train": "kfp_nvrx.pipelines.fsdp_train:fsdp_train",
    "scheduled-retrain": "kfp_nvrx.pipelines.scheduled_retrain:scheduled_retrain",
}
#: Where the shipped YAML lives.
COMPILED_DIR = Path(__file__).parent / "compiled"


def check_name(name: str) -> str:
    """Return ``name`` when it is a shipped pipeline; raise UserError otherwise."""
    if name not in PIPELINES:
        raise UserError("--pipeline", f"unknown pipeline {name!r}; choose one of "
                        f"{', '.join(PIPELINES)}")
    return name


def load_pipeline(name: str) -> Any:
    """Import and return the pipeline function (a KFP ``GraphComponent``)."""
    module, func = PIPELINES[check_name(name)].split(":")
    return getattr(importlib.import_module(module), func)


def compiled_path(name: str, out_dir: str | os.PathLike[str] = COMPILED_DIR) -> Path:
    """Return the path of a pipeline's YAML in ``out_dir``."""
    return Path(out_dir) / f"{check_name(name)}.yaml"


def compile_pipelines(out_dir: str | os.PathLike[str] = COMPILED_DIR,
                      names: list[str] | None = None,
                      registry: str | None = None) -> list[Path]:
    """Compile pipelines to ``<out_dir>/<name>.yaml`` (each file replaced atomically).

    Args:
        out_dir: Target directory (created if missing).
        names: Pipelines to compile (default: all).
        registry: Image registry for the components (default: ``$KFP_NVRX_REGISTRY`` or the
            package default); must be given before the component modules are first imported.

    Returns:
        The written files.

    Raises:
        UserError: Unknown pipeline, bad registry, or an unwritable ``out_dir``.

    """
    from kfp import compiler

    from kfp_nvrx.components import images

    names = [check_name(n) for n in (names or list(PIPELINES))]
    if registry is not None:
        reg = images.registry(registry)
        if _components_imported() and reg != images.registry():
            raise UserError("--registry", "the components were already imported with another "
                            "registry; set KFP_NVRX_REGISTRY before starting instead")
        os.environ[images.REGISTRY_ENV] = reg
    else:
        images.registry()  # validate $KFP_NVRX_REGISTRY with a one-line error
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError("--out", f"cannot create {out}: {err.strerror}") from None
    written = []
    for name in names:
        target = compiled_path(name, out)
        # KFP's compiler writes by name: it fills our temporary file, which then replaces target.
        with AtomicFile(target, suffix=".yaml") as staged:
            compiler.Compiler().compile(load_pipeline(name), package_path=str(staged.tmp))
            os.chmod(staged.tmp, 0o644)  # exactly 0644, whatever the umask
        written.append(target)
    return written


def _components_imported() -> bool:
    """Return True when a component module (which reads the registry on import) is loaded."""
    import sys

    return any(m.startswith("kfp_nvrx.components.") and m.endswith(".component")
               for m in sys.modules)
