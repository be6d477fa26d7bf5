"""Kueue v0.17.0 on the real control plane: its webhooks, our queue labels, and the launcher
following jobs it holds (issue 31 items 1-3).

The queue objects are this module's own (a ClusterQueue with CPU quota for one 2-node job, its
LocalQueue, two WorkloadPriorityClasses) and are deleted at its end; jobs without a queue label
(every other module's) are not Kueue's business. Waits are on what the launcher prints or what
the API says, never on sleeps, with one exception that is a lower bound the test enforces: a job
is held queued for at least :data:`HOLD_S` by keeping the job ahead of it alive.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch
from harness import kueue
from harness.kueue_launch import DATA, Launch, LaunchArgs, prepare_data
from harness.launch_real import wait_for
from kubernetes import client
from kubernetes.client.rest import ApiException
from support.rendering import render_pytorchjob, render_trainjob

from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.trainjob.runtime import GRACE_PERIOD_S, build_runtime

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CQ, LQ, LOW, HIGH = "kfp-nvrx-test-cq", "kfp-nvrx-test-lq", "kfp-nvrx-test-low", "kfp-nvrx-test-high"
#: Seconds a job is kept queued behind another (the deadline test's lower bound).
HOLD_S = 15.0
QUEUED = "queued: "


@pytest.fixture(scope="module")
def queue(cluster):
    """This module's ClusterQueue (2 CPUs: one job of 2 nodes x 1 CPU), LocalQueue, priorities."""
    from harness import install

    objs = kueue.queue_objects(cluster.namespace, CQ, LQ, cpu="2") + [
        kueue.priority_class(LOW, 100), kueue.priority_class(HIGH, 1000)]
    install.apply(_cp(cluster), objs)
    prepare_data(cluster)
    yield cluster
    custom = client.CustomObjectsApi(cluster.client())
    for obj in reversed(objs):
        meta, plural = obj["metadata"], obj["kind"].lower() + "s"
        try:
            if "namespace" in meta:
                custom.delete_namespaced_custom_object(kueue.GROUP, "v1beta2", meta["namespace"],
                                                       plural, meta["name"])
            elif obj["kind"] != "ResourceFlavor":  # shared by every test queue: left in place
                custom.delete_cluster_custom_object(kueue.GROUP, "v1beta2", plural, meta["name"])
        except ApiException as err:
            if err.status != 404:
                raise


@pytest.fixture()
def launch(queue):
    """``launch(name, job_api, **kw)``: a :class:`Launch`; every one still running at the end of
    the test is stopped (SIGTERM: it deletes its job), so nothing outlives a failed test."""
    started: list[Launch] = []

    def start(name: str, job_api: str, **kw) -> Launch:
        started.append(Launch(queue, LaunchArgs(name, job_api, **kw)))
        return started[-1]

    yield start
    for job in started:
        job.stop()


def _cp(cluster):
    """What :func:`cluster.install.apply` needs of a control plane: its kubeconfig."""
    return type("CP", (), {"kubeconfig": cluster.kubeconfig})()


def _spec(name: str, **kw) -> JobSpec:
    return JobSpec(image="img:1", pvc="kfp-nvrx-shared", instance_type="cpu", nodes="2",
                   name=name, cpu="1", memory="1Gi", overrides=[f"data.path=/fsx/{DATA}"], **kw)


def _dry_run(kube, body: dict) -> dict:
    """Create ``body`` with dryRun=All: every admission webhook runs, nothing is stored."""
    group, version = body["apiVersion"].split("/")
    plural = {"TrainJob": "trainjobs", "PyTorchJob": "pytorchjobs"}[body["kind"]]
    return client.CustomObjectsApi(kube.client()).create_namespaced_custom_object(
        group, version, kube.namespace, plural, body, dry_run="All")


def _rendered(kind: str, spec: JobSpec) -> dict:
    if kind == "TrainJob":
        return render_trainjob(spec).to_dict()
    return client.ApiClient().sanitize_for_serialization(render_pytorchjob(spec).job)


@pytest.mark.parametrize("kind", ["TrainJob", "PyTorchJob"])
def test_rendered_queue_labels_are_what_kueues_webhooks_read(queue, kind: str) -> None:
    """Our labels pass the real webhooks, and Kueue's defaulting suspends the job it will queue;
    a job without them is left running, and a queue name Kueue cannot read is refused."""
    queued = _dry_run(queue, _rendered(kind, _spec("kq-dry", queue_name=LQ,
                                                    priority_class=HIGH)))
    labels = queued["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == LQ
    assert labels["kueue.x-k8s.io/priority-class"] == HIGH
    suspended = (queued["spec"].get("suspend") if kind == "TrainJob"
                 else queued["spec"]["runPolicy"].get("suspend"))
    assert suspended is True
    plain = _dry_run(queue, _rendered(kind, _spec("kq-plain")))
    assert not (plain["spec"].get("suspend") if kind == "TrainJob"
                else plain["spec"]["runPolicy"].get("suspend"))
    bad = _rendered(kind, _spec("kq-bad", queue_name=LQ))
    bad["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "Not_A_Name"
    with pytest.raises(ApiException) as err:
        _dry_run(queue, bad)
    body = err.value.body if isinstance(err.value.body, str) else err.value.body.decode()
    assert f"v{kind.lower()}.kb.io" in body and "kueue.x-k8s.io/queue-name" in body


def test_a_plain_jobset_is_queued_and_admitted(queue) -> None:
    """Kueue's JobSet integration (JobSet v0.11 types) on JobSet v0.12.0: suspended by its
    webhook, admitted into the ClusterQueue, run to completion by the JobSet controller."""
    body = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "kq-jobset", "labels": {"kueue.x-k8s.io/queue-name": LQ}},
            "spec": {"replicatedJobs": [{"name": "one", "replicas": 1, "template": {"spec": {
                "parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": {
                    "restartPolicy": "Never", "containers": [{
                        "name": "main", "image": "ignored", "command": ["/bin/sh", "-c", "true"],
                        "resources": {"requests": {"cpu": "1", "memory": "64Mi"}}}]}}}}}]}}
    custom = client.CustomObjectsApi(queue.client())
    group = ("jobset.x-k8s.io", "v1alpha2", queue.namespace, "jobsets")
    made = custom.create_namespaced_custom_object(*group, body)
    try:
        assert made["spec"]["suspend"] is True  # Kueue's webhook: held until admitted
        wait_for("the JobSet to complete", lambda: any(
            c["type"] == "Completed" and c["status"] == "True" for c in (
                custom.get_namespaced_custom_object(*group, "kq-jobset").get("status") or {}
            ).get("conditions") or []))
        workloads = custom.list_namespaced_custom_object(
            kueue.GROUP, "v1beta2", queue.namespace, "workloads",
            label_selector=f"kueue.x-k8s.io/job-uid={made['metadata']['uid']}")["items"]
        assert [w["status"]["admission"]["clusterQueue"] for w in workloads] == [CQ]
    finally:
        custom.delete_namespaced_custom_object(*group, "kq-jobset",
                                               propagation_policy="Background")


def test_kueue_v017_drops_a_trainjobs_own_grace_period(queue) -> None:
    """Why a queued TrainJob carries no grace period of its own (jobspec.trainjob): Kueue, built
    with Trainer v2.2 types, admits it and writes it back without that v2.3 field. Its pods never
    get it: the JobSet is made without it, or, made before the admission, the JobSet webhook
    refuses the Trainer's change of the suspended JobSet ("field is immutable") and it never runs.
    """
    body = render_trainjob(_spec("kq-grace", queue_name=LQ)).to_dict()
    pod = body["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert "terminationGracePeriodSeconds" not in pod  # what the renderer does, and why:
    pod["terminationGracePeriodSeconds"] = 77
    custom, core = client.CustomObjectsApi(queue.client()), client.CoreV1Api(queue.client())
    group = ("trainer.kubeflow.org", "v1alpha1", queue.namespace, "trainjobs")
    custom.create_namespaced_custom_object(*group, body)
    try:
        job = wait_for("Kueue admitting the TrainJob", lambda: (
            lambda j: j if j["spec"].get("suspend") is False else None)(
            custom.get_namespaced_custom_object(*group, "kq-grace")))
        kept = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
            "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        assert "terminationGracePeriodSeconds" not in kept

        def outcome() -> str:
            events = core.list_namespaced_event(
                queue.namespace, field_selector="involvedObject.name=kq-grace,"
                "reason=TrainJobResourcesCreationFailed").items
            # The message ends "... field is immutable", cut off by the Event's 1 KiB limit.
            if any('"vjobset.kb.io" denied the request' in (e.message or "") for e in events):
                return "refused"
            try:
                jobset = custom.get_namespaced_custom_object(
                    "jobset.x-k8s.io", "v1alpha2", queue.namespace, "jobsets", "kq-grace")
            except ApiException:
                return ""
            spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
            return "" if jobset["spec"].get("suspend") else str(
                spec.get("terminationGracePeriodSeconds"))

        seen = wait_for("the JobSet without the TrainJob's grace period, or refused", outcome)
        assert seen == "refused" or seen == str(GRACE_PERIOD_S), seen
    finally:
        custom.delete_namespaced_custom_object(*group, "kq-grace",
                                               propagation_policy="Background")


def test_two_jobs_for_one_quota_wait_and_run(queue, launch) -> None:
    """A TrainJob runs; a TrainJob and a PyTorchJob queue behind it, each says so once and why;
    neither's deadline runs while it waits; once the first is gone both run in turn."""
    first = launch("kq-first", "trainjob", steps=100000, queue=LQ)
    first.wait_line("TrainJob kq-first: Running")
    after = launch("kq-after", "trainjob", steps=30, queue=LQ)
    # A deadline shorter than the wait: it counts only the time the job is not held.
    capped = launch("kq-capped", "pytorchjob", steps=100000, queue=LQ,
                    extra=("--deadline", "10"))
    for job in (after, capped):
        job.wait_line(QUEUED)
    held_since = time.time()
    wait_for(f"{HOLD_S:g} s queued", lambda: time.time() - held_since >= HOLD_S,
             timeout_s=HOLD_S + 30)
    assert capped.proc.poll() is None, capped.text()  # queued longer than its deadline: alive
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait() == 128 + signal.SIGTERM
    assert after.wait() == 0, after.text()
    assert capped.wait() == 1, capped.text()
    for job, api in ((after, "TrainJob"), (capped, "PyTorchJob")):
        lines = job.lines()
        said = [line for line in lines if line.startswith(QUEUED)]
        assert len(said) == 1, said
        assert f"{api} {queue.namespace}/{job.name} waits in LocalQueue {LQ} (ClusterQueue " \
               f"{CQ}): " in said[0] and "insufficient unused quota for cpu" in said[0]
        assert any(line.startswith(f"admitted by ClusterQueue {CQ} after ") for line in lines)
        result = job.result()
        assert result["queued_s"] >= HOLD_S - 1, result["queued_s"]
        assert result["extra"]["queue"]["cluster_queue"] == CQ
        assert result["preemptions"] == 0
    assert after.result()["state"] == "Succeeded"
    capped_result = capped.result()
    assert capped_result["state"] == "DeadlineExceeded"
    assert "not counting" in capped_result["reason"], capped_result["reason"]
    assert first.result()["state"] == "Cancelled" and first.result()["queued_s"] < HOLD_S


def test_a_preempted_job_is_followed_until_it_runs_again(queue, launch) -> None:
    """A higher-priority job preempts ours: the launcher says so, follows it while it waits,
    says when it is admitted again and where the trainer resumed; pods of the new admission
    are no pod restarts. (What is saved and lost on preemption: the trainer's side, item 4.)"""
    low = launch("kq-low", "trainjob", steps=100000, queue=LQ, priority=LOW)
    low.wait_line("progress: step ")
    high = launch("kq-high", "trainjob", steps=30, queue=LQ, priority=HIGH)
    low.wait_line("preempted at step ")
    assert high.wait() == 0, high.text()
    low.wait_line(f"re-admitted by ClusterQueue {CQ} after ")
    low.wait_line(", resumed from step ")
    low.proc.send_signal(signal.SIGTERM)
    low.wait()
    lines = low.lines()
    preempted = next(line for line in lines if line.startswith("preempted at step "))
    assert "(Preempted: " in preempted and f"queued again in LocalQueue {LQ}" in preempted
    result = low.result()
    assert result["preemptions"] == 1 and result["queued_s"] > 0
    waits = result["extra"]["queue"]["waits"]
    assert [w["after"] for w in waits] == ["creation", "preemption"]
    assert result["pod_restarts"] == 0
    assert any(line.startswith(f"admitted by ClusterQueue {CQ} after ") for line in high.lines())
    assert high.result()["preemptions"] == 0


def test_a_namespaces_default_queue_holds_a_job_that_names_none(queue, launch) -> None:
    """Kueue queues every job of a namespace with a LocalQueue named ``default``: the launcher
    says so, renders the job as queued (a TrainJob without its own grace period) and follows it."""
    from harness import install

    ns = "kq-default-queue"
    objs = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
            {"apiVersion": kueue.API, "kind": "LocalQueue",
             "metadata": {"name": "default", "namespace": ns}, "spec": {"clusterQueue": CQ}},
            build_runtime(namespace=ns)]
    install.apply(_cp(queue), objs)
    custom = client.CustomObjectsApi(queue.client())
    try:
        job = launch("kq-defaulted", "trainjob", steps=30, namespace=ns)
        job.wait_line("namespace kq-default-queue has Kueue's default LocalQueue 'default'")
        job.wait_line(f"admitted by ClusterQueue {CQ} after ")
        made = custom.get_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", ns,
                                                   "trainjobs", "kq-defaulted")
        assert made["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "default"
        ours = made["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
            "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        assert "terminationGracePeriodSeconds" not in ours
        job.stop()
        assert job.result()["extra"]["queue"]["local_queue"] == "default"
    finally:
        custom.delete_namespaced_custom_object(kueue.GROUP, "v1beta2", ns, "localqueues",
                                               "default")
        client.CoreV1Api(queue.client()).delete_namespace(ns)


@pytest.mark.parametrize("flag,value,field", [
    ("--queue-name", "kq-no-such-queue", "--queue-name"),
    ("--priority-class", "kq-no-such-class", "--priority-class"),
])
def test_a_missing_queue_or_priority_class_is_bad_input(queue, launch, flag, value, field) -> None:
    extra = ("--queue-name", LQ) if flag == "--priority-class" else ()
    job = launch("kq-missing", "trainjob", steps=30, extra=(*extra, flag, value))
    assert job.wait() == 2, job.text()
    err = job.stderr().strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kfp-nvrx launch: error: {field}: ") \
        and value in err[0], err
    jobs = client.CustomObjectsApi(queue.client()).list_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", queue.namespace, "trainjobs")["items"]
    assert "kq-missing" not in [j["metadata"]["name"] for j in jobs]


def _run_dir(kube, name: str):
    return kube.root / "volumes" / kube.namespace / "kfp-nvrx-shared" / "runs" / name


#: The preemption runs: half-second steps, so that the preemption lands mid-run on any machine,
#: and no save but the final one.
SAVE_STEPS = 40
SLOW = ("--set", "checkpoint.interval=1000", "--set", "train.step_sleep=0.5")


@pytest.fixture(scope="module")
def never_preempted(queue) -> dict:
    """The weights a run of the preemption tests' settings ends with when nothing stops it.

    One TrainJob that no queue holds, for both job APIs (the same trainer, world and data: CPU
    training is deterministic). It runs alone, before the queued jobs: the test cluster's pods
    share one network namespace, so a second job's rendezvous store would take the port of the
    first job's (on EKS every pod has its own).
    """
    from kfp_nvrx.components.core.rundir import step_dir
    from kfp_nvrx.components.training.export.consolidate import load_model_state

    ref = Launch(queue, LaunchArgs("kq-never-preempted", "trainjob", steps=SAVE_STEPS, extra=SLOW))
    try:
        assert ref.wait() == 0, ref.text()[-3000:]
    finally:
        ref.stop()
    return load_model_state(step_dir(_run_dir(queue, "kq-never-preempted") / "checkpoints",
                                     SAVE_STEPS))


@pytest.mark.parametrize("job_api", ["trainjob", "pytorchjob"])
def test_a_preempted_job_saves_on_sigterm_and_resumes_there_bitwise(queue, launch, job_api,
                                                                    never_preempted) -> None:
    """Issue 31 item 4: the preempted pods get SIGTERM; every rank saves the step it trained
    (no periodic save falls in the run: checkpoint.interval is past its end) and the re-admitted
    job resumes from that step, not from the start, and ends with the weights of a run that was
    never preempted (CPU: deterministic). Kueue v0.17 preempts both job APIs."""
    from kfp_nvrx.components.core import events as ev
    from kfp_nvrx.components.core.events import read_events
    from kfp_nvrx.components.core.rundir import committed_steps, step_dir
    from kfp_nvrx.components.training.export.consolidate import load_model_state

    steps, name = SAVE_STEPS, f"kq-save-{job_api}"
    low = launch(name, job_api, steps=steps, queue=LQ, priority=LOW, extra=SLOW)
    low.wait_line("progress: step ")
    high = launch(f"{name}-high", "trainjob", steps=10, queue=LQ, priority=HIGH)
    low.wait_line("preempted at step ")
    assert high.wait() == 0, high.text()[-3000:]
    assert low.wait() == 0, low.text()[-3000:]
    run = _run_dir(queue, name)
    events = read_events(run)
    [stop] = [e for e in events if isinstance(e, ev.End) and e.status == ev.STOPPED]
    starts = [e for e in events if isinstance(e, ev.Start)]
    assert 0 < stop.step < steps and starts[-1].resumed_from == stop.step
    assert any(isinstance(e, ev.Checkpoint) and e.step == stop.step for e in events)
    resumed = next(line for line in low.lines() if ", resumed from step " in line)
    assert f"resumed from step {stop.step} " in resumed, resumed
    first = next(line for line in low.lines() if line.startswith("preempted at step "))
    assert first.startswith(f"preempted at step {stop.step} ("), first  # issue 38 item 8
    _goodput_agrees_with_the_launcher(low, run)
    got = load_model_state(step_dir(run / "checkpoints", steps))
    want = never_preempted
    assert committed_steps(run / "checkpoints")[0] == steps and got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key} differs from the run never preempted"


def _goodput_agrees_with_the_launcher(low: Launch, run) -> None:
    """Issue 38 item 6: the launcher (it does not mount the volume here) sends the user to
    ``kfp-nvrx goodput`` for the restart counts; run as it says, goodput agrees with it: a
    preemption, no pod restart, the preemption's wait queued, no recovery."""
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    result = low.result()
    hint = next(line for line in low.lines() if line.startswith("restart counts: "))
    argv = shlex.split(hint.split("`")[1])
    assert argv[:4] == ["kfp-nvrx", "goodput", "--run-dir", result["run_dir"]], hint
    assert argv[4] == "--queued", hint  # the waits only this launcher saw
    argv[0], argv[3] = str(Path(sys.executable).parent / "kfp-nvrx"), str(run)  # this machine's
    out = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert result["preemptions"] == report["preemptions"] == 1, report
    assert result["pod_restarts"] == report["restarts"].get("pod", 0) == 0, report
    assert report["restarts"] == {} and report["recovery_s"] == [], report
    wait = result["extra"]["queue"]["waits"][1]
    assert abs(report["queued_s"] - wait["seconds"]) < 1.0, (report["queued_s"], wait)


def test_a_preemption_inside_a_durable_write_still_saves_its_step_bitwise(queue, launch,
                                                                           never_preempted) -> None:
    """Issue 35 item 4 on the real control plane: the preemption's SIGTERM lands while a durable
    write is in flight (slowed 120 s on purpose: the stop cannot miss it), which reaches NVRx's
    writer process and its results queue too. Every rank drops that write together, the stop
    still saves its step, and the re-admitted job resumes there with the weights of a run that
    was never preempted."""
    from kfp_nvrx.components.core import events as ev
    from kfp_nvrx.components.core.events import read_events
    from kfp_nvrx.components.core.rundir import committed_steps, step_dir
    from kfp_nvrx.components.core.volume_store import VolumeStore
    from kfp_nvrx.components.training.export.consolidate import load_model_state

    steps, name = SAVE_STEPS, "kq-save-in-write"
    extra = ("--set", "checkpoint.interval=4", "--set", "train.step_sleep=0.5",
             "--fault", "slow-write@1:seconds=120")
    low = launch(name, "trainjob", steps=steps, queue=LQ, priority=LOW, extra=extra)
    run = _run_dir(queue, name)
    deadline = time.monotonic() + 120
    while not any(s not in VolumeStore(run).committed_steps() for s in VolumeStore(run).entries()):
        assert time.monotonic() < deadline, "no durable write began"
        time.sleep(0.2)
    high = launch(f"{name}-high", "trainjob", steps=10, queue=LQ, priority=HIGH)
    low.wait_line("preempted at step ")
    assert high.wait() == 0, high.text()[-3000:]
    assert low.wait() == 0, low.text()[-3000:]
    events = read_events(run)
    [stop] = [e for e in events if isinstance(e, ev.End) and e.status == ev.STOPPED]
    starts = [e for e in events if isinstance(e, ev.Start)]
    assert 0 < stop.step < steps and starts[-1].resumed_from == stop.step
    assert any(isinstance(e, ev.Checkpoint) and e.step == stop.step for e in events)
    got = load_model_state(step_dir(run / "checkpoints", steps))
    assert committed_steps(run / "checkpoints")[0] == steps and got.keys() == never_preempted.keys()
    for key, value in never_preempted.items():
        assert torch.equal(got[key], value), f"{key} differs from the run never preempted"
