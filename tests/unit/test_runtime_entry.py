"""The ``kfp-nvrx-ft`` runtime's own command (core.runtime_entry): a TrainJob made by the Kubeflow
SDK (``TrainerClient.train`` with ``CustomTrainerContainer``: image, nodes, resources, env; the
``TrainerArgs`` option) runs the ft_launcher line ``kfp-nvrx launch`` renders for the same run.

The SDK's TrainJob is built by the SDK's own code (kubeflow 0.5.0: its runtime parsing and its
TrainJob spec builder, everything but the HTTP call); the pod the controllers make of it is our
validator's (runtime + trainer fields + the torch plugin's PET_* env). The real controllers run it
in tests/cluster/test_sdk.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.rendering import render_trainjob

from kfp_nvrx.components.core import runtime_entry as re_
from kfp_nvrx.components.core.launch_command import FT_LAUNCHER
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.pod import POD_ENTRY
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.trainjob.runtime import build_runtime
from kfp_nvrx.components.launch.trainjob.validate import node_pod, validate_trainjob

NS = "kubeflow-user-example-com"
NAME = "sdk-job"
SETS = ["data.path=/fsx/data/sample", "train.steps=24", "checkpoint.interval=6"]
POD = {"status.podIP": "10.1.2.3", "metadata.name": f"{NAME}-node-0-0-abcde",
       "metadata.namespace": NS,
       "metadata.labels['jobset.sigs.k8s.io/jobset-name']": NAME,
       "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0"}


def _sdk_trainjob(env: dict[str, str], args: list[str] | None = None) -> dict:
    """What ``TrainerClient().train(runtime="kfp-nvrx-ft", trainer=CustomTrainerContainer(...),
    options=[Name(NAME), TrainerArgs(args)])`` sends (built by the SDK's own code)."""
    from kubeflow.trainer import CustomTrainerContainer
    from kubeflow.trainer.backends.kubernetes.backend import KubernetesBackend
    from kubeflow_trainer_api import models

    runtime_cr = models.TrainerV1alpha1TrainingRuntime.from_dict(build_runtime(namespace=NS))
    backend = object.__new__(KubernetesBackend)  # no cluster: only its pure builders are used
    runtime = backend._KubernetesBackend__get_runtime_from_cr(runtime_cr)
    trainer = CustomTrainerContainer(image="kfp-nvrx-trainer:test", num_nodes=2,
                                     resources_per_node={"cpu": 2, "memory": "4Gi"}, env=env)
    spec = backend._get_trainjob_spec(runtime=runtime, trainer=trainer,
                                      trainer_overrides={"args": args} if args else None)
    job = models.TrainerV1alpha1TrainJob(
        apiVersion="trainer.kubeflow.org/v1alpha1", kind="TrainJob",
        metadata=models.IoK8sApimachineryPkgApisMetaV1ObjectMeta(name=NAME, namespace=NS),
        spec=spec)
    return job.to_dict()


def _pod_env(job: dict) -> tuple[dict[str, str], list[str]]:
    """The node-0 container's env as the kubelet resolves it, and its args."""
    pod = node_pod(job, build_runtime(namespace=NS))
    container = pod["spec"]["containers"][0]
    env: dict[str, str] = {}
    for e in container["env"]:
        env[e["name"]] = (POD[e["valueFrom"]["fieldRef"]["fieldPath"]] if "valueFrom" in e
                          else _expand(e["value"], env))
    return env, container.get("args") or []


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)),
                  text)


def _launched(**kw) -> list[str]:
    """The ft_launcher line ``kfp-nvrx launch`` renders for the same run, as the pod runs it."""
    spec = JobSpec(image="kfp-nvrx-trainer:test", pvc="kfp-nvrx-shared", name=NAME, nodes="2",
                   nproc_per_node=1, instance_type="cpu", namespace=NS, config="tiny", **kw)
    command = render_trainjob(spec).job["spec"]["trainer"]["command"]
    assert command[:len(POD_ENTRY)] == POD_ENTRY
    env = {"POD_IP": POD["status.podIP"], "PET_MASTER_ADDR": f"{NAME}-node-0-0.{NAME}",
           "PET_MASTER_PORT": "29500"}
    return [_expand(a, env) for a in command[len(POD_ENTRY):]]


def test_sdk_env_runs_the_line_the_launcher_renders() -> None:
    job = _sdk_trainjob({"KFP_NVRX_CONFIG": "tiny", "KFP_NVRX_SET": " ".join(SETS),
                         "KFP_NVRX_FAULTS": "kill@14/1"})
    assert "command" not in job["spec"]["trainer"]  # the runtime's command runs
    validate_trainjob(job, build_runtime(namespace=NS))  # our runtime's rules accept it
    env, args = _pod_env(job)
    assert env["PET_NNODES"] == "2" and env["KFP_NVRX_TRAINJOB"] == NAME
    run = re_.read_run(env, args)
    assert run.argv() == _launched(overrides=SETS, faults=["kill@14/1"])
    assert run.trainer.run_dir == f"/fsx/runs/{NAME}"
    assert run.env(env) == {"KFP_NVRX_RUN_DIR": f"/fsx/runs/{NAME}",
                            "KFP_NVRX_RUN_HOLDER": f"k8s:{NS}/{NAME}",
                            "KFP_NVRX_WARM_START": "1"}  # resilience.warm_start, on by default


def test_trainer_args_say_the_same_as_env() -> None:
    job = _sdk_trainjob({"KFP_NVRX_SET": SETS[0]},
                        args=["--config", "tiny", "--set", *SETS[1:], "--fault", "kill@14/1",
                              "--run-dir", "/fsx/runs/mine"])
    env, args = _pod_env(job)
    assert args[:2] == ["--config", "tiny"]
    run = re_.read_run(env, args)
    assert run.argv() == _launched(overrides=SETS, faults=["kill@14/1"],
                                   run_dir="/fsx/runs/mine")


def test_gpu_pods_get_the_nccl_defaults_and_user_env_wins() -> None:
    env, args = _pod_env(_sdk_trainjob({"KFP_NVRX_CONFIG": "tiny", "NCCL_DEBUG": "INFO"}))
    run = re_.read_run(env, args, gpu=True)
    added = run.env(env)
    assert added["NCCL_SOCKET_IFNAME"] == "^lo,docker,veth" and "NCCL_DEBUG" not in added
    assert added["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"/fsx/runs/{NAME}/nccl_trace/rank_"


BASE = {"POD_IP": "10.1.2.3", "POD_NAMESPACE": NS, "KFP_NVRX_TRAINJOB": NAME,
        "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "29500", "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1"}


@pytest.mark.parametrize("env,args,field", [
    ({}, [], "KFP_NVRX_CONFIG"),
    ({"KFP_NVRX_CONFIG": "tiny"}, ["--config", "8b"], "KFP_NVRX_CONFIG"),
    ({"KFP_NVRX_CONFIG": "tinny"}, [], "config"),
    ({"KFP_NVRX_CONFIG": "tiny", "KFP_NVRX_SET": "train.stepz=3"}, [], "train"),
    ({"KFP_NVRX_CONFIG": "tiny", "KFP_NVRX_SET": "'unclosed"}, [], "KFP_NVRX_SET"),
    ({"KFP_NVRX_CONFIG": "tiny", "KFP_NVRX_FAULTS": "kill@4/2"}, [], "faults"),
    ({"KFP_NVRX_CONFIG": "tiny", "KFP_NVRX_RUN_DIR": "runs/x"}, [], "KFP_NVRX_RUN_DIR"),
    ({"KFP_NVRX_CONFIG": "tiny", "KFP_NVRX_NIC_MONITOR": "yes"}, [], "KFP_NVRX_NIC_MONITOR"),
    ({"KFP_NVRX_CONFIG": "tiny"}, ["--steps", "3"], "args"),
    ({"KFP_NVRX_CONFIG": "tiny", "KFP_NVRX_TRAINJOB": ""}, [], "KFP_NVRX_TRAINJOB"),
])
def test_bad_input_names_the_setting(env: dict, args: list, field: str) -> None:
    with pytest.raises(UserError) as err:
        re_.read_run({**BASE, **env}, args)
    assert err.value.field.startswith(field), err.value


def test_bad_input_is_one_line_and_exit_2_before_anything_starts(tmp_path: Path) -> None:
    env = {**os.environ, **BASE, "KFP_NVRX_CONFIG": "tiny", "KFP_NVRX_SET": "train.steps=-1",
           "KFP_NVRX_RUN_DIR": str(tmp_path / "run")}
    out = subprocess.run([sys.executable, "-m", "kfp_nvrx.components.core.runtime_entry"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kfp-nvrx runtime: train.steps"), out.stderr
    assert not (tmp_path / "run").exists()  # no claim taken, nothing written


def test_main_hands_its_line_to_the_pod_entry(tmp_path: Path) -> None:
    """A stand-in agent (first on PATH) prints what it was given; the entry's exit code, the
    run-dir claim and the env it set come through pod_entry."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / FT_LAUNCHER
    fake.write_text("#!/bin/sh\necho \"argv: $*\"\necho \"holder: $KFP_NVRX_RUN_HOLDER\"\n"
                    "exit 0\n")
    fake.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, **BASE, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "KFP_NVRX_CONFIG": "tiny", "KFP_NVRX_RUN_DIR": str(run_dir)}
    out = subprocess.run([sys.executable, "-m", "kfp_nvrx.components.core.runtime_entry",
                          "--set", "train.steps=8"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"kfp-nvrx runtime: TrainJob {NS}/{NAME}: tiny --set train.steps=8" in out.stderr
    assert "--rdzv-endpoint=m:29500 --rdzv-id=sdk-job --local-addr=10.1.2.3" in out.stdout
    assert f"holder: k8s:{NS}/{NAME}" in out.stdout
