"""Tests that run against the HTTP test doubles (support.k8s_double, support.kfp_api_double,
support.hostile_http) instead of a Kubernetes or KFP API server."""
