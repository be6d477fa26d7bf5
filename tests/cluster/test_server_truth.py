"""Server truth: the real API server, webhooks and controllers judge what we render, and our
offline validators must say the same.

* Every golden file and every shape ``render-job`` produces (PyTorchJob, TrainJob on a
  TrainingRuntime and on a ClusterTrainingRuntime, both runtimes; p5/p4d/cpu; 1, 2, 8, 16 nodes;
  plain, with secrets, with placement) is accepted by a server-side dry-run with strict field
  validation, and every TrainJob also by the controllers: created for real (suspended, so no
  pods), it gets its JobSet and Job, which the JobSet webhook and the Job API validated.
* Every row of :data:`cluster.truth_rows.ROWS` is refused by the server at its stage, and by our
  validators (``validate.py``, ``validate_trainjob.py``, ``validate_jobset.py``) too.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.kutil import (
    Verdict,
    delete_namespace,
    new_namespace,
    pytorchjob_outcome,
    submit,
    trainjob_outcome,
    wait_runtime_seen,
)
from harness.truth_rows import (
    EXPECT,
    NODES,
    OPTIONS,
    PROFILES,
    ROWS,
    Row,
    base_pytorchjob,
    base_runtime,
    base_trainjob,
    shape_spec,
)
from support.rendering import render_pytorchjob, render_trainjob

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.pytorchjob.validate import validate_job
from kfp_nvrx.components.launch.trainjob.runtime import (
    CLUSTER_RUNTIME_KIND,
    RUNTIME_NAME,
    build_runtime,
)
from kfp_nvrx.components.launch.trainjob.validate import (
    RUNTIME_CRDS,
    validate_schema,
    validate_trainjob,
)
from kfp_nvrx.components.launch.trainjob.validate_jobset import validate_runtime

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "unit" / "golden"
IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/kfp-nvrx-trainer:0.1.0"


def offline(obj: dict[str, Any], runtime: dict[str, Any] | None = None) -> Verdict:
    """Our validators' verdict on one object (a TrainJob is judged with its runtime)."""
    try:
        if obj["kind"] == "PyTorchJob":
            validate_job(obj)
        elif obj["kind"] == "TrainJob":
            validate_trainjob(obj, runtime)
        else:
            validate_schema(obj, RUNTIME_CRDS[obj["kind"]])
            validate_runtime(obj)
    except UserError as err:
        return Verdict(False, str(err))
    return Verdict(True)


@pytest.fixture(scope="module")
def truth(cluster):
    """A namespace with our TrainingRuntime, and our ClusterTrainingRuntime, created for real."""
    dyn = cluster.dynamic()
    ns = new_namespace(dyn, "server-truth")
    runtime = build_runtime(namespace=ns)
    assert submit(dyn, runtime, ns, dry_run=False).accepted
    ctr = build_runtime(kind=CLUSTER_RUNTIME_KIND)
    res = dyn.resources.get(api_version=ctr["apiVersion"], kind=CLUSTER_RUNTIME_KIND)
    made = submit(dyn, ctr, "", dry_run=False)
    if not made.accepted:  # one left by another test: ours only if the spec is the same
        assert res.get(name=RUNTIME_NAME).to_dict()["spec"] == ctr["spec"], made.message
    wait_runtime_seen(dyn, runtime, ns)
    wait_runtime_seen(dyn, ctr, ns)
    yield dyn, ns
    if made.accepted:
        res.delete(name=RUNTIME_NAME)
    delete_namespace(dyn, ns)


def _renamed(obj: dict[str, Any], name: str = "dry-run-only") -> dict[str, Any]:
    """``obj`` under a name nothing has (a dry-run create of an existing name is a 409)."""
    obj = copy.deepcopy(obj)
    obj["metadata"]["name"] = name
    return obj


def _suspended(job: dict[str, Any], ns: str) -> dict[str, Any]:
    job = copy.deepcopy(job)
    job["metadata"]["namespace"] = ns
    job["spec"]["suspend"] = True  # the controllers build JobSet and Job, no pods
    return job


# -- what we render is accepted -----------------------------------------------------------------

@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.yaml")), ids=lambda p: p.name)
def test_golden_files_are_accepted(kube, truth, path: Path) -> None:
    dyn, ns = truth
    job = yaml.safe_load(path.read_text())
    assert submit(dyn, job, ns) == Verdict(True)
    if job["kind"] == "TrainJob":
        assert submit(dyn, _suspended(job, ns), ns, dry_run=False).accepted
        assert trainjob_outcome(dyn, ns, job["metadata"]["name"]) == Verdict(True)


def test_shipped_runtime_is_accepted(kube, truth) -> None:
    dyn, ns = truth
    shipped = yaml.safe_load((REPO / "images/deploy/base/trainer-runtime.yaml").read_text())
    assert submit(dyn, _renamed(shipped), ns) == Verdict(True)
    assert submit(dyn, _renamed(build_runtime(kind=CLUSTER_RUNTIME_KIND)), "") == Verdict(True)


SHAPES = [(n, p, o) for n in NODES for p in PROFILES for o in OPTIONS]


@pytest.mark.parametrize("nodes,profile,option", SHAPES)
def test_every_pytorchjob_shape_is_accepted(kube, truth, nodes, profile, option) -> None:
    dyn, ns = truth
    for n in {str(nodes), f"1:{nodes}"}:  # fixed and elastic
        job = render_pytorchjob(shape_spec(n, profile, option, "pytorchjob")).to_dict()
        assert offline(job) == Verdict(True)
        assert submit(dyn, job, ns) == Verdict(True), n


@pytest.mark.parametrize("kind", ["TrainingRuntime", CLUSTER_RUNTIME_KIND])
@pytest.mark.parametrize("nodes,profile,option", SHAPES)
def test_every_trainjob_shape_is_built(kube, truth, nodes, profile, option, kind) -> None:
    dyn, ns = truth
    spec = shape_spec(nodes, profile, option, f"tj-{kind[0].lower()}")
    spec.namespace = ns
    rendered = render_trainjob(spec, RUNTIME_NAME, kind)
    assert submit(dyn, _renamed(rendered.runtime), ns) == Verdict(True)
    assert submit(dyn, rendered.job, ns) == Verdict(True)
    assert submit(dyn, _suspended(rendered.job, ns), ns, dry_run=False).accepted
    assert trainjob_outcome(dyn, ns, rendered.name) == Verdict(True)


def _cli(*args: str) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "render-job",
                          "--image", IMAGE, "--pvc", "fsx", "--nodes", "2", *args],
                         capture_output=True, text=True, timeout=300, check=True)
    return list(yaml.safe_load_all(out.stdout))


def test_render_job_cli_output_is_accepted(kube, truth) -> None:
    dyn, ns = truth
    (pj,) = _cli("--name", "cli-pj", "--namespace", ns)
    assert submit(dyn, pj, ns) == Verdict(True)
    for kind in ("TrainingRuntime", CLUSTER_RUNTIME_KIND):
        runtime, job = _cli("--job-api", "trainjob", "--with-runtime", "--runtime-kind", kind,
                            "--name", f"cli-{kind.lower()}", "--namespace", ns)
        assert submit(dyn, _renamed(runtime), ns) == Verdict(True)
        assert submit(dyn, job, ns) == Verdict(True)


# -- bad objects: the server refuses them, and so do we -----------------------------------------

def test_the_table_is_big_enough() -> None:
    assert len(ROWS) >= 30 and len({r.id for r in ROWS}) == len(ROWS)
    assert set(EXPECT) == {r.id for r in ROWS if not r.lenient}


def _server(dyn, ns: str, row: Row, obj: dict[str, Any], runtime: dict[str, Any]) -> Verdict:
    """The real cluster's verdict at the row's stage (admission, else what the controller did)."""
    if row.api == "runtime":
        return submit(dyn, runtime, ns)
    if row.runtime is not None:  # a runtime of its own: runtimes are immutable where it matters
        made = submit(dyn, runtime, ns, dry_run=False)
        assert made.accepted, f"{row.id}: the runtime of a controller row must be accepted: {made}"
        wait_runtime_seen(dyn, runtime, ns)
    first = submit(dyn, obj, ns)
    if row.stage == "admission":
        return first
    assert first.accepted, f"{row.id}: refused at admission, not by a controller: {first}"
    if obj["kind"] == "PyTorchJob":
        assert submit(dyn, obj, ns, dry_run=False).accepted
        return pytorchjob_outcome(dyn, ns, obj["metadata"]["name"])
    assert submit(dyn, _suspended(obj, ns), ns, dry_run=False).accepted
    return trainjob_outcome(dyn, ns, obj["metadata"]["name"])


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_bad_object_verdicts_agree(kube, truth, row: Row) -> None:
    dyn, ns = truth
    runtime = base_runtime()
    runtime["metadata"].update(name=f"rt-{row.id}"[:63], namespace=ns)
    obj = base_pytorchjob() if row.api == "pytorchjob" else base_trainjob()
    obj["metadata"].update(name=row.id, namespace=ns)
    if row.api == "pytorchjob" and row.stage == "controller":
        # Real pods (Pending, no nodes): one worker is enough to see the operator's verdict.
        obj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 1
        obj["spec"]["elasticPolicy"].update(minReplicas=1, maxReplicas=1)
    if row.runtime is not None:
        row.runtime(runtime)
        obj["spec"]["runtimeRef"]["name"] = runtime["metadata"]["name"]
    else:
        runtime["metadata"]["name"] = RUNTIME_NAME  # the one in the namespace
    if row.job is not None:
        row.job(obj)
    ours = offline(runtime if row.api == "runtime" else obj, runtime)
    server = _server(dyn, ns, row, obj, runtime)
    assert not ours.accepted, f"{row.id}: ours accepted what the server says is {server}"
    if row.lenient:
        assert server.accepted, f"{row.id}: the server now refuses it too ({server}); drop the " \
                                "lenient note"
    else:
        assert not server.accepted, f"{row.id}: the server accepted at {row.stage}; ours: {ours}"
        said = EXPECT[row.id] if isinstance(EXPECT[row.id], tuple) else (EXPECT[row.id],)
        assert any(s in server.message for s in said), \
            f"{row.id}: refused for another reason: {server}"
