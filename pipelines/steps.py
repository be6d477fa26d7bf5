"""The steps both pipelines share, wired the same way: prepare -> train -> export.

Every task mounts the shared volume (``pvc_name``) at :data:`MOUNT_PATH`. The training task gets
/dev/shm, the launcher node selector and tolerations, no caching and a long timeout; the tasks that
are safe to repeat (prepare, export, compare) are retried and bounded; the model-loading ones
(export, compare) are sized from the config by ``size-export``. A pipeline builds each component
task with its own inputs and hands it to the step here that places it.
"""

from dataclasses import dataclass
from typing import Any

from kfp import dsl, kubernetes

from kfp_nvrx.components.export_checkpoint.component import size_export

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
