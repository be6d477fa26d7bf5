"""Instance profiles: what one worker pod (PyTorchJob or TrainJob) asks for on an EC2 instance type.

A profile is a starting point; every value can be overridden per job (see ``JobSpec``). The numbers
follow the aws-samples EKS manifests for p5/p4d: all GPUs and all EFA interfaces of the node go to
one pod, hugepages for the EFA provider, explicit cpu/memory requests a little below the node's
allocatable (kubelet, system daemons and the EFA/NVIDIA/FSx DaemonSets need the rest), and
``IPC_LOCK`` so libfabric can pin memory for RDMA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kfp_nvrx.components.errors import UserError

#: Well-known node label the kubelet sets to the EC2 instance type.
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
#: Extended resource names of the NVIDIA and EFA device plugins.
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"

# The EFA profiles turn NVRx's NIC monitor off: it reads the InfiniBand PMA counter
# ``ports/1/counters/link_downed``, and the kernel creates ``counters/`` only for devices that
# answer management datagrams (``process_mad``). The EFA driver does not, so an EFA device has only
# ``ports/1/hw_counters/`` (tx/rx bytes and packets, drops, RDMA read/write, retransmits,
# unresponsive-remote events: no link_downed). The monitor would find no file, log a warning at
# every check and never detect anything. A dead EFA link still surfaces as an NCCL error or a
# missed heartbeat, which ft_launcher handles.
#: Taint that EKS GPU node groups commonly carry; GPU pods tolerate it.
_GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


@dataclass(frozen=True)
class InstanceProfile:
    """Per-pod resources and placement for one instance type.

    Attributes:
        name: Profile name (the EC2 instance type, or ``cpu``).
        gpus: GPUs per node; also the most processes per node (one per GPU). 0 for CPU.
        efa: EFA interfaces per node (``vpc.amazonaws.com/efa``).
        cpu: CPU request of the worker container.
        memory: Memory request of the worker container.
        hugepages: ``hugepages-2Mi`` request/limit ('' for none).
        shm_size: Size limit of the memory-backed ``/dev/shm``.
        instance_type: Value of the instance-type node selector ('' for none).
        tolerations: Tolerations added to every worker pod.
        default_procs: Processes per node when the user does not say (GPU profiles: all GPUs).
        nic_monitor: Whether ft_launcher watches ``/sys/class/infiniband/*/ports/1/counters/
            link_downed`` (``--ft-enable-nic-monitor``).

    """

    name: str
    gpus: int
    efa: int
    cpu: str
    memory: str
    hugepages: str
    shm_size: str
    instance_type: str
    tolerations: tuple[dict[str, str], ...] = field(default_factory=tuple)
    default_procs: int = 1
    nic_monitor: bool = False

    @property
    def is_gpu(self) -> bool:
        """True for GPU instance types (NCCL env, NIC monitor, GPU requests)."""
        return self.gpus > 0


PROFILES: dict[str, InstanceProfile] = {
    # 8x H100 80GB, 32 EFA (3200 Gbps), 192 vCPU, 2048 GiB. Requests leave ~10% for the node.
    "p5.48xlarge": InstanceProfile(
        name="p5.48xlarge",
        gpus=8,
        efa=32,
        cpu="180",
        memory="1800Gi",
        hugepages="5120Mi",
        # /dev/shm holds the checkpoint staging buffer (trainer/checkpoint/staging.py): the whole
        # per-node state, ~12 bytes/param (fp32 params + AdamW moments) divided by the node count,
        # e.g. ~90 GiB for 8B on one node. 512Gi covers the largest state that fits in the node's
        # 640 GB of HBM (state is 12 of the ~16 bytes/param held on the GPUs: <= ~450 GiB) plus
        # NCCL and DataLoader segments. The sizeLimit is only an eviction threshold; tmpfs pages
        # count against node memory as they are written, and there is no container memory limit.
        shm_size="512Gi",
        instance_type="p5.48xlarge",
        tolerations=(_GPU_TOLERATION,),
        default_procs=8,
        nic_monitor=False,  # EFA has no link_downed counter (see above)
    ),
    # 8x A100 40GB, 4 EFA (400 Gbps), 96 vCPU, 1152 GiB.
    "p4d.24xlarge": InstanceProfile(
        name="p4d.24xlarge",
        gpus=8,
        efa=4,
        cpu="88",
        memory="1000Gi",
        hugepages="5120Mi",
        # As p5: 320 GB of HBM bounds the per-node state at ~225 GiB (8B on one node: ~90 GiB).
        shm_size="256Gi",
        instance_type="p4d.24xlarge",
        tolerations=(_GPU_TOLERATION,),
        default_procs=8,
        nic_monitor=False,  # EFA has no link_downed counter (see above)
    ),
    # Any node: small clusters (kind, CPU node groups) and tests. gloo, no GPUs, no EFA.
    "cpu": InstanceProfile(
        name="cpu",
        gpus=0,
        efa=0,
        cpu="2",
        memory="4Gi",
        hugepages="",
        shm_size="1Gi",
        instance_type="",
        default_procs=1,
    ),
}


def get_profile(name: str) -> InstanceProfile:
    """Look up the profile of an instance type; raises UserError naming ``instance_type``."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise UserError("instance_type",
                        f"unknown instance type {name!r}; known: {known}") from None
