"""What a test node tells the API server about itself: its Node object, its status, its Lease.

:class:`.agent.Agent` registers each Node with :func:`node_body`, then patches :func:`node_status`
and renews :func:`lease_body` every heartbeat, so the node lifecycle controller keeps it Ready.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from typing import Any

from .agent_pod import now

#: The test nodes' capacity: room for two cpu-profile pods (2 cpu / 4Gi requests) each.
CAPACITY = {"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi"}
LEASE_NAMESPACE = "kube-node-lease"
LEASE_S = 40
KUBELET_VERSION = "v1.35.4"


def node_body(name: str) -> dict[str, Any]:
    """The Node with the labels the ``cpu`` profile selects (and ours, to find test nodes)."""
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64", "node.kubernetes.io/instance-type": "cpu",
        "kfp-nvrx/test-node": "true"}}, "spec": {}}


def node_status(allocatable: dict[str, str], kubelet_port: int) -> dict[str, Any]:
    """A Ready node without pressure, whose kubelet API (container logs) is ``kubelet_port``."""
    t = now()
    conds = [(kind, "False", reason) for kind, reason in (
        ("MemoryPressure", "KubeletHasSufficientMemory"),
        ("DiskPressure", "KubeletHasNoDiskPressure"),
        ("PIDPressure", "KubeletHasSufficientPID"))]
    conds.append(("Ready", "True", "KubeletReady"))
    return {
        "conditions": [{"type": k, "status": s, "reason": r, "lastHeartbeatTime": t,
                        "lastTransitionTime": t, "message": "test node agent"}
                       for k, s, r in conds],
        "capacity": CAPACITY, "allocatable": allocatable,
        # InternalIP only: the API server prefers a Hostname address, which would not resolve.
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {"kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": KUBELET_VERSION,
                     "operatingSystem": "linux", "architecture": "amd64",
                     "containerRuntimeVersion": "agent://0", "osImage": "test node agent",
                     "kernelVersion": os.uname().release, "machineID": "", "systemUUID": "",
                     "bootID": "kfp-nvrx"}}


def lease_body(name: str) -> dict[str, Any]:
    """The node's Lease, renewed now (MicroTime: the client keeps the microseconds)."""
    return {"metadata": {"name": name, "namespace": LEASE_NAMESPACE},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_S,
                     "renewTime": datetime.now(timezone.utc)}}
