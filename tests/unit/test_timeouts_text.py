"""The learned rank-monitor timeouts are printed in words, not as NVRx reprs."""

from __future__ import annotations

import pytest

from kfp_nvrx.components.training.trainer.timeouts_text import describe_timeouts

data = pytest.importorskip("nvidia_resiliency_ext.fault_tolerance.data")


def test_heartbeats_and_sections_in_words() -> None:
    hb = data.HeartbeatTimeouts(initial=10.17, subsequent=5.0, were_calculated=True)
    sec = data.SectionTimeouts(section={"setup": 600.0, "step": 4.0, "checkpoint": None},
                               out_of_section=300.0, calculated_sections={"step"})
    text = describe_timeouts(hb, sec)
    assert text == ("hang detection after 5.0 s without a step (learned); the first step within "
                    "10.2 s; sections: setup 600.0 s, step 4.0 s (learned), checkpoint unbounded; "
                    "300.0 s outside them")
    assert "Timeouts(" not in text


def test_heartbeats_mode_and_no_monitor() -> None:
    hb = data.HeartbeatTimeouts(initial=None, subsequent=8.0, were_calculated=False)
    assert describe_timeouts(hb) == ("hang detection after 8.0 s without a step; no limit on the "
                                     "first step")
    assert describe_timeouts(None) == "no rank monitor"
