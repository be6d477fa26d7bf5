"""A ``JobSpec`` rendered the way the launcher renders it: resolved once, then by its job API.

The renderers take only a ``ResolvedJob`` (``jobspec.resolve.resolve`` is its only producer);
the tests that pin a manifest on a spec go through these two.
"""

from __future__ import annotations

from kfp_nvrx.components.launch.jobspec.resolve import resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.pytorchjob import render as pytorchjob
from kfp_nvrx.components.launch.trainjob import render as trainjob
from kfp_nvrx.components.launch.trainjob import runtime as rt


def render_pytorchjob(spec: JobSpec) -> pytorchjob.RenderedJob:
    """The validated PyTorchJob of ``spec``."""
    return pytorchjob.render(resolve(spec))


def render_trainjob(spec: JobSpec, runtime_name: str = rt.RUNTIME_NAME,
                    runtime_kind: str = rt.RUNTIME_KIND) -> trainjob.RenderedTrainJob:
    """The validated TrainJob of ``spec``, referring to that runtime."""
    return trainjob.render(resolve(spec), runtime_name, runtime_kind)
