"""Restarts counted by layer (issue 21.5): in-process, in-job and pod (a JobSet restart or a
recreated pod) from the events on the run's volume, in goodput, the KFP Metrics and the story."""

from __future__ import annotations

from kfp_nvrx.components.core.events import parse_events
from kfp_nvrx.components.core.goodput import summarize_events
from kfp_nvrx.components.launch.ui_outputs import metrics_from_summary


def test_the_layer_is_read_from_the_agent_and_the_wrapper() -> None:
    from kfp_nvrx.components.training.trainer.train import agent_identity, restart_kind

    me = agent_identity()  # this test's parent process stands in for the agent
    assert me and me == agent_identity() and me.count("/") == 3
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


def _pod(name: str, uid: str, index: str, attempt: str = "0"):
    from kubernetes import client as k8s

    labels = {"jobset.sigs.k8s.io/job-index": "0",  # one Job, one pod per node (its index)
              "jobset.sigs.k8s.io/restart-attempt": attempt,
              "batch.kubernetes.io/job-completion-index": index}
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name, uid=uid, labels=labels),
                     status=k8s.V1PodStatus(phase="Running"))


def test_a_jobset_restart_is_one_pod_restart_although_the_names_are_new() -> None:
    """Issue 30 item 3: the launcher's "pod restarts" counted pods by name, so a JobSet restart
    (every pod recreated under a new name) read 0. Issue 38 item 8: then it read 2 (one per
    replica) where goodput's rounds say one pod restart, and a launcher re-attached after it
    read 0: one pod delete, three numbers. The JobSet's own count (its pods' restart-attempt
    label) is the one number, for a launcher that saw the restart or came after it."""
    from kfp_nvrx.components.launch.kube.logs import PodLogFollower
    from kfp_nvrx.components.launch.trainjob.follow import job_pods

    follower = PodLogFollower(None, "ns", job_pods("tj"), emit=lambda _line: None)
    for i in (0, 1):
        follower._on_pod(_pod(f"tj-node-{i}-0-aaaa", f"uid-{i}", str(i)))
    assert follower.pod_restarts() == 0
    for i in (0, 1):  # the JobSet restart: new Jobs, new pod names, restart-attempt 1
        follower._on_pod(_pod(f"tj-node-{i}-0-bbbb", f"uid-{i}-a1", str(i), attempt="1"))
    assert follower.pod_restarts() == 1 and follower.pod_restarts_whole()
    reattached = PodLogFollower(None, "ns", job_pods("tj"), emit=lambda _line: None)
    for i in (0, 1):  # a launcher re-attached after the restart sees only the new pods
        reattached._on_pod(_pod(f"tj-node-{i}-0-bbbb", f"uid-{i}-a1", str(i), attempt="1"))
    assert reattached.pod_restarts() == 1
    follower.set_aside()  # Kueue preempted the job: its re-admission's pods are no restart
    for i in (0, 1):
        follower._on_pod(_pod(f"tj-node-{i}-0-cccc", f"uid-{i}-q1", str(i), attempt="1"))
    assert follower.pod_restarts() == 1


def test_a_recreated_pytorchjob_pod_is_one_pod_restart() -> None:
    """A PyTorchJob keeps no count of its own: each pod the operator recreated under its name
    is one restart (goodput's round with one new agent), known while the launcher follows."""
    from kubernetes import client as k8s

    from kfp_nvrx.components.launch.kube.logs import PodLogFollower
    from kfp_nvrx.components.launch.pytorchjob.follow import job_pods

    def pod(name: str, uid: str) -> k8s.V1Pod:
        labels = {"training.kubeflow.org/replica-type": "worker",
                  "training.kubeflow.org/replica-index": name[-1]}
        return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name, uid=uid, labels=labels),
                         status=k8s.V1PodStatus(phase="Running"))

    follower = PodLogFollower(None, "ns", job_pods("pj"), emit=lambda _line: None)
    for uid in ("a", "b"):
        follower._on_pod(pod("pj-worker-0", f"w0-{uid}"))
    follower._on_pod(pod("pj-worker-1", "w1-a"))
    assert follower.pod_restarts() == 1 and not follower.pod_restarts_whole()


def test_restarts_unknown_says_how_to_know_them() -> None:
    """The launcher on a workstation cannot read /fsx: say where the events are and how."""
    from kfp_nvrx.components.launch.result import LaunchResult

    result = LaunchResult(name="j", backend="kubernetes", state="Succeeded",
                          run_dir="/fsx/runs/j", extra={"pvc": "fsx-claim",
                                                        "run_dir_uri": "pvc://fsx-claim/runs/j"})
    text = result.restarts_text()  # a few words in the summary line; how, a line of its own
    assert text.startswith("unknown") and "fsx-claim" in text and len(text) < 60
    hint = result.restarts_hint()
    assert "fsx-claim" in hint and "at /fsx" in hint
    assert "kfp-nvrx goodput --run-dir /fsx/runs/j" in hint


def test_the_timeline_names_the_layer_goodput_counts() -> None:
    """A PyTorchJob whose worker-1 was recreated: rank 0 wrote "in-job"; every node's joins
    say pod, and the timeline, goodput and the Metrics say the same."""
    from kfp_nvrx.components.launch.ui_outputs import render_svg

    ev = _run(["in-job"])
    joins = [{"type": "join", "time": 99.0 + 0.1 * n, "agent": a, "node": n, "nodes": 2,
              "rank": n, "pid": 500 + n, "run_id": "j"} for n, a in enumerate(("b/1/1", "b/2/1"))]
    joins += [{"type": "join", "time": 106.0 + 0.1 * n, "agent": a, "node": n, "nodes": 2,
               "rank": n, "pid": 600 + n, "run_id": "j"} for n, a in enumerate(("b/1/1", "b/3/1"))]
    starts = [e for e in ev if e["type"] == "start"]
    for start, pid in zip(starts, (500, 600), strict=True):
        start.update(pid=pid, run_id="j", agent="b/1/1")  # rank 0 says so
    events = parse_events(ev + joins)
    rep = summarize_events(events)
    assert rep.restarts == {"pod": 1}, rep.restarts
    assert metrics_from_summary(rep.to_dict())["restarts_pod"] == 1
    svg = render_svg(events)
    assert "pod restart" in svg and "in-job restart" not in svg
