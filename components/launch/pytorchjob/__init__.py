"""The job API of a Kubeflow Training Operator v1 ``PyTorchJob``.

Render (:mod:`.render`), validate (:mod:`.validate`) and follow (:mod:`.follow`) a resolved job;
:data:`API` is what the launcher calls (:mod:`..job_apis` registers it as ``pytorchjob``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
from kfp_nvrx.components.launch.options import KubernetesOptions
from kfp_nvrx.components.launch.pytorchjob import render
from kfp_nvrx.components.launch.pytorchjob.follow import RESOURCE, FollowedPyTorchJob


class PyTorchJobApi:
    """The PyTorchJob as a :class:`..job_api.JobApi` (it takes no options of its own)."""

    name = "pytorchjob"
    resource = RESOURCE

    def refuse(self, job: ResolvedJob, opts: KubernetesOptions) -> None:
        """A name the operator's Services cannot take."""
        render.refuse(job)

    def render(self, job: ResolvedJob, opts: KubernetesOptions) -> render.RenderedJob:
        """The validated PyTorchJob."""
        return render.render(job)

    def follow(self, job: ResolvedJob, client: Any,
               say: Callable[[str], None]) -> FollowedPyTorchJob:
        """The calls on the PyTorchJob and the readings of it."""
        return FollowedPyTorchJob(client, job, say)


API = PyTorchJobApi()
