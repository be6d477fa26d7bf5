"""What the real controllers build from our objects (issue 20, item 4).

A TrainJob on our runtime becomes, through the Trainer, JobSet and Job controllers, one JobSet,
one indexed Job, a headless Service and one Pod per node; a PyTorchJob becomes, through the
Training Operator, one Pod and one headless Service per worker. The tests read those objects back
from the API server and check every field our pods depend on against what we rendered, and the
offline emulation of the node Pod (``validate_trainjob.node_pod``) against the real Pod. Pods stay
Pending without nodes, which is all this needs.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from harness.kutil import (
    SETTLE_S,
    delete_namespace,
    items,
    new_namespace,
    submit,
    wait_for,
    wait_runtime_seen,
)
from harness.truth_rows import shape_spec
from support.rendering import render_pytorchjob, render_trainjob

from kfp_nvrx.components.core.launch_command import agent_max_restarts
from kfp_nvrx.components.launch.pytorchjob import render as pytorchjob
from kfp_nvrx.components.launch.trainjob.runtime import build_runtime
from kfp_nvrx.components.launch.trainjob.validate import node_pod

NODES = 2
#: What the kubelet would take for the pod's IP when it expands $(POD_IP).
POD_IP = "10.1.2.3"
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of a command item (``$$`` is a literal ``$``)."""
    return _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                    arg)


def env_values(container: dict[str, Any], pod: dict[str, Any]) -> dict[str, str]:
    """The values the kubelet resolves for the env the expansion can see."""
    out = {}
    for e in container.get("env") or []:
        ref = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if "value" in e:
            out[e["name"]] = e["value"]
        elif ref == "status.podIP":
            out[e["name"]] = POD_IP
        elif ref == "metadata.name":
            out[e["name"]] = pod["metadata"]["name"]
    return out


def _norm_env(env: list[dict[str, Any]]) -> dict[str, Any]:
    """Env by name, without the ``apiVersion: v1`` the server adds to a fieldRef."""
    out = {}
    for e in env:
        e = dict(e)
        ref = (e.get("valueFrom") or {}).get("fieldRef")
        if ref:
            e["valueFrom"] = {"fieldRef": {"fieldPath": ref["fieldPath"]}}
        out[e.pop("name")] = e
    return out


def _qty(resources: dict[str, Any]) -> dict[str, Any]:
    """Requests and limits by value: the server stores quantities canonically (5120Mi -> 5Gi)."""
    from kubernetes.utils import parse_quantity

    return {part: {k: parse_quantity(v) for k, v in (resources.get(part) or {}).items()}
            for part in ("requests", "limits")}


def _sans_defaults(volumes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Volumes without the service-account token volume the API server adds."""
    return [v for v in volumes if not v["name"].startswith("kube-api-access-")]


@pytest.fixture(scope="module")
def space(cluster):
    """A namespace with our TrainingRuntime and the ServiceAccount the placement shape names."""
    dyn = cluster.dynamic()
    ns = new_namespace(dyn, "built")
    runtime = build_runtime(namespace=ns)
    assert submit(dyn, runtime, ns, dry_run=False).accepted
    wait_runtime_seen(dyn, runtime, ns)
    assert submit(dyn, {"apiVersion": "v1", "kind": "ServiceAccount",
                        "metadata": {"name": "trainer", "namespace": ns}}, ns,
                  dry_run=False).accepted
    yield dyn, ns
    delete_namespace(dyn, ns)


def _placed_spec(api: str, ns: str):
    spec = shape_spec(NODES, "p5.48xlarge", "placement", api)
    spec.secret_env = ["HF_TOKEN=hf-token:token"]
    spec.env = {"MY_FLAG": "1"}
    spec.pod_priority_class = ""  # a PriorityClass that does not exist would keep every pod out
    spec.namespace = ns
    return spec


def _pods(dyn, ns: str, selector: str, count: int) -> list[dict[str, Any]]:
    return wait_for(f"{count} pods with {selector}", lambda: (
        p if len(p := items(dyn, "v1", "Pod", ns, label_selector=selector)) == count else None),
        SETTLE_S)


@pytest.fixture(scope="module")
def built_trainjob(space):
    """Our TrainJob, created for real, and what the controllers made of it."""
    dyn, ns = space
    rendered = render_trainjob(_placed_spec("built-tj", ns))
    assert submit(dyn, rendered.job, ns, dry_run=False).accepted
    name = rendered.name
    pods = _pods(dyn, ns, f"jobset.sigs.k8s.io/jobset-name={name}", NODES)
    pods.sort(key=lambda p: int(p["metadata"]["annotations"][
        "batch.kubernetes.io/job-completion-index"]))
    jobsets = items(dyn, "jobset.x-k8s.io/v1alpha2", "JobSet", ns,
                    field_selector=f"metadata.name={name}")
    jobs = items(dyn, "batch/v1", "Job", ns, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}")
    services = wait_for("the headless Service", lambda: items(
        dyn, "v1", "Service", ns, field_selector=f"metadata.name={name}"))
    return rendered, jobsets, jobs, services, pods


def test_trainjob_becomes_one_jobset_one_indexed_job_and_a_headless_service(
        kube, built_trainjob) -> None:
    rendered, (jobset,), (job,), (service,), _ = built_trainjob
    name, runtime = rendered.name, rendered.runtime
    rjobs = jobset["spec"]["replicatedJobs"]
    assert [(r["name"], r["replicas"]) for r in rjobs] == [("node", 1)]
    assert jobset["spec"]["failurePolicy"] == runtime["spec"]["template"]["spec"]["failurePolicy"]
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    assert job["metadata"]["name"] == f"{name}-node-0"
    spec = job["spec"]
    assert (spec["completionMode"], spec["parallelism"], spec["completions"]) == \
        ("Indexed", NODES, NODES)
    ours = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert spec["backoffLimit"] == ours["backoffLimit"] == 0
    want_rules = [dict(r) for r in ours["podFailurePolicy"]["rules"]]
    for rule in want_rules:  # the API server defaults a pod-condition pattern's status
        if "onPodConditions" in rule:
            rule["onPodConditions"] = [{"status": "True", **c} for c in rule["onPodConditions"]]
    assert spec["podFailurePolicy"]["rules"] == want_rules
    svc = service["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    assert svc["selector"] == {"jobset.sigs.k8s.io/jobset-name": name}


def test_trainjob_pods_are_what_we_rendered(kube, built_trainjob) -> None:
    rendered, _, _, _, pods = built_trainjob
    name, job = rendered.name, rendered.job
    trainer = job["spec"]["trainer"]
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]
    for index, pod in enumerate(pods):
        spec = pod["spec"]
        (c,) = spec["containers"]
        assert (c["name"], c["image"], c["imagePullPolicy"]) == ("node", trainer["image"],
                                                                 "IfNotPresent")
        # hostname/subdomain: node 0's is the PET_MASTER_ADDR our rendezvous endpoint uses
        assert (spec["hostname"], spec["subdomain"]) == (f"{name}-node-0-{index}", name)
        env = _norm_env(c["env"])
        assert env["PET_NNODES"] == {"value": str(NODES)}
        assert env["PET_NPROC_PER_NODE"] == {"value": "8"}
        assert env["PET_MASTER_ADDR"] == {"value": f"{name}-node-0-0.{name}"}
        assert env["PET_MASTER_PORT"] == {"value": "29500"}
        assert env["PET_NODE_RANK"] == {"valueFrom": {"fieldRef": {"fieldPath": (
            "metadata.annotations['batch.kubernetes.io/job-completion-index']")}}}
        assert pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == \
            str(index)
        for k, v in _norm_env(trainer["env"]).items():  # ours, secrets included, unchanged
            assert env[k] == v, k
        assert env["HF_TOKEN"] == {"valueFrom": {"secretKeyRef": {"name": "hf-token",
                                                                  "key": "token"}}}
        assert c["command"] == trainer["command"] and "args" not in c
        line = [expand(a, env_values(c, pod)) for a in c["command"]]
        assert f"--rdzv-endpoint={name}-node-0-0.{name}:29500" in line
        assert f"--rdzv-id={name}" in line and f"--local-addr={POD_IP}" in line
        assert not any("$(" in a for a in line), line
        assert {"containerPort": 29500, "protocol": "TCP"} in c["ports"]
        assert _qty(c["resources"]) == _qty(trainer["resourcesPerNode"])
        assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        pspec = patch["spec"]
        assert _sans_defaults(spec["volumes"]) == pspec["volumes"]
        mounts = [m for m in c["volumeMounts"] if not m["name"].startswith("kube-api-access-")]
        assert mounts == pspec["containers"][0]["volumeMounts"]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "512Gi"}
        assert vols["shared"]["persistentVolumeClaim"] == {"claimName": "fsx"}
        assert spec["nodeSelector"] == pspec["nodeSelector"]
        for t in pspec["tolerations"]:
            assert t in spec["tolerations"], t
        assert spec["affinity"] == pspec["affinity"]
        assert spec["securityContext"] == pspec["securityContext"]
        assert spec["serviceAccountName"] == "trainer"
        assert spec["terminationGracePeriodSeconds"] == pspec["terminationGracePeriodSeconds"]
        assert spec["restartPolicy"] == "Never"
        for key, value in patch["metadata"]["labels"].items():
            assert pod["metadata"]["labels"][key] == value
        assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"


def test_offline_node_pod_is_the_real_pod(kube, built_trainjob) -> None:
    """``node_pod`` (what validate_trainjob checks) says what the controllers really build."""
    rendered, _, _, _, pods = built_trainjob
    for index, real in enumerate(pods):
        ours = node_pod(rendered.job, rendered.runtime, index)
        o, r = ours["spec"], real["spec"]
        for key in ("hostname", "subdomain", "nodeSelector", "affinity", "securityContext",
                    "serviceAccountName", "terminationGracePeriodSeconds", "restartPolicy"):
            assert r.get(key) == o.get(key), key
        assert _sans_defaults(r["volumes"]) == o["volumes"]
        (oc,), (rc,) = o["containers"], r["containers"]
        for key in ("name", "image", "imagePullPolicy", "command", "securityContext"):
            assert rc.get(key) == oc.get(key), key
        assert _qty(rc["resources"]) == _qty(oc["resources"])
        real_env = _norm_env(rc["env"])
        real_env.pop("JOB_COMPLETION_INDEX")  # the Job controller's own, not the Trainer's
        assert real_env == _norm_env(oc["env"])
        assert [p["containerPort"] for p in rc["ports"]] == [p["containerPort"]
                                                              for p in oc["ports"]]


def test_pytorchjob_pods_and_services_are_what_we_rendered(kube, space) -> None:
    dyn, ns = space
    spec = _placed_spec("built-pj", ns)
    spec.scheduler_name = "default-scheduler"  # a PyTorchJob carries it; must reach the pods
    rendered = render_pytorchjob(spec)
    job = rendered.to_dict()
    assert submit(dyn, job, ns, dry_run=False).accepted
    name = rendered.name
    pods = _pods(dyn, ns, f"training.kubeflow.org/job-name={name}", NODES)
    services = wait_for("the operator's Services", lambda: (s if len(s := items(
        dyn, "v1", "Service", ns, label_selector=f"training.kubeflow.org/job-name={name}"))
        == NODES else None))
    tmpl = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    (want,) = tmpl["spec"]["containers"]
    assert sorted(p["metadata"]["name"] for p in pods) == [f"{name}-worker-{i}"
                                                           for i in range(NODES)]
    for svc in services:
        index = svc["metadata"]["name"].rsplit("-", 1)[1]
        assert svc["spec"]["clusterIP"] == "None"
        assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == \
            [("pytorchjob-port", pytorchjob.RDZV_PORT)]
        assert svc["spec"]["selector"]["training.kubeflow.org/replica-index"] == index
    for pod in pods:
        spec = pod["spec"]
        (c,) = spec["containers"]
        env = _norm_env(c["env"])
        # The operator's elastic env: ft_launcher reads these (and no PET_RDZV_ID: default id).
        assert env["PET_NNODES"] == {"value": f"{NODES}:{NODES}"}
        assert env["PET_RDZV_ENDPOINT"] == {"value": f"{name}-worker-0:{pytorchjob.RDZV_PORT}"}
        assert env["PET_RDZV_BACKEND"] == {"value": "c10d"}
        assert env["PET_NPROC_PER_NODE"] == {"value": "8"}
        assert env["PET_MAX_RESTARTS"] == {
            "value": str(agent_max_restarts(rendered.config.resilience.max_restarts))}
        assert env["PYTHONUNBUFFERED"] == {"value": "1"} and "PET_RDZV_ID" not in env
        for k, v in _norm_env(want["env"]).items():
            assert env[k] == v, k
        assert c["command"] == want["command"]
        line = [expand(a, env_values(c, pod)) for a in c["command"]]
        assert f"--local-addr={POD_IP}" in line and not any("$(" in a for a in line)
        assert _qty(c["resources"]) == _qty(want["resources"]) and c["name"] == "pytorch"
        assert c["securityContext"] == want["securityContext"]
        assert _sans_defaults(spec["volumes"]) == tmpl["spec"]["volumes"]
        for key in ("nodeSelector", "affinity", "securityContext", "serviceAccountName",
                    "terminationGracePeriodSeconds", "schedulerName"):
            assert spec.get(key) == tmpl["spec"].get(key), key
        for t in tmpl["spec"]["tolerations"]:
            assert t in spec["tolerations"], t
        # ExitCode is the operator's policy; the pod itself never restarts in place.
        assert spec["restartPolicy"] == "Never"
        assert spec.get("hostname") is None and spec.get("subdomain") is None  # via its Service
