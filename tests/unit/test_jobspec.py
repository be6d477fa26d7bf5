"""JobSpec -> PyTorchJob: golden manifests, every profile/option combination, naming, env.

Regenerate the golden files after an intended change with ``KFP_NVRX_UPDATE_GOLDEN=1 pytest
tests/unit/test_jobspec.py`` and review the diff.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import yaml
from support.golden_specs import IMAGE, RUN_ID, golden_specs
from support.rendering import render_pytorchjob

from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.core.launch_command import TrainerArgs, ft_launcher_argv
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec import naming
from kfp_nvrx.components.launch.jobspec.pod import POD_ENTRY
from kfp_nvrx.components.launch.jobspec.profiles import PROFILES, get_profile
from kfp_nvrx.components.launch.jobspec.spec import JobSpec

GOLDEN = Path(__file__).parent / "golden"
OBSOLETE = ("FI_PROVIDER", "NCCL_PROTO", "FI_EFA_FORK_SAFE", "NCCL_BUFFSIZE")


def _worker(manifest: dict) -> dict:
    return manifest["spec"]["pytorchReplicaSpecs"]["Worker"]


def _container(manifest: dict) -> dict:
    return _worker(manifest)["template"]["spec"]["containers"][0]


def _env(manifest: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in _container(manifest)["env"]}


GOLDEN_SPECS = golden_specs("pytorchjob", p5_nodes="2:4")


@pytest.mark.parametrize("filename", sorted(GOLDEN_SPECS))
def test_golden_manifest(filename: str) -> None:
    text = render_pytorchjob(GOLDEN_SPECS[filename]).to_yaml()
    path = GOLDEN / filename
    if os.environ.get("KFP_NVRX_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing {path}; run with KFP_NVRX_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{filename} changed; review and regenerate the golden file"


def test_p5_manifest_has_what_p5_needs() -> None:
    m = render_pytorchjob(GOLDEN_SPECS["pytorchjob_p5.yaml"]).to_dict()
    spec, c = m["spec"], _container(m)
    # maxRestarts: ft_launcher's backstop, one over the job's resilience.max_restarts (3)
    assert spec["elasticPolicy"] == {"maxReplicas": 4, "maxRestarts": 4, "minReplicas": 2,
                                     "rdzvBackend": "c10d"}
    assert spec["nprocPerNode"] == "8" and _worker(m)["replicas"] == 4
    assert _worker(m)["restartPolicy"] == "ExitCode"
    assert spec["runPolicy"]["cleanPodPolicy"] == "Running"
    assert c["name"] == "pytorch" and c["image"] == IMAGE
    req, lim = c["resources"]["requests"], c["resources"]["limits"]
    assert req["nvidia.com/gpu"] == lim["nvidia.com/gpu"] == "8"
    assert req["vpc.amazonaws.com/efa"] == lim["vpc.amazonaws.com/efa"] == "32"
    assert req["hugepages-2Mi"] == lim["hugepages-2Mi"] == "5120Mi"
    assert {"cpu", "memory"} <= set(req)
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    pod = _worker(m)["template"]["spec"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    shm = [v for v in pod["volumes"] if v["name"] == "dshm"][0]["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": "512Gi"}
    claim = [v for v in pod["volumes"] if "persistentVolumeClaim" in v][0]
    assert claim["persistentVolumeClaim"]["claimName"] == "fsx-claim"
    env = _env(m)
    assert env["NCCL_SOCKET_IFNAME"] == "^lo,docker,veth"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # aws-ofi-nccl >= 1.7 picks these per platform: we do not set them (users may).
    assert not set(OBSOLETE) & set(env) and not any(k.startswith("RDMAV_") for k in env)
    assert "NCCL_NVLS_ENABLE" not in env  # only with in-process restart
    meta = m["metadata"]
    assert meta["labels"][naming.RUN_ID_KEY] == RUN_ID
    assert meta["annotations"][naming.RUN_ID_KEY] == RUN_ID
    assert meta["annotations"][naming.VERSION_KEY] == meta["labels"][naming.VERSION_KEY]


def test_container_command_is_the_launch_local_builder() -> None:
    """One builder: the pod command is exactly ft_launcher_argv with $(POD_IP), behind the
    entrypoint that reports a SIGTERM stop as 143 (core/pod_entry.py)."""
    for spec in GOLDEN_SPECS.values():
        rendered = render_pytorchjob(spec)
        res = load_config(spec.config, spec.overrides).resilience
        expected = ft_launcher_argv(
            res, TrainerArgs(spec.config, rendered.run_dir, list(spec.overrides), spec.faults),
            local_addr="$(POD_IP)", nic_monitor=get_profile(spec.instance_type).nic_monitor)
        command = _container(rendered.to_dict())["command"]
        assert command == [*POD_ENTRY, *expected]
        assert "--local-addr=$(POD_IP)" in command
        assert f"--max-restarts={res.max_restarts + 1}" in command  # the backstop: agent_max_restarts
        # No profile watches link_downed: EFA has no such counter (profiles.py).
        assert "--ft-enable-nic-monitor=False" in command
        assert not any(a.startswith("--ft-restart-policy=") for a in command)
        pod = _worker(rendered.to_dict())["template"]["spec"]
        term = res.workers_stop_timeout + res.stop_save_timeout  # a stopped pod saves first
        assert f"--term-timeout={term:g}" in command
        assert pod["terminationGracePeriodSeconds"] > term
        assert any(a.startswith("--ft-rank-heartbeat-timeout=") for a in command)


def test_in_process_restart_env() -> None:
    base = dict(image=IMAGE, pvc="fsx", name="ip", overrides=["resilience.in_process=true"])
    gpu = _env(render_pytorchjob(JobSpec(instance_type="p5.48xlarge", **base)).to_dict())
    for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
                       "TORCH_CPP_LOG_LEVEL": "error", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}.items():
        assert gpu[key] == value
    cpu = _env(render_pytorchjob(JobSpec(instance_type="cpu", **base)).to_dict())
    assert cpu["TORCH_CPP_LOG_LEVEL"] == "error"
    assert not any(k.startswith(("NCCL_", "TORCH_NCCL")) for k in cpu)
    cmd = _container(render_pytorchjob(JobSpec(instance_type="cpu", **base)).to_dict())["command"]
    assert not any("restart-policy" in a for a in cmd)  # any-failed: NVRx's default


def test_user_env_overrides_defaults_and_secrets() -> None:
    m = render_pytorchjob(JobSpec(image=IMAGE, pvc="fsx", name="e", env={"NCCL_DEBUG": "INFO", "X": "1"},
                       secret_env=["HF_TOKEN=hf-secret:token"])).to_dict()
    names = [e["name"] for e in _container(m)["env"]]
    assert names.count("NCCL_DEBUG") == 1 and _env(m)["NCCL_DEBUG"] == "INFO"
    assert _env(m)["HF_TOKEN"] == {"secretKeyRef": {"key": "token", "name": "hf-secret"}}
    assert names[:2] == ["POD_IP", "POD_NAME"]



def test_users_may_set_efa_and_nccl_variables_but_not_ours() -> None:
    efa = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "RDMAV_FORK_SAFE": "1",
           "NCCL_PROTO": "simple", "NCCL_SOCKET_IFNAME": "eth0"}
    env = _env(render_pytorchjob(JobSpec(image=IMAGE, pvc="fsx", name="efa", instance_type="p5.48xlarge",
                              env=efa)).to_dict())
    assert {k: env[k] for k in efa} == efa
    for name, reason in (("MASTER_ADDR", "ft_launcher sets it"), ("POD_IP", "--local-addr"),
                         ("PET_NNODES", "elasticPolicy")):
        with pytest.raises(UserError, match=reason) as err:
            render_pytorchjob(JobSpec(image=IMAGE, pvc="fsx", name="own", env={name: "x"}))
        assert err.value.field == "env" and f"{name} is ours" in str(err.value)


OPTIONS = {
    "plain": {},
    "elastic": {"nodes": "1:3"},
    "in_process": {"overrides": ["resilience.in_process=true"]},
    "placement": {"node_selector": {"topology.kubernetes.io/zone": "us-west-2a"},
                  "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                                   "effect": "NoSchedule"}],
                  "pod_priority_class": "training-high", "scheduler_name": "volcano",
                  "service_account": "trainer",
                  "affinity": {"podAntiAffinity": {
                      "requiredDuringSchedulingIgnoredDuringExecution": [{
                          "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "kfp-nvrx"}},
                          "topologyKey": "kubernetes.io/hostname"}]}}},
    "volumes": {"extra_pvcs": ["datasets:/datasets:ro", "scratch:/scratch"], "fs_group": 1000,
                "secret_env": ["WANDB_API_KEY=wandb:key"], "env": {"A": "b"}},
    "resources": {"cpu": "90", "memory": "900Gi", "shm_size": "32Gi", "hugepages": "0"},
    "no_deadlines": {"active_deadline_s": None, "ttl_after_finished_s": None},
    # Faults that can fire: ranks below 2 nodes x procs, kill-in-ckpt on a checkpoint step.
    "faults": {"nodes": "2", "faults": ["kill@3", "hang@5/1", "raise@7/0", "kill-in-ckpt@10/1"]},
}


COMBINATIONS = list(itertools.product(sorted(PROFILES), sorted(OPTIONS)))


@pytest.mark.parametrize("profile,option", COMBINATIONS)
def test_every_profile_and_option_validates(profile: str, option: str) -> None:
    """render_pytorchjob() runs the CRD schema (strict), webhook rules and the Pod schema; none may fail."""
    spec = JobSpec(image=IMAGE, pvc="fsx", run_id=RUN_ID, task="train", instance_type=profile,
                   **OPTIONS[option])
    m = render_pytorchjob(spec).to_dict()
    pod = _worker(m)["template"]["spec"]
    c = _container(m)
    if option == "placement":
        assert pod["priorityClassName"] == "training-high" and pod["schedulerName"] == "volcano"
        assert pod["affinity"]["podAntiAffinity"]
        assert {"key": "dedicated", "operator": "Equal", "value": "ml",
                "effect": "NoSchedule"} in pod["tolerations"]
    if option == "volumes":
        mounts = {v["mountPath"]: v.get("readOnly", False) for v in c["volumeMounts"]}
        assert mounts["/datasets"] is True and mounts["/scratch"] is False
        assert pod["securityContext"] == {"fsGroup": 1000, "fsGroupChangePolicy": "OnRootMismatch"}
    if option == "resources":
        assert c["resources"]["requests"]["cpu"] == "90"
        assert "hugepages-2Mi" not in c["resources"]["requests"]
    if option == "no_deadlines":
        assert "activeDeadlineSeconds" not in m["spec"]["runPolicy"]
    if option == "faults":
        assert c["command"].count("--fault") == 4
    if PROFILES[profile].is_gpu:
        assert "nvidia.com/gpu" in c["resources"]["limits"]
        assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == profile
    else:
        assert "limits" not in c["resources"] and "securityContext" not in c
        assert "node.kubernetes.io/instance-type" not in (pod.get("nodeSelector") or {})


def test_p4d_profile_and_gpu_override() -> None:
    m = render_pytorchjob(JobSpec(image=IMAGE, pvc="fsx", name="a100", instance_type="p4d.24xlarge",
                       nproc_per_node=4)).to_dict()
    req = _container(m)["resources"]["requests"]
    assert req["nvidia.com/gpu"] == "4" and req["vpc.amazonaws.com/efa"] == "4"
    assert m["spec"]["nprocPerNode"] == "4"


def test_name_is_stable_and_dns1035() -> None:
    a = naming.derive_name(RUN_ID, "train-fsdp")
    assert a == naming.derive_name(RUN_ID, "train-fsdp")
    assert a != naming.derive_name(RUN_ID.replace("9", "8"), "train-fsdp")
    assert a != naming.derive_name(RUN_ID, "train-fsdp-2")
    for task in ("Train FSDP!!", "123-task", "x" * 200, "", "---"):
        name = naming.derive_name(RUN_ID, task)
        assert naming.DNS1035.match(name) and len(name) <= naming.MAX_DERIVED, name
        naming.check_name(name, 9999)
    spec = JobSpec(image=IMAGE, pvc="fsx", run_id=RUN_ID, task="train-fsdp")
    assert render_pytorchjob(spec).name == a
    assert render_pytorchjob(spec).run_dir == f"/fsx/runs/{a}"


def test_label_values_are_valid_even_for_odd_ids() -> None:
    value = naming.label_value("run id with spaces/and slashes" * 4)
    assert len(value) <= 63 and naming._LABEL_VALUE.match(value)
    m = render_pytorchjob(JobSpec(image=IMAGE, pvc="fsx", run_id="local run #1", task="t")).to_dict()
    assert m["metadata"]["annotations"][naming.RUN_ID_KEY] == "local run #1"
    assert naming._LABEL_VALUE.match(m["metadata"]["labels"][naming.RUN_ID_KEY])


def test_yaml_round_trips_for_kubectl() -> None:
    rendered = render_pytorchjob(GOLDEN_SPECS["pytorchjob_cpu.yaml"])
    assert yaml.safe_load(rendered.to_yaml()) == rendered.to_dict()
