"""The test node agent (issue 21.1) against the real control plane: nodes stay Ready, the
scheduler's pods run as local processes with the kubelet's environment, volumes, names, restart
policies, exit codes and grace periods, and nothing is left running."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from harness.kutil import wait_for
from harness.procs import alive

pytestmark = pytest.mark.timeout(300)
WAIT_S = 120.0


def _core(kube):
    from kubernetes import client

    return client.CoreV1Api(kube.client())


def _wait(what, check, timeout_s=WAIT_S):
    return wait_for(what, check, timeout_s)


def _pod(name, script, *, policy="Never", volumes=(), mounts=(), env=(), **spec):
    """A one-container pod running ``script``; ``spec`` adds pod spec fields (camelCase)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"t": name}},
            "spec": {"restartPolicy": policy, "containers": [{
                "name": "main", "image": "ignored", "command": ["/bin/sh", "-c", script],
                "env": list(env), "volumeMounts": list(mounts)}], "volumes": list(volumes),
                **spec}}


def _phase(core, ns, name, phases=("Succeeded", "Failed")):
    def check():
        p = core.read_namespaced_pod(name, ns)
        return p if p.status.phase in phases else None
    return _wait(f"pod {name} in {phases}", check)


def _gone(core, ns, name, timeout_s=WAIT_S):
    from kubernetes.client.rest import ApiException

    def check():
        try:
            core.read_namespaced_pod(name, ns)
        except ApiException as e:
            return e.status == 404
        return False
    _wait(f"pod {name} removed", check, timeout_s)


def _log(core, name, ns, **kw) -> str:
    # Raw text: the client would parse a JSON-looking log and hand back its repr.
    return core.read_namespaced_pod_log(name, ns, _preload_content=False, **kw).data.decode()


def _claim_folder(kube) -> Path:
    return kube.root / "volumes" / kube.namespace / "kfp-nvrx-shared"


SHARED = {"name": "shared", "persistentVolumeClaim": {"claimName": "kfp-nvrx-shared"}}


def test_nodes_are_ready_and_heartbeat(kube):
    from kubernetes import client

    core = _core(kube)

    def settled():
        # Just after start-up the node lifecycle controller may still carry its not-ready
        # taint from before the first heartbeat: wait for it to see the nodes Ready.
        nodes = {n.metadata.name: n for n in core.list_node().items}
        ok = {"kfp-nvrx-node-0", "kfp-nvrx-node-1"} <= set(nodes) and all(
            {c.type: c.status for c in n.status.conditions or []}.get("Ready") == "True"
            and not n.spec.taints for n in nodes.values())
        return nodes if ok else None

    nodes = _wait("every node Ready and untainted", settled)
    for n in nodes.values():
        assert n.status.allocatable["cpu"] == "8"
    coord = client.CoordinationV1Api(kube.client())
    first = coord.read_namespaced_lease("kfp-nvrx-node-0", "kube-node-lease").spec.renew_time
    _wait("a lease renewal", lambda: coord.read_namespaced_lease(
        "kfp-nvrx-node-0", "kube-node-lease").spec.renew_time > first, 60)


def test_pod_gets_kubelet_env_volumes_hostname_and_names(kube):
    """fieldRef, secretKeyRef, configMapKeyRef, $(VAR)/$$ expansion, workingDir, the PVC and an
    emptyDir, hostname/subdomain and Service names resolving only inside the pod, and the
    cluster's own network namespace."""
    core, ns, tag = _core(kube), kube.namespace, uuid.uuid4().hex[:6]
    core.create_namespaced_secret(ns, {"metadata": {"name": f"s-{tag}"},
                                       "stringData": {"token": "s3cret"}})
    core.create_namespaced_config_map(ns, {"metadata": {"name": f"c-{tag}"},
                                           "data": {"level": "debug"}})
    target = f"target-{tag}"
    core.create_namespaced_pod(ns, _pod(target, "exec sleep 300",
                                        terminationGracePeriodSeconds=1))
    core.create_namespaced_service(ns, {"metadata": {"name": f"svc-{tag}"}, "spec": {
        "clusterIP": "None", "selector": {"t": target}, "ports": [{"port": 80}]}})
    tip = _phase(core, ns, target, ("Running",)).status.pod_ip
    probe = f"probe-{tag}"
    script = ("python3 - <<'EOF'\nimport json, os, socket\n"
              f"names = ['{probe}-h.sub-{tag}', 'svc-{tag}', 'svc-{tag}.{ns}.svc.cluster.local']\n"
              "out = {k: os.environ.get(k) for k in ('POD_IP', 'POD_NAME', 'NODE', 'TOKEN', "
              "'LEVEL', 'JOINED', 'LITERAL', 'INDEX')}\n"
              "out['hostname'] = socket.gethostname(); out['cwd'] = os.getcwd()\n"
              "out['resolved'] = {n: socket.gethostbyname(n) for n in names}\n"
              "s = socket.socket(); s.settimeout(5)\n"
              f"out['apiserver'] = s.connect_ex(('127.0.0.1', {kube.state['apiserver']}))\n"
              "open('/fsx/agent-" + tag + "', 'w').write('hi')\n"
              "open('/scratch/x', 'w').write('x'); open('/dev/shm/y', 'w').write('y')\n"
              "print(json.dumps(out))\nEOF")
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
           {"name": "INDEX", "valueFrom": {"fieldRef": {
               "fieldPath": "metadata.labels['t']"}}},
           {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": f"s-{tag}", "key": "token"}}},
           {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": f"c-{tag}",
                                                               "key": "level"}}},
           {"name": "JOINED", "value": "$(POD_NAME)@$(POD_IP):$(UNDEFINED)"},
           {"name": "LITERAL", "value": "$$(POD_NAME)"}]
    body = _pod(probe, script, env=env, hostname=f"{probe}-h", subdomain=f"sub-{tag}",
                volumes=[SHARED, {"name": "scratch", "emptyDir": {}}],
                mounts=[{"name": "shared", "mountPath": "/fsx"},
                        {"name": "scratch", "mountPath": "/scratch"}])
    body["spec"]["containers"][0]["workingDir"] = "/scratch"
    core.create_namespaced_pod(ns, body)
    pod = _phase(core, ns, probe)
    log = _log(core, probe, ns)
    assert pod.status.phase == "Succeeded", log
    out = json.loads(log.strip().splitlines()[-1])
    ip = pod.status.pod_ip
    assert ip.startswith("127.") and ip != tip
    assert out["POD_IP"] == ip and out["POD_NAME"] == probe and out["NODE"] == pod.spec.node_name
    assert (out["TOKEN"], out["LEVEL"], out["INDEX"]) == ("s3cret", "debug", probe)
    assert out["JOINED"] == f"{probe}@{ip}:$(UNDEFINED)" and out["LITERAL"] == "$(POD_NAME)"
    assert out["hostname"] == f"{probe}-h" and out["cwd"] == "/scratch"
    assert out["resolved"] == {f"{probe}-h.sub-{tag}": ip, f"svc-{tag}": tip,
                               f"svc-{tag}.{ns}.svc.cluster.local": tip}
    assert (_claim_folder(kube) / f"agent-{tag}").read_text() == "hi"
    # The cluster's own network namespace: this machine's ports (the API server's) are not there.
    assert out["apiserver"] != 0
    # The names exist only inside the pods: this machine's resolution is unchanged.
    import socket

    with pytest.raises(OSError):
        socket.gethostbyname(f"svc-{tag}")
    assert f"svc-{tag}" not in Path("/etc/hosts").read_text()
    core.delete_namespaced_pod(target, ns)
    _gone(core, ns, target)


def test_restart_in_place_exit_codes_and_previous_logs(kube):
    core, ns, tag = _core(kube), kube.namespace, uuid.uuid4().hex[:6]
    flaky = f"flaky-{tag}"
    # The emptyDir survives in-place restarts: the third run succeeds.
    script = ("n=$(cat /d/n 2>/dev/null || echo 0); echo run $n; echo $((n+1)) > /d/n; "
              "[ $n -ge 2 ] && exit 0; exit 3")
    core.create_namespaced_pod(ns, _pod(flaky, script, policy="OnFailure",
                                        volumes=[{"name": "d", "emptyDir": {}}],
                                        mounts=[{"name": "d", "mountPath": "/d"}]))
    pod = _phase(core, ns, flaky)
    cs = pod.status.container_statuses[0]
    assert pod.status.phase == "Succeeded" and cs.restart_count == 2
    assert cs.state.terminated.exit_code == 0 and cs.last_state.terminated.exit_code == 3
    assert _log(core, flaky, ns).strip() == "run 2"
    assert _log(core, flaky, ns, previous=True).strip() == "run 1"
    killed = f"killed-{tag}"
    # `$$$$`: the kubelet turns `$$` into `$`, so the shell sees `kill -9 $$` (itself).
    core.create_namespaced_pod(ns, _pod(killed, "echo bye; kill -9 $$$$"))
    pod = _phase(core, ns, killed)
    term = pod.status.container_statuses[0].state.terminated
    assert (pod.status.phase, term.exit_code, pod.status.container_statuses[0].restart_count) \
        == ("Failed", 137, 0)
    for name in (flaky, killed):
        core.delete_namespaced_pod(name, ns)


def _pids(kube, uid):
    f = kube.root / "agent" / "pods" / uid / "pids.json"
    return json.loads(f.read_text()) if f.is_file() else None


def test_delete_honours_grace_and_leaves_nothing(kube):
    """SIGTERM reaches the command (PID 2 under the pod's init); one that ignores it is
    SIGKILLed after the grace period; a grandchild in a session of its own dies too."""
    core, ns, tag = _core(kube), kube.namespace, uuid.uuid4().hex[:6]
    folder = _claim_folder(kube)
    polite, stubborn = f"polite-{tag}", f"stubborn-{tag}"
    mounts = [{"name": "shared", "mountPath": "/fsx"}]
    # This test's own grandchild, told apart from another run's on this machine by its argument.
    grandchild = f"sleep 1000.{int(tag, 16)}"
    polite_sh = (f"trap 'echo term > /fsx/{polite}; exit 0' TERM; "
                 f"setsid {grandchild} & echo $! > /fsx/{polite}.child; "
                 "while true; do sleep 0.2; done")
    core.create_namespaced_pod(ns, _pod(polite, polite_sh, volumes=[SHARED], mounts=mounts,
                                        terminationGracePeriodSeconds=30))
    core.create_namespaced_pod(ns, _pod(stubborn, "trap '' TERM; while true; do sleep 0.2; "
                                        "done", terminationGracePeriodSeconds=3))
    pods = {n: _phase(core, ns, n, ("Running",)) for n in (polite, stubborn)}
    _wait("the grandchild's pid", lambda: (folder / f"{polite}.child").is_file())
    groups = {n: _wait(f"pids of {n}", lambda n=n: _pids(kube, pods[n].metadata.uid))
              for n in pods}
    pgids = [g["containers"]["main"]["pgid"] for g in groups.values()]
    assert all(alive(p) for p in pgids)
    t0 = time.monotonic()
    for n in pods:
        core.delete_namespaced_pod(n, ns)
    _gone(core, ns, polite)
    assert (folder / polite).read_text().strip() == "term"
    _gone(core, ns, stubborn)
    took = time.monotonic() - t0
    assert took >= 3.0, f"the stubborn pod was killed before its grace period ({took:.1f} s)"
    # The grandchild ran in a session of its own, in the pod's PID namespace: gone with it.
    # (Its pid was read inside that namespace; look it up among this machine's processes.)
    assert all(not alive(p) for p in pgids)
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and
                _cmdline(p) == grandchild]


def _cmdline(p: Path) -> str:
    try:
        return p.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def test_new_claim_gets_a_folder(kube):
    core, ns, tag = _core(kube), kube.namespace, uuid.uuid4().hex[:6]
    claim = f"scratch-{tag}"
    core.create_namespaced_persistent_volume_claim(ns, {"metadata": {"name": claim}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    _wait("claim Bound", lambda: core.read_namespaced_persistent_volume_claim(
        claim, ns).status.phase == "Bound")
    name = f"writer-{tag}"
    core.create_namespaced_pod(ns, _pod(name, "echo data > /v/file", volumes=[
        {"name": "v", "persistentVolumeClaim": {"claimName": claim}}],
        mounts=[{"name": "v", "mountPath": "/v"}]))
    assert _phase(core, ns, name).status.phase == "Succeeded"
    assert (kube.root / "volumes" / ns / claim / "file").read_text() == "data\n"
    listed = json.loads((kube.root / "agent" / "volumes.json").read_text())
    assert listed[f"{ns}/{claim}"] == str(kube.root / "volumes" / ns / claim)
    core.delete_namespaced_pod(name, ns)


def test_missing_secret_waits_like_a_kubelet(kube):
    """A pod whose secretKeyRef does not resolve waits (CreateContainerConfigError) and starts
    once the Secret exists."""
    core, ns, tag = _core(kube), kube.namespace, uuid.uuid4().hex[:6]
    name = f"late-{tag}"
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": f"late-{tag}",
                                                            "key": "t"}}}]
    core.create_namespaced_pod(ns, _pod(name, "echo token=$TOKEN", env=env))

    def waiting():  # ContainerCreating comes first (as from a kubelet), then the verdict
        cs = core.read_namespaced_pod(name, ns).status.container_statuses
        reason = cs and cs[0].state.waiting and cs[0].state.waiting.reason
        return reason if reason != "ContainerCreating" else None
    assert _wait("config error", waiting) == "CreateContainerConfigError"
    core.create_namespaced_secret(ns, {"metadata": {"name": f"late-{tag}"},
                                       "stringData": {"t": "now"}})
    assert _phase(core, ns, name).status.phase == "Succeeded"
    assert _log(core, name, ns).strip() == "token=now"
    core.delete_namespaced_pod(name, ns)
