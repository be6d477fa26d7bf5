"""Kubeflow's typed models of the Trainer v2 API (``kubeflow-trainer-api``, pinned to our Trainer).

The TrainJob and its TrainingRuntime are built from these models (:mod:`.render`,
:mod:`.runtime`), as the PyTorchJob is built from the Training Operator's (``kubeflow-training``).
The pod parts come from the shared pod builder (:mod:`..jobspec.pod`, Kubernetes client models) as
plain dicts and enter through :func:`typed`, which refuses a field the model has no place for: the
generated ``from_dict`` would drop it without a word, and a patch field dropped on the way is a
setting silently not applied.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from kubeflow_trainer_api import models as tm

from kfp_nvrx.components.errors import UserError

__all__ = ["tm", "typed", "manifest"]


class _Model(Protocol):
    """What every generated model offers."""

    def to_dict(self) -> dict[str, Any]: ...


M = TypeVar("M", bound=_Model)


def typed(model: type[M], value: dict[str, Any], field: str) -> M:
    """``value`` as a ``model``; refuses (naming ``field``) what the model would drop or change.

    Raises:
        UserError: Naming ``field`` and the first key the model has no place for.
    """
    made = model.from_dict(value)  # type: ignore[attr-defined]
    assert made is not None
    got = made.to_dict()
    if got != value:
        raise UserError(field, f"{_first_difference(value, got)} cannot be set on a TrainJob "
                        "(Kubeflow Trainer v2.3's API has no such field); use "
                        "`job_api=pytorchjob`")
    return made


def _first_difference(want: Any, got: Any, where: str = "") -> str:
    """The dotted path of the first place where ``got`` lost or changed part of ``want``."""
    if isinstance(want, dict) and isinstance(got, dict):
        for key, value in want.items():
            if key not in got:
                return f"{where}{key}"
            if got[key] != value:
                return _first_difference(value, got[key], f"{where}{key}.")
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            if a != b:
                return _first_difference(a, b, f"{where}{i}.")
    return where.rstrip(".") or "the object"


def manifest(model: _Model) -> dict[str, Any]:
    """The model as the manifest the API server takes (API field names, no nulls)."""
    return model.to_dict()
