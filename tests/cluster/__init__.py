"""Tests against a real control plane and the Kubeflow controllers (the harness: ``tests/harness``)."""
