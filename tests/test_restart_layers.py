"""Restarts counted by layer (issue 21.5): in-process, in-job and pod (a JobSet restart or a
recreated pod) from the events on the run's volume, in goodput, the KFP Metrics and the story."""

from __future__ import annotations

from kfp_nvrx.components.core.events import parse_events
from kfp_nvrx.components.core.goodput import summarize_events
from kfp_nvrx.components.launch.ui_outputs import metrics_from_summary


def test_the_layer_is_read_from_the_agent_and_the_wrapper() -> None:
    from kfp_nvrx.components.training.trainer.train import agent_identity, restart_kind

    me = agent_identity()  # this test's parent process stands in for the agent
    assert me and me == agent_identity() and me.count("/") == 2
    assert restart_kind(iteration=2, previous_agent=me, agent=me) == "in-process"
    assert restart_kind(iteration=0, previous_agent=me, agent=me) == "in-job"
    # Another agent on a run that ran before: the pods were recreated.
    assert restart_kind(iteration=0, previous_agent="b/12/999", agent=me) == "pod"
    assert restart_kind(iteration=0, previous_agent=None, agent=me) == "in-job"  # older events


def _run(layers: list[str]) -> list[dict]:
    """Six steps per incarnation; each restart resumes from step 3 of the one before."""
    ev: list[dict] = [{"type": "start", "time": 100.0, "incarnation": 0, "iteration": 0,
                       "world_size": 2, "resumed_from": None, "load_s": 0.1}]
    t, first = 101.0, 1
    for inc, layer in enumerate([None, *layers]):
        if layer is not None:
            t += 5  # the pods are recreated / the workers restarted
            ev.append({"type": "restart", "time": t + 1, "kind": layer, "incarnation": inc,
                       "iteration": 1 if layer == "in-process" else 0})
            ev.append({"type": "start", "time": t, "incarnation": inc,
                       "iteration": 1 if layer == "in-process" else 0, "world_size": 2,
                       "resumed_from": 3, "load_s": 0.2, "layer": layer})
            t += 2
            first = 4
        for s in range(first, first + 6):
            ev.append({"type": "step", "time": t + 1, "step": s, "start": t, "end": t + 1,
                       "incarnation": inc, "iteration": 1 if layer == "in-process" else 0,
                       "loss": 5.0, "tokens": 10})
            t += 1
    return ev


def test_goodput_and_metrics_count_each_layer() -> None:
    rep = summarize_events(parse_events(_run(["in-job", "pod", "in-process"])))
    assert rep.restarts == {"in-job": 1, "pod": 1, "in-process": 1}
    assert len(rep.recovery_s) == 3  # a JobSet restart is a recovery like any other
    assert any(s.startswith("pods recreated after step 9, resumed from step 3")
               for s in rep.what_happened), rep.what_happened
    m = metrics_from_summary(rep.to_dict())
    assert (m["restarts_total"], m["restarts_in_job"], m["restarts_pod"],
            m["restarts_in_process"]) == (3, 1, 1, 1)


def test_metrics_name_the_pod_layer_even_without_one() -> None:
    m = metrics_from_summary(summarize_events(parse_events(_run(["in-job"]))).to_dict())
    assert (m["restarts_pod"], m["restarts_in_job"]) == (0, 1)
