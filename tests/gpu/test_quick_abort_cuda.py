"""The quick abort on NCCL (issue 37 item 3): the teardown leaves the in-process restart's path.

``ncclCommAbort`` joins the communicator's proxy threads, each of which notices the abort only
after its 500 ms poll; the quick abort runs it on a thread while the next incarnation's
communicators are made. Here: the abort returns at once, the next group works beside the
teardown, and a real in-process restart on CUDA goes through it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.local_runs import run_local, tiny_dataset

from kfp_nvrx.components.core import events as ev
from kfp_nvrx.components.core.events import read_events
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.local.run import free_port
from kfp_nvrx.components.training.trainer import quick_abort

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")


def _init(store: dist.Store, prefix: str) -> None:
    dist.init_process_group("nccl", store=dist.PrefixStore(prefix, store), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))


def _sum_of_ones() -> float:
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    return float(t.sum().item())


def test_the_nccl_abort_returns_at_once_and_the_next_group_works_beside_its_teardown() -> None:
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    lines: list[str] = []
    _init(store, "0")
    try:
        assert _sum_of_ones() == 4.0
        assert len(quick_abort.nccl_backends()) == 1
        t0 = time.perf_counter()
        assert quick_abort.abort_in_background(lines.append)
        returned = time.perf_counter() - t0
        assert not dist.is_initialized()
        _init(store, "1")
        assert _sum_of_ones() == 4.0
        deadline = time.monotonic() + 30
        while not any("torn down" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        [done] = [line for line in lines if "torn down" in line]
        teardown = float(done.split("torn down in ")[1].split("s")[0])
        print(f"abort returned in {returned:.3f}s; the teardown beside it took {teardown:.3f}s")
        assert returned < 0.2 and returned < teardown, (returned, lines)
        assert not [line for line in lines if "shutdown after its abort" in line], lines
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_an_in_process_restart_on_cuda_goes_through_the_quick_abort(tmp_path: Path) -> None:
    lines: list[str] = []
    data = tiny_dataset(tmp_path / "data")
    spec = JobSpec(nodes="1", run_dir=str(tmp_path / "run"), config="tiny", faults=["raise@6"],
                   overrides=[f"data.path={data}", "train.steps=12", "checkpoint.interval=4",
                              "train.device=cuda", "resilience.in_process=true",
                              "resilience.quick_abort=true",
                              # with NCCL the collectives' timeout must outlast the hard timeout
                              "resilience.pg_timeout=30"])
    res = run_local(spec, log=lines.append, deadline_s=300)
    assert res.state == "Succeeded", (res.reason, res.last_log_lines)
    restarts = [e for e in read_events(tmp_path / "run") if isinstance(e, ev.Restart)]
    assert [r.kind for r in restarts] == ["in-process"]
    text = "\n".join(lines)
    assert "old NCCL communicators were torn down" in text, text[-3000:]
    [split] = [line for line in lines if "in-process restart 1: exit->decision" in line]
    print(split)
