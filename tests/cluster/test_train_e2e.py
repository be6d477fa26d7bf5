"""Training end to end through the real controllers (issue 21.2-21.4), on the agent's test nodes.

``kfp-nvrx launch --backend kubernetes`` runs the ``tiny`` preset on 2 nodes x 1 process (cpu
profile, gloo) as a TrainJob (Trainer -> JobSet -> Jobs -> Pods) and as a PyTorchJob (Training
Operator); faults are injected layer by layer, and every run must end with the final weights of
the fault-free TrainJob, bitwise (the CPU path is deterministic). Waits are on conditions (a
committed checkpoint, a pod phase) with generous bounds, never on sleeps.

What each fault must do (the table in docs/eks.md):

* ``--fault kill@STEP/RANK``: ft_launcher restarts the workers inside the pods; no pod is
  recreated; the run resumes from the newest committed checkpoint.
* a pod's process group SIGKILLed from outside (exit 137, as an OOM kill or a lost machine looks)
  or a pod evicted, the rendezvous host (node 0) too: the Job fails with
  ``BackoffLimitExceeded``, the JobSet failure policy recreates every pod (``restart-attempt``
  1), the run resumes from the newest checkpoint. PyTorchJob: the operator recreates the pod
  (``restartPolicy: ExitCode``).
* ft_launcher gives up (more faults than ``resilience.max_restarts``): the Job fails by its
  ``podFailurePolicy``, the JobSet fails at once (no restart), the launcher says why in one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 24
BASE = [f"train.steps={STEPS}", "checkpoint.interval=6", "checkpoint.keep=5"]
DATA = "data/e2e-sample"
RUN_S = 600.0  # one launch on a loaded 2-core machine: generous, never the expected time
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
PYTORCHJOB_LABEL = "training.kubeflow.org/job-name"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# A pod lost to a fault resumes from the store: slower steps let the durable tier commit before
# the fault (its writer process takes seconds to come up on a loaded machine), and a write of
# every snapshot the writer is free for. Neither changes the weights.
PACED = ["train.step_sleep=0.5", "checkpoint.persist_duty=1"]


def _core(kube):
    from kubernetes import client

    return client.CoreV1Api(kube.client())


def _claim(kube) -> Path:
    return kube.root / "volumes" / kube.namespace / "kfp-nvrx-shared"


@pytest.fixture(scope="module")
def dataset(cluster) -> str:
    from kfp_nvrx.components.data.prepare import prepare_dataset

    prepare_dataset("sample:400", _claim(cluster) / DATA, seq_len=64)
    return f"/fsx/{DATA}"


class Launch:
    """One ``kfp-nvrx launch`` process and what it printed (to a file: the pipe never fills)."""

    def __init__(self, kube, name: str, job_api: str, dataset: str, faults=(), extra=()) -> None:
        self.kube, self.name = kube, name
        self.out = kube.root / f"launch-{name}.log"
        argv = [str(Path(sys.executable).parent / "kfp-nvrx"), "launch", "--backend",
                "kubernetes", "--job-api", job_api, "--name", name, "--namespace",
                kube.namespace, "--nodes", "2", "--instance-type", "cpu", "--nproc-per-node", "1",
                "--image", "kfp-nvrx-trainer:test", "--pvc", "kfp-nvrx-shared", "--config",
                "tiny", "--delete-after", "never", "--deadline", str(int(RUN_S)),
                "--set", f"data.path={dataset}", *BASE, *extra]
        if faults:
            argv += ["--fault", *faults]
        env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig)}
        with open(self.out, "wb") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL)
        self.run_dir = _claim(kube) / "runs" / name

    def wait(self) -> tuple[int, str]:
        try:
            rc = self.proc.wait(RUN_S + 60)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # the launcher deletes its job on SIGTERM
            self.proc.wait(120)
            raise AssertionError(f"launch {self.name} did not end:\n{self.text()[-3000:]}") from None
        return rc, self.text()

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def committed(self) -> list[int]:
        from kfp_nvrx.components.core.rundir import committed_steps

        root = self.run_dir / "checkpoints"
        return committed_steps(root) if root.is_dir() else []

    def wait_snapshot(self, step: int) -> int:
        """Wait until a snapshot at or past ``step`` was taken and a commit exists; return the
        newest commit then.

        The durable writes run at their own pace behind the snapshots (the first waits for the
        writer process to come up: seconds on a loaded machine), so a commit of a given step is
        not to be waited for; some commit is, since a pod that loses its host copy resumes from
        the store, and a test of that resume needs something there.
        """
        from kfp_nvrx.components.core import events as ev
        from kfp_nvrx.components.core.events import read_events

        deadline = time.monotonic() + RUN_S
        while time.monotonic() < deadline:
            if (self.run_dir / "events.jsonl").is_file() and self.committed() and any(
                    isinstance(e, ev.Snapshot) and not e.skipped and e.step >= step
                    for e in read_events(self.run_dir)):
                return self.committed()[0]
            assert self.proc.poll() is None, f"launch ended early:\n{self.text()[-3000:]}"
            time.sleep(0.5)
        raise AssertionError(f"no snapshot at step {step}:\n{self.text()[-3000:]}")

    def wait_replica(self, step: int) -> int:
        """Wait until every rank's snapshot at or past ``step`` is held by a peer; return its step."""
        from kfp_nvrx.components.core import events as ev
        from kfp_nvrx.components.core.events import read_events

        deadline = time.monotonic() + RUN_S
        while time.monotonic() < deadline:
            if (self.run_dir / "events.jsonl").is_file():
                held = [e.step for e in read_events(self.run_dir)
                        if isinstance(e, ev.Replica) and e.ok and e.step >= step]
                if held:
                    return max(held)
            assert self.proc.poll() is None, f"launch ended early:\n{self.text()[-3000:]}"
            time.sleep(0.5)
        raise AssertionError(f"no peer copy of step {step}:\n{self.text()[-3000:]}")

    def wait_committed(self, step: int) -> int:
        """Wait until a checkpoint at or past ``step`` is committed; return the newest."""
        deadline = time.monotonic() + RUN_S
        while time.monotonic() < deadline:
            steps = self.committed()
            if steps and steps[0] >= step:
                return steps[0]
            assert self.proc.poll() is None, f"launch ended early:\n{self.text()[-3000:]}"
            time.sleep(0.5)
        raise AssertionError(f"no checkpoint at step {step}:\n{self.text()[-3000:]}")

    def weights(self):
        from kfp_nvrx.components.core.rundir import step_dir
        from kfp_nvrx.components.training.export.consolidate import load_model_state

        assert self.committed()[0] == STEPS
        return load_model_state(step_dir(self.run_dir / "checkpoints", STEPS))

    def goodput(self) -> dict:
        """``kfp-nvrx goodput --json`` of the run dir on the volume (what the step publishes)."""
        out = subprocess.run([str(Path(sys.executable).parent / "kfp-nvrx"), "goodput",
                              "--run-dir", str(self.run_dir), "--json"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def starts(self) -> list[dict]:
        """The trainer's ``start`` events (one per incarnation, with ``resumed_from``)."""
        from kfp_nvrx.components.core.events import Start, read_events

        return [e.to_dict() for e in read_events(self.run_dir) if isinstance(e, Start)]


def _pods(kube, selector: str) -> list:
    return _core(kube).list_namespaced_pod(kube.namespace, label_selector=selector).items


def _running(kube, selector: str, n: int = 2) -> list:
    deadline = time.monotonic() + RUN_S
    while time.monotonic() < deadline:
        pods = [p for p in _pods(kube, selector) if p.status.phase == "Running"
                and not p.metadata.deletion_timestamp]
        if len(pods) >= n:
            return sorted(pods, key=lambda p: p.metadata.name)
        time.sleep(0.5)
    raise AssertionError(f"{n} running pods of {selector} not seen")


def _kill_group(kube, pod) -> None:
    """SIGKILL the pod's whole process group from outside (exit 137)."""
    f = kube.root / "agent" / "pods" / pod.metadata.uid / "pids.json"
    pgid = json.loads(f.read_text())["containers"][pod.spec.containers[0].name]["pgid"]
    os.killpg(pgid, signal.SIGKILL)


def _assert_bitwise(a, b) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the fault-free run"


def _assert_nothing_left(kube) -> None:
    """Every container process the agent started for finished pods is gone."""
    from harness.procs import alive

    for f in (kube.root / "agent" / "pods").glob("*/pids.json"):
        pods = {p.metadata.uid: p for p in _core(kube).list_namespaced_pod(kube.namespace).items}
        uid = f.parent.name
        if uid in pods and pods[uid].status.phase == "Running":
            continue
        for c in json.loads(f.read_text())["containers"].values():
            # started None: gone before the agent read its start time.
            assert c["started"] is None or not alive(c["pgid"], c["started"]), \
                f"pod {uid}: process group {c['pgid']} still running"


@pytest.fixture(scope="module")
def reference(cluster, dataset):
    """The fault-free TrainJob: its launch and its final weights."""
    run = Launch(cluster, "e2e-ref", "trainjob", dataset)
    rc, out = run.wait()
    assert rc == 0, out[-4000:]
    return run, out, run.weights()


def test_trainjob_trains_through_the_real_controllers(kube, reference):
    run, out, _ = reference
    assert "TrainJob e2e-ref: Complete" in out and "Succeeded: e2e-ref" in out
    # The launcher streamed both node pods' logs, trainer lines included (from the pod whose
    # agent joined the rendezvous first: rank 0, either node).
    assert "[node-0]" in out and "[node-1]" in out
    assert "[node-0] [trainer] step" in out or "[node-1] [trainer] step" in out, out[-3000:]
    # The final step is committed; the others the durable pace reached, each a snapshot step
    # (checkpoint.keep=5 keeps them all).
    committed = run.committed()
    assert committed[0] == STEPS and set(committed) <= {6, 12, 18, 24}, committed
    assert (run.run_dir / "events.jsonl").is_file()
    assert [s["resumed_from"] for s in run.starts()] == [None]
    goodput = run.goodput()
    assert 0 < goodput["goodput"] <= 1 and goodput["restarts"] == {}
    pods = _pods(kube, f"{JOBSET_LABEL}=e2e-ref")
    assert {p.status.phase for p in pods} == {"Succeeded"} and len(pods) == 2
    _assert_nothing_left(kube)


def test_trainjob_in_job_restart_keeps_the_pods(kube, dataset, reference):
    run = Launch(kube, "e2e-injob", "trainjob", dataset, faults=["kill@14/1"])
    before = {p.metadata.uid for p in _running(kube, f"{JOBSET_LABEL}=e2e-injob")}
    rc, out = run.wait()
    assert rc == 0, out[-4000:]
    pods = _pods(kube, f"{JOBSET_LABEL}=e2e-injob")
    assert {p.metadata.uid for p in pods} == before, "ft_launcher's restart recreated pods"
    assert all(p.status.container_statuses[0].restart_count == 0 for p in pods)
    assert {p.metadata.labels[ATTEMPT_LABEL] for p in pods} == {"0"}
    resumed = [s["resumed_from"] for s in run.starts()]
    assert resumed[0] is None and resumed[1:] in ([6], [12]), resumed
    assert run.goodput()["restarts"] == {"in-job": 1}  # the layer that restarted
    _assert_bitwise(run.weights(), reference[2])


@pytest.mark.parametrize("how,node", [("sigkill", 0), ("evict", 0), ("evict", 1)])
def test_trainjob_pod_failure_recreates_the_jobset(kube, dataset, reference, how, node):
    """exit 137 (the pod's processes killed) or an eviction, of node 0 (it hosts the rendezvous
    store: the other pod's ft_launcher exits 1 on losing it, which its entrypoint holds back as
    "peer lost") or node 1."""
    from kubernetes import client

    name = f"e2e-{how}-{node}"
    run = Launch(kube, name, "trainjob", dataset, extra=PACED)
    pods = _running(kube, f"{JOBSET_LABEL}={name}")
    victim = next(p for p in pods if p.metadata.labels.get(INDEX_LABEL) == str(node))
    newest = run.wait_snapshot(12)
    if how == "sigkill":
        _kill_group(kube, victim)
    else:
        _core(kube).create_namespaced_pod_eviction(victim.metadata.name, kube.namespace,
                                                   client.V1Eviction(metadata=client.V1ObjectMeta(
                                                       name=victim.metadata.name,
                                                       namespace=kube.namespace)))
    rc, out = run.wait()
    assert rc == 0, out[-4000:]
    after = _pods(kube, f"{JOBSET_LABEL}={name}")
    assert {p.metadata.labels[ATTEMPT_LABEL] for p in after} == {"1"}, "no JobSet restart"
    assert not {p.metadata.uid for p in after} & {p.metadata.uid for p in pods}
    resumed = [s["resumed_from"] for s in run.starts()]
    assert resumed[0] is None and resumed[-1] is not None and resumed[-1] >= newest, resumed
    assert "/a1]" in out  # the launcher followed the recreated pods
    summary = next(line for line in out.splitlines() if line.startswith("Succeeded:"))
    assert "pod restarts 1," in summary, summary  # one JobSet restart, as goodput counts it
    goodput = run.goodput()  # the JobSet restart shows in goodput, by layer, with its recovery
    assert goodput["restarts"].get("pod") == 1 and goodput["recovery_s"], goodput
    assert any("pods recreated" in s for s in goodput["what_happened"]), goodput
    _assert_bitwise(run.weights(), reference[2])
    _assert_nothing_left(kube)


def test_trainjob_lost_node_memory_restores_from_the_peer(kube, dataset, reference):
    """node-lost in pod 1 at step 16 (its workers killed, its /dev/shm snapshots gone) while step 12's
    durable write is slowed: ft_launcher restarts the workers in the same pods, and pod 1's rank
    takes step 12 from the copy pod 0 holds (issue 36), not the older commit on the volume."""
    name = "e2e-lost"
    run = Launch(kube, name, "trainjob", dataset, extra=PACED,
                 faults=["node-lost@16/1", "slow-write@11/0:seconds=60"])
    rc, out = run.wait()
    assert rc == 0, out[-4000:]
    last = run.starts()[-1]
    assert last["resumed_from"] == 12, run.starts()
    assert "peer" in last["sources"] and "volume" not in last["sources"], last
    goodput = run.goodput()
    assert goodput["restarts"] == {"in-job": 1} and goodput["restores"] == {"peer": 1}, goodput
    _assert_bitwise(run.weights(), reference[2])
    _assert_nothing_left(kube)


def test_trainjob_fails_at_once_when_ft_launcher_gives_up(kube, dataset):
    from kubernetes import client

    name = "e2e-giveup"
    run = Launch(kube, name, "trainjob", dataset, faults=["kill@4/1", "kill@8/1"],
                 extra=["resilience.max_restarts=1"])
    rc, out = run.wait()
    assert rc == 1, out[-4000:]
    # One line says why: the JobSet's FailJobSet action and the node that exited 1.
    why = [line for line in out.splitlines() if line.startswith("kfp-nvrx launch: Failed:")]
    assert len(why) == 1 and "FailJobSet" in why[0] and "exited with code 1" in why[0], why
    assert "ft_launcher gave up" in why[0], why
    js = client.CustomObjectsApi(kube.client()).get_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", kube.namespace, "jobsets", name)
    assert js["status"].get("restarts", 0) == 0, "the JobSet was restarted after a give-up"
    assert {p.metadata.labels[ATTEMPT_LABEL] for p in _pods(kube, f"{JOBSET_LABEL}={name}")} \
        == {"0"}
    _assert_nothing_left(kube)


def test_pytorchjob_trains_and_survives_a_killed_worker(kube, dataset, reference):
    """A rank killed at step 8: ft_launcher restarts the workers in the pods (no pod
    recreated); then worker-1's processes killed (137): the Training Operator recreates it
    (ExitCode) and it re-joins. Its /dev/shm went with the old pod (each pod has its own here,
    as on EKS): its rank's state comes from the copy worker-0 holds (issue 36)."""
    name = "e2e-pj"
    run = Launch(kube, name, "pytorchjob", dataset, faults=["kill@8/1"], extra=PACED)
    pods = _running(kube, f"{PYTORCHJOB_LABEL}={name}")
    newest = run.wait_snapshot(12)
    held = run.wait_replica(12)
    assert len(run.starts()) == 2  # the in-job restart; the pods are the first ones (below)
    _kill_group(kube, pods[1])
    rc, out = run.wait()
    assert rc == 0, out[-4000:]
    assert "PyTorchJob e2e-pj: Succeeded" in out and "[worker-0]" in out
    assert "[worker-1/p1]" in out  # the recreated pod was followed
    ended = out[out.index("-- pod Succeeded"):]  # the operator stops the rest: no failure
    assert "pod Failed" not in ended, ended[-2000:]  # (issue 30 item 8)
    # worker-1 ran as two pods (same name, new uid), worker-0 as one. (The API may no longer
    # show them: cleanPodPolicy Running deletes the pods still running when the job succeeds;
    # the agent's records stay.)
    ran: dict[str, set[str]] = {}
    for f in (kube.root / "agent" / "pods").glob("*/pids.json"):
        rec = json.loads(f.read_text())
        if rec["name"].startswith(f"{name}-"):
            ran.setdefault(rec["name"], set()).add(f.parent.name)
    assert len(ran[pods[1].metadata.name]) == 2 and len(ran[pods[0].metadata.name]) == 1, ran
    resumed = [s["resumed_from"] for s in run.starts()]
    assert resumed[-1] is not None and resumed[-1] >= max(newest, held), resumed
    last = run.starts()[-1]
    assert "peer" in last["sources"] and "volume" not in last["sources"], last
    assert last["peer_bytes"] > 0
    goodput = run.goodput()
    assert goodput["restarts"].get("in-job", 0) >= 1
    assert goodput["restores"].get("peer") == 1 and goodput["peer_restore_bytes"] > 0, goodput
    _assert_bitwise(run.weights(), reference[2])
    _assert_nothing_left(kube)
