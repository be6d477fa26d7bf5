"""The pipeline's training step on the test cluster (issue 21.6).

The ``train_fsdp`` KFP component runs as a step under ``kfp.local`` with the parameters a
Kubeflow UI user sets (``backend=kubernetes``, ``job_api=trainjob``, ``pvc_name``, one fault);
the step's launcher talks to the real API server (``KUBECONFIG``), the real Trainer, JobSet and
Job controllers build the pods, the node agent runs them, and the step publishes Metrics and the
timeline from the events the pods wrote on the "PVC". The shared volume is mounted at the same
path in the step and in the pods (the claim's folder here), as it is at ``/fsx`` on EKS.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_train_fsdp_step_drives_a_trainjob_with_one_fault(kube, kfp_local, monkeypatch):
    from kfp import dsl

    from kfp_nvrx.components.prepare_dataset.component import prepare_dataset
    from kfp_nvrx.components.train_fsdp.component import train_fsdp

    claim = kube.root / "volumes" / kube.namespace / "kfp-nvrx-shared"
    claim.mkdir(parents=True, exist_ok=True)
    workspace = claim / "pipeline-ws"
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))  # the step's launcher reads it
    trainjobs = kube.dynamic().resources.get(api_version="trainer.kubeflow.org/v1alpha1",
                                             kind="TrainJob")
    before = {j.metadata.name for j in trainjobs.get(namespace=kube.namespace).items}

    @dsl.pipeline(name="train-on-cluster")
    def on_cluster():
        data = prepare_dataset(source="sample:300", workspace=str(workspace), seq_len=64)
        train_fsdp(dataset=data.outputs["dataset"], workspace=str(workspace),
                   pvc_name="kfp-nvrx-shared", mount_path=str(claim), config="tiny",
                   overrides=["train.steps=16", "checkpoint.interval=4"], faults=["kill@10/1"],
                   nodes="2", nproc_per_node=1, instance_type="cpu",
                   trainer_image="kfp-nvrx-trainer:test", backend="kubernetes",
                   job_api="trainjob", deadline_s=600)

    on_cluster()
    (run_root,) = [p for p in kfp_local.iterdir() if p.name.startswith("train-on-cluster")]
    out = json.loads((run_root / "train-fsdp" / "executor_output.json").read_text())
    metrics = out["artifacts"]["metrics"]["artifacts"][0]["metadata"]
    assert metrics["steps_final"] == 16 and metrics["faults"] == 1, metrics
    assert metrics["restarts_in_job"] >= 1 and metrics["restarts_pod"] == 0, metrics
    assert 0 < metrics["goodput"] < 1, metrics
    page = (run_root / "train-fsdp" / "timeline").read_text()
    assert "fault: kill at step 10, rank 1" in page
    # The step created one TrainJob and deleted it on success (delete_after=on_success).
    after = {j.metadata.name: j for j in trainjobs.get(namespace=kube.namespace).items}
    assert not [n for n, j in after.items() if n not in before
                and j.metadata.deletionTimestamp is None]
