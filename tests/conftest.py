"""Shared fixtures."""

import pytest


@pytest.fixture()
def kfp_local(tmp_path):
    """Run pipelines/components with ``kfp.local`` in this environment; yields the pipeline root.

    Tasks run as subprocesses of this interpreter (``SubprocessRunner(use_venv=False)``), so they
    import the package under test; kfp-kubernetes settings are ignored locally.
    """
    from kfp import local

    root = tmp_path / "pipeline_root"
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root),
               raise_on_error=True)
    return root


@pytest.fixture()
def one_rank_env(monkeypatch):
    """The launcher environment of a one-process job on a free local port (init_process_group)."""
    from kfp_nvrx.components.launch.local import free_port

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)


@pytest.fixture()
def double():
    """The Kubernetes API test double (tests/k8s_double.py), serving until the test ends."""
    from k8s_double import K8sDouble

    d = K8sDouble().serve()
    yield d
    d.close()
