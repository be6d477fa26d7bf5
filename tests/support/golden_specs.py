"""The job specs behind the golden manifests, shared by the PyTorchJob and TrainJob golden tests.

Both renderers are pinned on the same two scenarios (an 8b run on p5 nodes, a tiny CPU demo) so
that their golden files can be read side by side.
"""

from __future__ import annotations

from kfp_nvrx.components.launch.jobspec.spec import JobSpec

IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/kfp-nvrx-trainer:0.1.0"
RUN_ID = "9b1c2d3e-4f50-4a6b-8c7d-0e1f2a3b4c5d"


def golden_specs(prefix: str, p5_nodes: str) -> dict[str, JobSpec]:
    """``<prefix>_p5.yaml`` and ``<prefix>_cpu.yaml`` -> their specs (``p5_nodes``: N or MIN:MAX)."""
    return {
        f"{prefix}_p5.yaml": JobSpec(
            image=IMAGE, pvc="fsx-claim", run_id=RUN_ID, task="train-fsdp", nodes=p5_nodes,
            instance_type="p5.48xlarge", config="8b",
            overrides=["data.path=/fsx/data/corpus", "train.steps=2000"],
        ),
        f"{prefix}_cpu.yaml": JobSpec(
            image="kfp-nvrx-trainer:0.1.0", pvc="shared", name="tiny-demo", nodes="2",
            instance_type="cpu", config="tiny", overrides=["train.steps=6", "checkpoint.interval=3"],
            faults=["kill@4/1"], mount="/data", run_dir="/data/runs/tiny-demo",
        ),
    }
