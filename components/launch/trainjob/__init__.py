"""The job API of a Kubeflow Trainer v2 ``TrainJob``.

Render (:mod:`.render`), validate (:mod:`.validate`, :mod:`.validate_jobset`) and follow
(:mod:`.follow`) a resolved job, and the TrainingRuntime it refers to (:mod:`.runtime`); :data:`API`
is what the launcher calls (:mod:`..job_apis` registers it as ``trainjob``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
from kfp_nvrx.components.launch.options import KubernetesOptions
from kfp_nvrx.components.launch.trainjob import render
from kfp_nvrx.components.launch.trainjob import runtime as rt
from kfp_nvrx.components.launch.trainjob.follow import RESOURCE, FollowedTrainJob


def _runtime(opts: KubernetesOptions) -> tuple[str, str]:
    """The runtime the TrainJob refers to: the options', else the one ``images/deploy`` ships."""
    return opts.runtime or rt.RUNTIME_NAME, opts.runtime_kind or rt.RUNTIME_KIND


class TrainJobApi:
    """The TrainJob as a :class:`..job_api.JobApi`; its options are the runtime it refers to."""

    name = "trainjob"
    resource = RESOURCE

    def refuse(self, job: ResolvedJob, opts: KubernetesOptions) -> None:
        """What v2 cannot express (elastic nodes, a TTL, ...), and a bad runtime reference."""
        render.refuse(job, *_runtime(opts))

    def render(self, job: ResolvedJob, opts: KubernetesOptions) -> render.RenderedTrainJob:
        """The validated TrainJob and the runtime it refers to."""
        return render.render(job, *_runtime(opts))

    def follow(self, job: ResolvedJob, client: Any,
               say: Callable[[str], None]) -> FollowedTrainJob:
        """The calls on the TrainJob and the readings of it."""
        return FollowedTrainJob(client, job, say)


API = TrainJobApi()
