"""The launcher's pod watch under real watch semantics, and what it costs the API server.

Issue 20 item 3 (resourceVersion, bookmarks, 410 Gone after compaction, a restarted API server)
and issue 23 item 7 (a Pending job must not hot-loop the API). Requests are counted by the real
API server: its audit log records every request of the user namespace's service accounts, and
these tests run the launcher as ``kfp-nvrx-launcher`` with a TokenRequest token.
"""

from __future__ import annotations

import collections
import os
import signal

import pytest
from harness.launch_real import (
    SA,
    Background,
    audit_offset,
    audit_records,
    configuration_from,
    job_pods,
    job_spec,
    kubelet_exit,
    kubelet_run,
    sa_kubeconfig,
    wait_for,
)
from harness.supervisor import read_state
from kubernetes import client, watch

from kfp_nvrx.components.launch.kube.logs import PodLogFollower
from kfp_nvrx.components.launch.pytorchjob.follow import job_pods as pytorchjob_pods

NO_NODE = {"kfp-nvrx.test/no-node": "true"}
USER = "system:serviceaccount:{ns}:" + SA


def _spec(name: str):
    spec = job_spec(name)
    spec.node_selector = dict(NO_NODE)
    return spec


def _requests(kube, offset: int, name: str, allowed: tuple[int, ...] = (404,)
              ) -> collections.Counter:
    """(verb, resource) of the launcher's requests about job ``name`` since ``offset``.

    Every answer must be a success or one of ``allowed``: the Role lets every call through (a
    404 is the job gone after its deletion).
    """
    user = USER.format(ns=kube.namespace)
    counts: collections.Counter = collections.Counter()
    for rec in audit_records(kube, offset):
        ref = rec.get("objectRef") or {}
        if rec["user"]["username"] != user or (ref.get("name") != name
                                                and name not in rec["requestURI"]):
            continue
        counts[(rec["verb"], ref.get("resource", ""))] += 1
        code = (rec.get("responseStatus") or {}).get("code", 0)
        assert code < 400 or code in allowed, (rec["verb"], rec["requestURI"], code,
                                               rec.get("annotations"))
    return counts


def test_pending_job_costs_a_bounded_number_of_requests(kube, tmp_path) -> None:
    """20 s of a job that never leaves Pending: one LIST and one or two WATCHes of its pods."""
    name = "real-pending"
    cfg = configuration_from(sa_kubeconfig(kube, tmp_path))
    offset = audit_offset(kube)
    run = Background(_spec(name), cfg, kube.namespace, job_api="pytorchjob", poll_s=1.0,
                     deadline_s=20.0)
    result = run.join()
    assert result.state == "DeadlineExceeded"
    counts = wait_for("the audit records of the ended watch",
                      lambda: (c := _requests(kube, offset, name))[("watch", "pods")] and c)
    print(dict(counts))
    assert counts[("list", "pods")] == 1, counts
    assert counts[("watch", "pods")] <= 2, counts  # one 30 s watch, maybe renewed once
    assert counts[("create", "pytorchjobs")] == 1 and counts[("delete", "pytorchjobs")] == 1
    # Status reads: one per poll_s over 20 s, plus the wait for the deletion.
    assert counts[("get", "pytorchjobs")] <= 20 / 1.0 + 25, counts


def test_watch_renews_from_bookmarks_without_listing_again(kube) -> None:
    core = client.CoreV1Api(kube.client())
    follower = PodLogFollower(core, kube.namespace, pytorchjob_pods("real-no-such-job"),
                              emit=lambda _: None, watch_timeout_s=6)
    follower.start()
    try:
        # The API server sends a BOOKMARK before a watch's timeout when asked to.
        wait_for("a bookmark and three watches", lambda: follower.requests["bookmark"] >= 1
                 and follower.requests["watch"] >= 3)
    finally:
        follower.stop(drain_s=0)
    assert follower.requests["list"] == 1, follower.requests
    assert follower.requests["gone"] == 0, follower.requests


def _restart_apiserver(kube, compact: bool) -> None:
    before = read_state(kube.root)["apiserver_restarts"]
    os.kill(kube.state["supervisor"], signal.SIGUSR2 if compact else signal.SIGUSR1)
    wait_for("the API server restart", lambda: (read_state(kube.root) or {}).get(
        "apiserver_restarts") == before + 1)


def test_follows_through_an_apiserver_restart_and_410_gone(kube, tmp_path) -> None:
    name = "real-restart"
    core = client.CoreV1Api(kube.client())
    cfg = configuration_from(sa_kubeconfig(kube, tmp_path))
    run = Background(_spec(name), cfg, kube.namespace, job_api="pytorchjob")
    wait_for("the launcher to see both pods", lambda: run.saw("[worker-1] -- pod Pending")
             and run.saw("[worker-0] -- pod Pending"))
    old_rv = core.list_namespaced_pod(kube.namespace).metadata.resource_version
    offset = audit_offset(kube)
    _restart_apiserver(kube, compact=True)
    # What the launcher's own watch meets now: its resourceVersion is gone.
    with pytest.raises(client.ApiException) as gone:
        for _ in watch.Watch().stream(core.list_namespaced_pod, kube.namespace,
                                      resource_version=old_rv, timeout_seconds=2):
            pass
    assert gone.value.status == 410
    pods = job_pods(core, kube.namespace, "pytorchjob", name)
    kubelet_run(core, pods[0], "pytorch")
    wait_for("the launcher to see worker-0 running", lambda: run.saw("[worker-0] -- pod Running"))
    kubelet_exit(core, pods[0], "pytorch", 0)  # worker-0 done: the operator's Succeeded
    result = run.join()
    assert result.state == "Succeeded", (result.reason, run.lines[-10:])
    # The outage was reported once per distinct error (not once per 0.5 s poll), and its end.
    warnings = [line for line in run.lines if line.startswith("warning: ")]
    assert 1 <= len(warnings) <= 8, warnings
    assert run.saw(f"PyTorchJob {kube.namespace}/{name}: the API server answers again")
    # It listed again (after 410) instead of giving up or watching a stale resourceVersion.
    # While it starts, a restarted API server answers 503 (not ready) and, until its RBAC
    # informers have synced, 403 with an empty reason: the launcher must sit both out.
    counts = _requests(kube, offset, name, allowed=(403, 404, 503))
    assert counts[("list", "pods")] >= 1, counts
