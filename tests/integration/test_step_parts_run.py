"""train.step_parts through a real run: ft_launcher agents, gloo, the tiny preset."""

from __future__ import annotations

import pytest
from support.local_runs import tiny_dataset, train

from kfp_nvrx.components.core import events as ev
from kfp_nvrx.components.core.events import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LOOP = {"data", "forward_backward", "optimizer", "sync", "tick", "monitor"}
#: Not a mark: the collector's seconds within the step, inside whichever part they fell.
GC = "gc"


def test_every_step_says_where_its_time_went(tmp_path):
    data = tiny_dataset(tmp_path / "data")
    run = tmp_path / "run"
    train(run, data, ["train.steps=6", "checkpoint.interval=2", "train.step_parts=true"],
          nodes="1", deadline_s=240)
    steps = [e for e in read_events(run) if isinstance(e, ev.Step)]
    assert [s.step for s in steps] == list(range(1, 7))
    for s in steps:
        assert s.parts is not None
        # Every second step saves (a snapshot, or one skipped while no bank is ready yet).
        want = LOOP | {GC} | ({"snapshot"} if s.step % 2 == 0 else set())
        assert set(s.parts) == want, (s.step, s.parts)
        # The marks split the step: together no longer than it, and most of it.
        marks = sum(v for k, v in s.parts.items() if k != GC)
        assert 0.5 * s.seconds <= marks <= s.seconds + 1e-3, (s.step, s.parts)
        assert 0 <= s.parts[GC] <= marks + 1e-3
    # The second step froze the heap: a full collection ran in it (in its sync mark: while the
    # GPU, had there been one, ran the step).
    assert steps[1].parts[GC] > 0
