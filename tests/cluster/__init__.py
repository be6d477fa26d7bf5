"""A real Kubernetes control plane (and node agent) for the tests; see README in this folder."""
