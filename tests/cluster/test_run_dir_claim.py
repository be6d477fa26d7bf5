"""Issue 38 item 5 on the real controllers: one run dir has one writer at a time.

Two ``kfp-nvrx launch --backend kubernetes`` with other names, other job APIs (as two pipelines
would launch them) and one ``--run-dir``: the second job's pods find the run dir claimed by the
first job's pods (which renew the claim while they train), wait out one lease, and are refused
in one line naming the first job; the first trains to its end alone. The launcher here does not
see the volume at the pods' path, so the pods' claim is what is shown (the launcher's own check
where it sees the volume: tests/doubles/test_launcher_run_dir_claim.py).
"""

from __future__ import annotations

import json

import pytest

from cluster.test_train_e2e import Launch, _claim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUN_DIR = "runs/claimed-once"


@pytest.fixture(scope="module")
def dataset(cluster) -> str:
    from kfp_nvrx.components.data.prepare import prepare_dataset

    prepare_dataset("sample:400", _claim(cluster) / "data/claim-sample", seq_len=64)
    return "/fsx/data/claim-sample"


def test_a_second_job_with_a_run_dir_in_use_is_refused_naming_the_first(kube, dataset) -> None:
    shared = ["--run-dir", f"/fsx/{RUN_DIR}", "--env", "KFP_NVRX_CLAIM_LEASE_S=10"]
    # A long run keeps the first job training while the second one starts.
    first = Launch(kube, "claim-first", "trainjob", dataset,
                   extra=[*shared, "--set", "train.steps=400", "checkpoint.interval=40"])
    first.run_dir = _claim(kube) / RUN_DIR
    first.wait_committed(40)
    second = Launch(kube, "claim-second", "pytorchjob", dataset, extra=shared)
    rc, out = second.wait()
    assert rc == 1, out[-4000:]
    refusal = [line for line in out.splitlines() if "is in use by job" in line]
    assert refusal and f"in use by job {kube.namespace}/claim-first (pod claim-first-" \
        in refusal[-1], out[-4000:]
    assert "exited with code 2" in out, out[-4000:]
    rc, out = first.wait()
    assert rc == 0, out[-4000:]
    # Only the first job trained in the run dir: one session, every start and join its own.
    lines = [json.loads(x) for x in (first.run_dir / "events.jsonl").read_text().splitlines()]
    runs = {e.get("run_id") for e in lines if e["type"] in ("start", "join")}
    assert runs == {"claim-first"}, runs
    assert [e["type"] for e in lines].count("end") == 1
    assert not (first.run_dir / ".kfp-nvrx-writer.json").exists()  # released at its end
