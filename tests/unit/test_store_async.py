"""Issue 39 item 2: the checkpoint store owns every write and read of the default async path.

A remote store (:mod:`support.bucket_store`: a fake object store reached through ``file://``
URLs, as S3 is through ``s3://``) is one module and a registry line; async saves through it stay
asynchronous (the write runs in NVRx's writer process while training goes on), land in the
bucket, not in the run dir's volume layout, and load back through DCP's fsspec reader.
CPU, gloo, world size 1, the tiny preset; the writer is NVRx's real persistent worker process.
"""

from __future__ import annotations

import time

import pytest
import torch
from support.bucket_store import BucketStore

from kfp_nvrx.components.core import store_kinds
from kfp_nvrx.components.core.ckpt_store import open_store
from kfp_nvrx.components.core.store_kinds import register_store
from kfp_nvrx.components.training.checkpoint import Checkpointer, dcp_io, durable
from unit.test_staging import _state, _tensors, _trainer, pg  # noqa: F401 (pg: a fixture)

#: Seconds the writer process sleeps before it writes: long enough to see the write in flight.
WRITE_DELAY_S = 3.0


@pytest.fixture()
def bucket(monkeypatch) -> None:
    """The fake registered with its one line (the registry restored after the test)."""
    monkeypatch.setattr(store_kinds, "_FACTORIES", dict(store_kinds._FACTORIES))
    register_store("bucket", BucketStore)
    delays = [WRITE_DELAY_S]
    monkeypatch.setattr(durable, "take_write_delay", lambda: delays.pop() if delays else 0.0)


def _wait_in_flight(ckpt: Checkpointer, deadline_s: float = 120.0) -> None:
    """Ticks (as the loop does once per step) until the durable write has started."""
    end = time.monotonic() + deadline_s
    while ckpt.writes.inflight is None:
        assert time.monotonic() < end, "the durable write never started"
        ckpt.tick()
        time.sleep(0.05)


@pytest.mark.parametrize("staging", ["blocking", "nvrx"])
def test_async_saves_to_a_remote_store_stay_async_and_load_back(tmp_path, pg, bucket,  # noqa: F811
                                                                 staging) -> None:
    cfg, model, opt, sched, train, step = _trainer(
        ["checkpoint.store=bucket", f"checkpoint.staging={staging}", "checkpoint.persist_duty=1"])
    run = tmp_path / "run"
    ckpt = Checkpointer(run, cfg.checkpoint, torch.device("cpu"))
    assert isinstance(ckpt.store, BucketStore)
    ckpt.warm_up()
    for _ in range(2):
        step()
    state = _state(model, opt, sched, train)
    want = _tensors(state)
    ckpt.save(train.step, state)
    if staging == "blocking":  # a snapshot into a bank; the loop's tick starts its write
        _wait_in_flight(ckpt)
    # The write is in the writer process (slowed by WRITE_DELAY_S): training goes on beside it.
    assert ckpt.writes.inflight is not None and ckpt.store.committed_steps() == []
    step()
    assert not ckpt.finalize(blocking=False)  # still in flight: nothing waited for it
    ckpt.close()

    store = open_store(run, "bucket")
    assert store.committed_steps() == [2] and store.problem(2) is None
    names = set(store.record(2)["files"])
    assert ".metadata" in names and any(n.startswith("__0_") for n in names), names
    assert not (run / "checkpoints").exists()  # only the volume store knows that layout
    assert not any((run / "spool").rglob("*.distcp"))  # uploaded, then dropped from the spool
    target = _state(*_trainer()[1:5])
    dcp_io.load(store, 2, target)  # DCP's fsspec reader, from the store's URL
    for key, value in _tensors(target).items():
        assert torch.equal(value, want[key]), key
    assert target["train"] == {"step": 2, "tokens": 0}
