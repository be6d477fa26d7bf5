"""Shared fixtures, and how ``make test`` spreads the tests over its pytest-xdist workers."""

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` with all of tests/cluster as one file (``make test``: ``-n 2``).

    A file runs on one worker, so a module's module- and session-scoped fixtures (the bad-input
    sweep, the image venvs, the trainer runs) are built once, and a single worker starts the
    session's test cluster and runs every cluster test on it (a second cluster would halve the
    CPU of both). Collected first, the cluster tests start at once, beside the rest, which waits
    on no controller. (Done here, not with ``xdist_group`` marks: pytest 9.2's node ids no
    longer take the group suffix that ``--dist loadgroup`` relies on.)
    """
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    cluster = TESTS / "cluster"

    class ClusterAsOneFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "tests/cluster" if (config.rootpath / scope).is_relative_to(cluster) else scope

    return ClusterAsOneFile(config, log)


#: Modules of a minute or more (test time in a loaded CI run: trainer runs, the bad-input sweep,
#: fresh venvs, the drill), heaviest first. Under xdist they start right after the cluster tests,
#: so the two workers end together instead of one waiting on a big module collected last. A
#: module missing here only runs later.
HEAVY = ("test_trainer_resume.py", "test_bad_inputs.py", "test_images.py", "test_drills.py",
         "test_pipelines.py", "test_mounts.py", "test_launch_local_lifetime.py",
         "test_launcher_lifetime.py", "test_image_launcher_venv.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: tests/cluster first, then the HEAVY modules, then the rest (each
    module stays in one piece, in its own order; every worker sorts alike)."""
    if not hasattr(config, "workerinput"):
        return
    cluster = TESTS / "cluster"

    def rank(item: pytest.Item) -> int:
        path = Path(item.path)
        if path.is_relative_to(cluster):
            return 0
        return 1 + HEAVY.index(path.name) if path.name in HEAVY else 1 + len(HEAVY)
    items.sort(key=rank)  # stable


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
    from kfp_nvrx.components.launch.local.run import free_port

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)


@pytest.fixture()
def double():
    """The Kubernetes API test double (tests/support/k8s_double.py), serving until the test ends."""
    from support.k8s_double import K8sDouble

    d = K8sDouble().serve()
    yield d
    d.close()
