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
