"""Offline half of the server-truth table: our validators refuse every bad row, without a cluster.

The rows (``tests/harness/truth_rows.py``) are the objects the real API server, webhooks and
controllers refuse (``tests/cluster/test_server_truth.py``, which needs ``make cluster-bins``);
this runs their offline verdicts everywhere, so a change to ``validate*.py`` that lets one through
fails here first.
"""

from __future__ import annotations

import copy

import pytest
from harness.truth_rows import ROWS, Row, base_pytorchjob, base_runtime, base_trainjob

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.pytorchjob.validate import validate_job
from kfp_nvrx.components.launch.trainjob.runtime import RUNTIME_NAME, build_runtime
from kfp_nvrx.components.launch.trainjob.validate import (
    RUNTIME_CRD,
    validate_schema,
    validate_trainjob,
)
from kfp_nvrx.components.launch.trainjob.validate_jobset import (
    RULE_NAME,
    validate_jobset_names,
    validate_runtime,
)


def _objects(row: Row) -> tuple[dict, dict]:
    runtime = base_runtime()
    obj = base_pytorchjob() if row.api == "pytorchjob" else base_trainjob()
    obj["metadata"]["name"] = row.id
    if row.runtime is not None:
        row.runtime(runtime)
        runtime["metadata"]["name"] = f"rt-{row.id}"
        obj["spec"]["runtimeRef"]["name"] = runtime["metadata"]["name"]
    if row.job is not None:
        row.job(obj)
    return obj, runtime


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_every_bad_row_is_refused_offline(row: Row) -> None:
    obj, runtime = _objects(row)
    with pytest.raises(UserError) as err:
        if row.api == "runtime":
            validate_schema(runtime, RUNTIME_CRD)
            validate_runtime(runtime)
        elif row.api == "pytorchjob":
            validate_job(obj)
        else:
            validate_trainjob(obj, runtime)
    assert "\n" not in str(err.value)


def test_the_good_objects_of_the_table_pass() -> None:
    validate_job(base_pytorchjob())
    validate_trainjob(base_trainjob(), base_runtime())
    validate_runtime(base_runtime())


def test_rule_names_are_what_the_jobset_webhook_allows() -> None:
    runtime = build_runtime()
    names = [r["name"] for r in runtime["spec"]["template"]["spec"]["failurePolicy"]["rules"]]
    assert names and all(RULE_NAME.match(n) for n in names), names
    assert "ft_launcher_gave_up" in names
    for bad in ("ft-launcher-gave-up", "1rule", "rule:", "x" * 129):
        broken = copy.deepcopy(runtime)
        broken["spec"]["template"]["spec"]["failurePolicy"]["rules"][0]["name"] = bad
        with pytest.raises(UserError, match="rule name"):
            validate_runtime(broken)


def test_jobset_pod_names_count_the_job_controller_suffix() -> None:
    validate_jobset_names("a" * 48, 10)  # a...-node-0-9-xxxxx: 63
    with pytest.raises(UserError, match="node-0-9-abcde"):
        validate_jobset_names("a" * 49, 10)


def test_built_runtimes_share_no_lists() -> None:
    one, two = build_runtime(), build_runtime(RUNTIME_NAME)
    rules = one["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "podFailurePolicy"]["rules"]
    next(r for r in rules if "onExitCodes" in r)["onExitCodes"]["values"].append(999)
    assert two == build_runtime() and one != two
