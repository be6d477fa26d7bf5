"""The test cluster itself: every component up and the real webhooks answering (its lifecycle:
test_controlplane_lifecycle.py)."""

from __future__ import annotations

import pytest

from cluster.controlplane import USER_NAMESPACE

COMPONENTS = {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
              "trainer-controller-manager", "jobset-controller", "training-operator", "kueue"}


def test_every_component_runs_and_crds_are_served(kube):
    assert COMPONENTS <= set(kube.state["components"])
    dyn = kube.dynamic()
    groups = {g.name for g in kube.client().call_api(
        "/apis", "GET", response_type="V1APIGroupList", _return_http_data_only=True).groups}
    assert {"trainer.kubeflow.org", "jobset.x-k8s.io", "kubeflow.org", "kueue.x-k8s.io"} <= groups
    runtime = dyn.resources.get(api_version="trainer.kubeflow.org/v1alpha1",
                                kind="TrainingRuntime").get(name="kfp-nvrx-ft",
                                                            namespace=USER_NAMESPACE)
    assert runtime.metadata.labels["app.kubernetes.io/part-of"] == "kfp-nvrx"
    ctr = dyn.resources.get(api_version="trainer.kubeflow.org/v1alpha1",
                            kind="ClusterTrainingRuntime").get(name="torch-distributed")
    assert ctr.spec.template.spec.replicatedJobs[0].name == "node"


def test_webhooks_are_called_for_real(kube):
    """A TrainJob asking for a dataset initializer its runtime does not have is refused by the
    Trainer's webhook.

    Not a missing runtime: Kueue's TrainJob webhook (topology-aware scheduling, on by default)
    refuses that too, and validating webhooks run in parallel, so whose refusal the server
    returns is a race. Kueue accepts this one (the runtime exists); only the Trainer refuses it.
    """
    from kubernetes.client.rest import ApiException

    res = kube.dynamic().resources.get(api_version="trainer.kubeflow.org/v1alpha1",
                                       kind="TrainJob")
    body = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": "no-dataset-initializer"},
            "spec": {"runtimeRef": {"name": "kfp-nvrx-ft", "kind": "TrainingRuntime",
                                    "apiGroup": "trainer.kubeflow.org"},
                     "initializer": {"dataset": {"storageUri": "hf://absent/absent"}}}}
    with pytest.raises(ApiException) as e:
        res.create(body=body, namespace=USER_NAMESPACE, query_params=[("dryRun", "All")])
    body = e.value.body.decode() if isinstance(e.value.body, bytes) else e.value.body
    assert "validator.trainjob.trainer.kubeflow.org" in body, body
    assert "must have dataset-initializer job" in body, body
