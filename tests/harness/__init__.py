"""The cluster harness: a real Kubernetes control plane (kube-apiserver, etcd, the Kubeflow
controllers, JobSet, Kueue, built from the Go modules in this folder by ``build.sh``) and a node
agent that runs pods as local processes; ``python -m harness up|down|serve|status`` from tests/
(``make cluster-up``). The cluster tests in ``tests/cluster`` run on it."""
