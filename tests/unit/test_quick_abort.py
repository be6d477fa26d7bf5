"""The in-process restart's quick abort: torch forgets its groups so the next ones can be made.

The NCCL half (aborts on a thread while the next communicators start) runs in
``tests/gpu/test_quick_abort_cuda.py``; here, on gloo, the bookkeeping it relies on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kfp_nvrx.components.training.trainer import quick_abort


def _init(store: dist.Store, prefix: str) -> None:
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=0, world_size=1)


def test_forgotten_groups_make_room_for_the_next_incarnations_groups_named_the_same() -> None:
    store = dist.HashStore()
    _init(store, "0")
    try:
        first = dist.new_group([0])
        old = quick_abort.live_groups()
        assert len(old) == 2 and quick_abort.can_forget()
        quick_abort.forget_process_groups()
        assert not dist.is_initialized()
        _init(store, "1")  # raises "trying to initialize the default process group twice" if not
        second = dist.new_group([0])
        # Named as the first incarnation's were: functional collectives resolve groups by name.
        assert second.group_name == first.group_name
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
        for group in old:  # the forgotten groups are still whole, for the teardown to shut
            group.shutdown()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_without_nccl_it_leaves_the_abort_to_nvrx() -> None:
    _init(dist.HashStore(), "0")
    try:
        assert quick_abort.nccl_backends() == []
        assert quick_abort.abort_in_background(print) is False
        assert dist.is_initialized()  # untouched: NVRx's abort destroys the gloo groups
    finally:
        dist.destroy_process_group()


def test_nothing_to_do_without_a_process_group() -> None:
    assert not dist.is_initialized()
    assert quick_abort.abort_in_background(print) is False
