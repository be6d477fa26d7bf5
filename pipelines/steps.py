"""The steps both pipelines share, wired the same way: prepare -> train -> export.

Every task mounts the shared volume (``pvc_name``) at :data:`MOUNT_PATH`. The training task gets
/dev/shm, the launcher node selector and tolerations, no caching and a long timeout; the tasks that
are safe to repeat (prepare, export, compare) are retried and bounded; the model-loading ones
(export, compare) are sized from the config by ``size-export``. A pipeline builds each component
task with its own inputs and hands it to the step here that places it; the training task's
parameters come from the ``train_fsdp`` component itself (:func:`train_parameters`).
"""

import functools
import inspect
import textwrap
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from kfp import dsl, kubernetes

from kfp_nvrx.components import images
from kfp_nvrx.components.export_checkpoint.component import size_export
from kfp_nvrx.components.train_fsdp.component import train_fsdp

#: Mount path of the shared volume in every task (and in the training job's worker pods).
MOUNT_PATH = "/fsx"
#: Pod-level limits (activeDeadlineSeconds) of each task.
PREPARE_TIMEOUT_S = 4 * 3600
TRAIN_TIMEOUT_S = 7 * 24 * 3600
EXPORT_TIMEOUT_S = 4 * 3600
#: Memory-backed /dev/shm of the training task (the local backend's workers use it).
SHM_SIZE = "2Gi"


@dataclass(frozen=True)
class Placement:
    """Where and how big a model-loading task (export, compare) runs.

    Attributes:
        memory: Its memory, request = limit (the ``size-export`` task's output).
        cpu: Its CPU request (a pipeline parameter).
        node_selector: Its node selector, a JSON object (a pipeline parameter).
    """

    memory: Any
    cpu: Any
    node_selector: Any


def on_shared_volume(task: dsl.PipelineTask, pvc_name: str) -> dsl.PipelineTask:
    """Mount the shared volume at :data:`MOUNT_PATH`."""
    return kubernetes.mount_pvc(task, pvc_name=pvc_name, mount_path=MOUNT_PATH)


def retried(task: dsl.PipelineTask, timeout_s: int) -> dsl.PipelineTask:
    """Retry a task that is safe to repeat (prepare, export, compare) and bound its pod time."""
    task.set_retry(num_retries=2, backoff_duration="60s", backoff_factor=2.0)
    return kubernetes.set_timeout(task, timeout_s)


def launcher_task(task: dsl.PipelineTask, node_selector: dict, tolerations: list) -> None:
    """Configure the training (launcher) task: no cache, /dev/shm, placement, timeout."""
    task.set_caching_options(False)  # its cache key covers only inputs: a hit would skip training
    task.set_cpu_request("1").set_memory_request("2Gi")
    kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory",
                               size_limit=SHM_SIZE)
    kubernetes.add_node_selector_json(task, node_selector)
    kubernetes.add_toleration_json(task, tolerations)
    kubernetes.set_timeout(task, TRAIN_TIMEOUT_S)


def sized_task(task: dsl.PipelineTask, placement: Placement) -> None:
    """Give a model-loading task (export, compare) its memory (request = limit), CPU and nodes."""
    memory = placement.memory
    # kfp.local orders tasks by their inputs only: a resource channel alone does not make its
    # producer run first.
    task.after(memory.task)
    task.set_memory_request(memory).set_memory_limit(memory).set_cpu_request(placement.cpu)
    kubernetes.add_node_selector_json(task, placement.node_selector)


def export_size(config: Any, overrides: Any, export_memory: Any,
                pvc_name: Any) -> dsl.PipelineTask:
    """The task that sizes the export step from the config (it may be a YAML on the volume)."""
    size = size_export(config=config, overrides=overrides, export_memory=export_memory)
    size.set_display_name("size-export")
    on_shared_volume(size, pvc_name)
    return retried(size, PREPARE_TIMEOUT_S)


def prepare_step(task: dsl.PipelineTask, pvc_name: Any) -> dsl.PipelineTask:
    """The ``prepare-dataset`` task: on the shared volume, retried."""
    task.set_display_name("prepare-dataset")
    on_shared_volume(task, pvc_name)
    return retried(task, PREPARE_TIMEOUT_S)


def train_step(task: dsl.PipelineTask, pvc_name: Any, node_selector: Any,
               tolerations: Any) -> dsl.PipelineTask:
    """The ``train-fsdp`` (launcher) task: on the shared volume, placed as a launcher."""
    task.set_display_name("train-fsdp")
    on_shared_volume(task, pvc_name)
    launcher_task(task, node_selector, tolerations)
    return task


def export_step(task: dsl.PipelineTask, pvc_name: Any, placement: Placement) -> dsl.PipelineTask:
    """The ``export-checkpoint`` task: on the shared volume, retried, sized by ``placement``."""
    task.set_display_name("export-checkpoint")
    on_shared_volume(task, pvc_name)
    retried(task, EXPORT_TIMEOUT_S)
    sized_task(task, placement)
    return task


#: The train component's parameters a pipeline wires itself (the dataset, where the run goes, its
#: outputs, the warm start, the KFP placeholders); a pipeline takes every other one as its own.
WIRED = ("dataset", "workspace", "run", "metrics", "timeline", "pvc_name", "mount_path",
         "init_from", "init_from_required", "kfp_run_id", "kfp_task")
#: A pipeline's defaults where the component's differ: the image is fixed when the pipeline is
#: compiled (the component's '' is the same image, read where the component runs).
PIPELINE_DEFAULTS: dict[str, Callable[[], Any]] = {"trainer_image": images.trainer_image}
_Fn = TypeVar("_Fn", bound=Callable[..., Any])
#: The pipeline function's parameter that stands for the train step's (see train_parameters).
MARKER = "train_args"


def train_parameters(*, omit: Collection[str] = ()) -> Callable[[_Fn], _Fn]:
    """Gives a pipeline the training step's parameters, from the ``train_fsdp`` component.

    The pipeline function takes a ``train_args`` parameter where they go, in its signature and
    its docstring's Args (one entry, replaced by theirs); KFP then reads them, one by one, with
    the component's types, defaults (but :data:`PIPELINE_DEFAULTS`) and descriptions, and the
    function gets them as the ``train_args`` dict, ready for ``train_fsdp(**train_args)``. A
    parameter added to the component is a parameter of every pipeline.

    Args:
        omit: Component parameters the pipeline does not offer (beside :data:`WIRED`).
    """
    component = inspect.signature(train_fsdp.python_func).parameters
    inputs = train_fsdp.component_spec.inputs
    names = [n for n in component if n not in WIRED and n not in omit]
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation=component[n].annotation,
                                default=PIPELINE_DEFAULTS[n]() if n in PIPELINE_DEFAULTS
                                else component[n].default)
              for n in names]

    def wrap(fn: _Fn) -> _Fn:
        own = inspect.signature(fn)
        at = list(own.parameters).index(MARKER)
        mine = list(own.parameters.values())
        signature = own.replace(parameters=[*mine[:at], *params, *mine[at + 1:]])

        @functools.wraps(fn)
        def pipeline(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            given = dict(bound.arguments)
            train_args = {n: given.pop(n) for n in names}
            return fn(**given, **{MARKER: train_args})

        pipeline.__signature__ = signature  # type: ignore[attr-defined]
        pipeline.__doc__ = _with_args(fn.__doc__ or "", MARKER,
                                      {n: inputs[n].description or "" for n in names})
        return pipeline  # type: ignore[return-value]

    return wrap


def _with_args(doc: str, entry: str, args: dict[str, str]) -> str:
    """``doc`` with its Args entry ``entry`` (and its continuation lines) replaced by ``args``."""
    lines = doc.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith(f"{entry}: "))
    indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
    end = at + 1
    while end < len(lines) and lines[end].startswith(indent + " ") and lines[end].strip():
        end += 1
    body = [textwrap.indent(f"{name}: {text}".replace("\n", "\n    "), indent)
            for name, text in args.items()]
    return "\n".join([*lines[:at], *body, *lines[end:]]) + ("\n" if doc.endswith("\n") else "")
