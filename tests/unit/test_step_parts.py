"""train.step_parts: where a step's time went, in its step event (trainer/step_parts.py)."""

from __future__ import annotations

import gc
import time

import torch

from kfp_nvrx.components.core import events as ev
from kfp_nvrx.components.core.events.read import parse_event
from kfp_nvrx.components.training.trainer.step_parts import StepParts


def test_off_it_records_nothing():
    parts = StepParts(False, torch.device("cpu"))
    parts.begin()
    parts.mark("data")
    parts.gpu_end()
    assert parts.take() is None


def test_on_the_marks_split_the_step_and_add_up_per_name():
    parts = StepParts(True, torch.device("cpu"))
    t0 = time.perf_counter()
    parts.begin()
    time.sleep(0.02)
    parts.mark("data")
    time.sleep(0.01)
    parts.mark("tick")
    time.sleep(0.01)
    parts.mark("data")  # a second stretch of one part adds to it
    got = parts.take()
    took = time.perf_counter() - t0
    assert got is not None and set(got) == {"data", "tick", "gc"}  # no GPU on a CPU device
    assert got["data"] >= 0.03 and got["tick"] >= 0.01
    # gc overlaps the marked parts (a collection runs inside whichever part allocates)
    assert sum(v for k, v in got.items() if k != "gc") <= took + 1e-6
    parts.begin()  # the next step starts empty
    assert parts.take() == {"gc": 0.0}


def test_the_collectors_runs_within_a_step_are_its_gc_part():
    parts = StepParts(True, torch.device("cpu"))
    gc.collect()  # between steps: belongs to no step
    parts.begin()
    t0 = time.perf_counter()
    gc.collect()  # a full collection of this test process's heap
    full = time.perf_counter() - t0
    parts.mark("data")
    got = parts.take()
    assert got is not None and 0 < got["gc"] <= full + 1e-6


def test_a_step_event_carries_its_parts_and_reads_back():
    step = ev.Step(step=3, start=1.0, end=2.0, parts={"data": 0.1, "sync": 0.5})
    line = step.to_dict()
    assert line["parts"] == {"data": 0.1, "sync": 0.5}
    back = parse_event(line)
    assert isinstance(back, ev.Step) and back.parts == {"data": 0.1, "sync": 0.5}
    assert "parts" not in ev.Step(step=3, start=1.0, end=2.0).to_dict()  # off: as before
