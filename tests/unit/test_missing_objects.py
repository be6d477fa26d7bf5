"""A missing PVC or Secret is bad input (issue 30 item 7): said while the pods wait, then one line.

The pods' own status says it (the scheduler's PodScheduled condition, the kubelet's
CreateContainerConfigError); the real controllers and scheduler: tests/cluster/test_missing.py.
"""

from __future__ import annotations

from kubernetes import client as k8s

from kfp_nvrx.components.launch.kube.missing import MissingWatch
from kfp_nvrx.components.launch.kube.pods import missing_objects


def _pending(condition: str = "", waiting: tuple[str, str] | None = None) -> k8s.V1Pod:
    conds = [k8s.V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable",
                                message=condition)] if condition else []
    statuses = []
    if waiting:
        statuses = [k8s.V1ContainerStatus(
            name="pytorch", image="i", image_id="", ready=False, restart_count=0,
            state=k8s.V1ContainerState(waiting=k8s.V1ContainerStateWaiting(
                reason=waiting[0], message=waiting[1])))]
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="p", uid="u"),
                     status=k8s.V1PodStatus(phase="Pending", conditions=conds,
                                            container_statuses=statuses))


def test_the_pods_say_what_is_missing() -> None:
    pvc = _pending('0/2 nodes are available: persistentvolumeclaim "fsx-claim" not found. '
                   "preemption: 0/2 nodes are available")
    assert missing_objects(pvc, "pytorch") == ["PersistentVolumeClaim fsx-claim"]
    secret = _pending(waiting=("CreateContainerConfigError", 'secret "hf-token" not found'))
    assert missing_objects(secret, "pytorch") == ["Secret hf-token"]
    key = _pending(waiting=("CreateContainerConfigError",
                            "couldn't find key token in Secret ns/hf-token"))
    assert missing_objects(key, "pytorch") == ["Secret hf-token"]
    busy = _pending("0/2 nodes are available: 2 Insufficient nvidia.com/gpu")
    assert missing_objects(busy, "pytorch") == []  # waiting for room is no user error
    assert missing_objects(_pending(waiting=("ContainerCreating", "")), "pytorch") == []


def test_said_once_while_waiting_then_refused_after_the_grace() -> None:
    lines: list[str] = []
    watch = MissingWatch("ns", 60.0, lines.append)
    assert watch.check(["PersistentVolumeClaim fsx"], 0.0) is None
    assert watch.check(["PersistentVolumeClaim fsx"], 30.0) is None
    assert len(lines) == 1 and "fails in 60 s" in lines[0] and "fsx" in lines[0]
    assert watch.check(["PersistentVolumeClaim fsx"], 60.0) == "PersistentVolumeClaim fsx"
    watch.check([], 61.0)  # created meanwhile: the clock starts again if it goes missing
    assert watch.check(["PersistentVolumeClaim fsx"], 62.0) is None
