"""JobSpec -> TrainJob (Kubeflow Trainer v2): goldens, shapes, same meaning as the PyTorchJob,
refusals, strict validation and the ft_launcher command under NVRx's own parser.

Regenerate the golden files after an intended change with ``KFP_NVRX_UPDATE_GOLDEN=1 pytest
tests/unit/test_jobspec_trainjob.py`` and review the diff.
"""

from __future__ import annotations

import copy
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.golden_specs import IMAGE, golden_specs
from support.rendering import render_pytorchjob, render_trainjob

from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.core.launch_command import (
    FT_LAUNCHER,
    Rendezvous,
    TrainerArgs,
    ft_launcher_argv,
)
from kfp_nvrx.components.core.pod_entry import PEER_WAIT_ENV
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.pod import POD_ENTRY
from kfp_nvrx.components.launch.jobspec.profiles import get_profile
from kfp_nvrx.components.launch.jobspec.resolve import resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.trainjob.runtime import build_runtime
from kfp_nvrx.components.launch.trainjob.validate import (
    CLUSTER_RUNTIME_CRD,
    RUNTIME_CRD,
    TRAINJOB_CRD,
    node_pod,
    validate_schema,
    validate_trainjob,
)

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"

GOLDEN_SPECS = golden_specs("trainjob", p5_nodes="4")


@pytest.mark.parametrize("filename", sorted(GOLDEN_SPECS))
def test_golden_trainjob(filename: str) -> None:
    text = render_trainjob(GOLDEN_SPECS[filename]).to_yaml()
    path = GOLDEN / filename
    if os.environ.get("KFP_NVRX_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing {path}; run with KFP_NVRX_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{filename} changed; review and regenerate the golden file"


def test_shipped_runtime_is_the_one_the_code_validates_against() -> None:
    shipped = yaml.safe_load((ROOT / "images/deploy/base/trainer-runtime.yaml").read_text())
    assert shipped == build_runtime()
    validate_schema(shipped, RUNTIME_CRD)


SHAPES = list(itertools.product([1, 2, 8, 16], ["p5.48xlarge", "p4d.24xlarge", "cpu"],
                                ["plain", "secrets", "placement"]))


@pytest.mark.parametrize("nodes,profile,option", SHAPES)
def test_every_shape_validates_strictly(nodes: int, profile: str, option: str) -> None:
    extra: dict = {}
    if option == "secrets":
        extra = dict(secret_env=["HF_TOKEN=hf-token:token"], env={"MY_FLAG": "1"})
    if option == "placement":
        extra = dict(node_selector={"karpenter.sh/capacity-type": "on-demand"},
                     tolerations=[{"key": "team", "operator": "Equal", "value": "ml",
                                   "effect": "NoSchedule"}], fs_group=1000,
                     service_account="trainer", extra_pvcs=["models:/models:ro"])
    spec = JobSpec(image=IMAGE, pvc="fsx", run_id=f"run-{nodes}", nodes=str(nodes),
                   instance_type=profile, **extra)
    rendered = render_trainjob(spec)  # validates: CRD schemas, rules, node pod
    job = rendered.to_dict()
    assert job["spec"]["trainer"]["numNodes"] == nodes
    validate_trainjob(job, rendered.runtime)


def _pod(spec: JobSpec) -> dict:
    return node_pod(render_trainjob(spec).to_dict(), build_runtime())


@pytest.mark.parametrize("filename", sorted(GOLDEN_SPECS))
def test_same_meaning_as_the_pytorchjob(filename: str) -> None:
    spec = copy.deepcopy(GOLDEN_SPECS[filename])
    v1 = render_pytorchjob(spec).to_dict()["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    v2 = _pod(spec)
    c1, c2 = v1["spec"]["containers"][0], v2["spec"]["containers"][0]
    # What the runtime gives every pod, for TrainJobs that bring no command or volumes (the
    # Kubeflow SDK's): the TrainJob's name in the env; its claim at /fsx, which stays beside a
    # job's own mount elsewhere (strategic merge keys mounts by path).
    own_mount = [m for m in c2["volumeMounts"] if m not in c1["volumeMounts"]]
    assert own_mount in ([], [{"name": "shared", "mountPath": "/fsx"}]), own_mount
    c2 = {**c2, "env": [e for e in c2["env"] if e["name"] != "KFP_NVRX_TRAINJOB"]}
    for key in ("image", "resources", "securityContext"):
        assert c1.get(key) == c2.get(key), key
    by_path = sorted((m for m in c2["volumeMounts"] if m not in own_mount),
                     key=lambda m: m["mountPath"])
    assert by_path == sorted(c1["volumeMounts"], key=lambda m: m["mountPath"])
    pet = {e["name"] for e in c2["env"] if e["name"].startswith("PET_")}
    # The one difference on purpose: a PyTorchJob's pod that lost a peer exits 200 at once, a
    # TrainJob's waits to be stopped first (pod_entry; docs/eks.md, the failure policies).
    v1_env = [e for e in c1["env"] if e != {"name": PEER_WAIT_ENV, "value": "0"}]
    assert len(v1_env) == len(c1["env"]) - 1
    assert [e for e in c2["env"] if e["name"] not in pet] == v1_env
    for key in ("volumes", "nodeSelector", "tolerations", "affinity", "securityContext",
                "terminationGracePeriodSeconds", "serviceAccountName"):
        assert v1["spec"].get(key) == v2["spec"].get(key), key
    assert v1["metadata"]["labels"].items() <= v2["metadata"]["labels"].items()
    assert v2["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    # the same builder's command (NVRx flags, trainer flags), with v2's rendezvous flags added
    rdzv = [a for a in c2["command"] if a.startswith(("--rdzv-endpoint=", "--rdzv-id="))]
    assert len(rdzv) == 2
    assert [a for a in c2["command"] if a not in rdzv] == c1["command"]


def test_user_text_in_the_command_is_escaped_like_the_pytorchjob() -> None:
    # The kubelet expands $(VAR) in a container command (secret env values included).
    spec = JobSpec(image=IMAGE, pvc="fsx", name="esc", nodes="2", instance_type="cpu",
                   secret_env=["HF_TOKEN=hf-token:token"], run_dir="/fsx/runs/a$(HF_TOKEN)")
    command = render_trainjob(spec).job["spec"]["trainer"]["command"]
    assert command[command.index("--run-dir") + 1] == "/fsx/runs/a$$(HF_TOKEN)"


def test_command_is_the_one_builder_with_v2_rendezvous() -> None:
    spec = GOLDEN_SPECS["trainjob_p5.yaml"]
    rendered = render_trainjob(spec)
    res = load_config(spec.config, spec.overrides).resilience
    expected = ft_launcher_argv(
        res, TrainerArgs(spec.config, rendered.run_dir, list(spec.overrides), spec.faults),
        local_addr="$(POD_IP)", nic_monitor=get_profile(spec.instance_type).nic_monitor,
        rdzv=Rendezvous("$(PET_MASTER_ADDR):$(PET_MASTER_PORT)", rendered.name))
    assert rendered.job["spec"]["trainer"]["command"] == [*POD_ENTRY, *expected]


def _expand(arg: str, env: dict[str, str]) -> str:
    """Expand ``$(VAR)`` the way the kubelet does for a container command."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)


@pytest.mark.parametrize("filename", sorted(GOLDEN_SPECS))
def test_nvrx_parser_accepts_the_command_under_v2_env(filename: str) -> None:
    """NVRx's own ft_launcher parser, in a clean process with exactly v2's environment."""
    spec = GOLDEN_SPECS[filename]
    pod = _pod(spec)
    c = pod["spec"]["containers"][0]
    name = render_trainjob(spec).name
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    env.update(PET_NODE_RANK="1", POD_IP="10.0.0.7")
    assert env["PET_MASTER_ADDR"] == f"{name}-node-0-0.{name}"
    assert c["command"][:len(POD_ENTRY)] == POD_ENTRY
    assert c["command"][len(POD_ENTRY)] == FT_LAUNCHER  # NVRx's ft_launcher, its parser below
    argv = [_expand(a, env) for a in c["command"][len(POD_ENTRY) + 1:]]
    probe = (
        "import json, sys\n"
        "from nvidia_resiliency_ext.fault_tolerance import launcher\n"
        "args = launcher.get_args_parser().parse_args(sys.argv[1:])\n"
        "print(json.dumps({'endpoint': launcher.get_rdzv_endpoint(args), 'id': args.rdzv_id,"
        " 'nnodes': args.nnodes, 'nproc': args.nproc_per_node, 'rank': args.node_rank,"
        " 'backend': args.rdzv_backend, 'local_addr': args.local_addr,"
        " 'max_restarts': args.max_restarts, 'module': args.module,"
        " 'script': args.training_script, 'script_args': args.training_script_args}))\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    out = subprocess.run([sys.executable, "-c", probe, *argv], env={**clean, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["endpoint"] == f"{name}-node-0-0.{name}:29500"
    assert got["id"] == name and got["backend"] == "c10d"
    assert got["nnodes"] == spec.nodes and str(got["nproc"]) == str(resolve(spec).procs_per_node)
    assert str(got["rank"]) == "1" and got["local_addr"] == "10.0.0.7"
    assert got["module"] and got["script"] == "kfp_nvrx.components.training.trainer"
    assert got["script_args"][:2] == ["--config", spec.config]


@pytest.mark.parametrize("change,field", [
    (dict(namespace="Team_A"), "namespace"),
    (dict(service_account="bad name"), "service_account"),
    (dict(node_selector={"node.kubernetes.io/instance-type": "p5 48xl"}), "node_selector"),
    (dict(fs_group=-1), "fs_group"),
    (dict(mount="/proc"), "mount"),
])
def test_cluster_fields_are_checked_as_for_the_pytorchjob(change: dict, field: str) -> None:
    spec = JobSpec(image=IMAGE, pvc="fsx", **{"name": "job", "nodes": "2", **change})
    for render in (render_trainjob, render_pytorchjob):
        with pytest.raises(UserError) as err:
            render(spec)
        assert err.value.field == field and "\n" not in str(err.value)


@pytest.mark.parametrize("change,field", [
    (dict(nodes="2:4"), "nodes"),
    (dict(pod_priority_class="high"), "pod_priority_class"),
    (dict(scheduler_name="volcano"), "scheduler_name"),
    (dict(image_pull_policy="Always"), "image_pull_policy"),
    (dict(ttl_after_finished_s=60), "ttl_after_finished_s"),
    (dict(backoff_limit=9), "backoff_limit"),
    (dict(env={"PET_MASTER_PORT": "1"}), "env"),
    (dict(name="a" * 55, nodes="16"), "name"),
])
def test_what_v2_cannot_express_is_refused(change: dict, field: str) -> None:
    spec = JobSpec(image=IMAGE, pvc="fsx", **{"name": "job", "nodes": "2", **change})
    with pytest.raises(UserError) as err:
        render_trainjob(spec)
    assert err.value.field == field and "\n" not in str(err.value)


def test_name_limit_counts_the_jobset_pod_name() -> None:
    # The JobSet webhook's limit: <name>-node-0-<index>-xxxxx (the Job controller's suffix).
    render_trainjob(JobSpec(image=IMAGE, pvc="fsx", name="a" * 48, nodes="10"))  # a..-node-0-9
    with pytest.raises(UserError, match="node-0-10"):
        render_trainjob(JobSpec(image=IMAGE, pvc="fsx", name="a" * 48, nodes="11"))


@pytest.mark.parametrize("mutate,field", [
    (lambda j: j["spec"]["trainer"].update(numNodess=2), "spec.trainer"),
    (lambda j: j["spec"].update(elasticPolicy={}), "spec"),
    (lambda j: j["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "3"}),
     "spec.trainer.env"),
    (lambda j: j["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"][0].update(name="worker"), "spec.runtimePatches"),
    (lambda j: j["metadata"].update(name="Bad_Name"), "metadata.name"),
    (lambda j: j["spec"]["trainer"]["resourcesPerNode"]["limits"].update(
        {"nvidia.com/gpu": "4"}), "node pod"),
])
def test_validation_is_strict(mutate, field: str) -> None:
    rendered = render_trainjob(GOLDEN_SPECS["trainjob_p5.yaml"])
    job = rendered.to_dict()
    mutate(job)
    with pytest.raises(UserError) as err:
        validate_trainjob(job, rendered.runtime)
    assert err.value.field.startswith(field), err.value.field
    validate_schema(rendered.to_dict(), TRAINJOB_CRD)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "render-job", *args],
                          capture_output=True, text=True, timeout=120)


def test_render_job_cli_trainjob_with_runtime_and_refusal() -> None:
    out = _cli("--job-api", "trainjob", "--with-runtime", "--image", IMAGE, "--pvc", "fsx",
               "--name", "demo", "--nodes", "2", "--instance-type", "cpu")
    assert out.returncode == 0, out.stderr
    runtime, job = list(yaml.safe_load_all(out.stdout))
    assert runtime == build_runtime() and job["kind"] == "TrainJob"
    bad = _cli("--job-api", "trainjob", "--image", IMAGE, "--pvc", "fsx", "--nodes", "2:4")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--nodes" in bad.stderr and "elastic" in bad.stderr


def test_cluster_training_runtime_option_validates_against_its_own_crd() -> None:
    spec = JobSpec(image=IMAGE, pvc="fsx", name="demo", nodes="2", namespace="team-a")
    rendered = render_trainjob(spec, "kfp-nvrx-ft", "ClusterTrainingRuntime")
    ref = rendered.job["spec"]["runtimeRef"]
    assert ref == {"name": "kfp-nvrx-ft", "kind": "ClusterTrainingRuntime",
                   "apiGroup": "trainer.kubeflow.org"}
    # cluster-scoped: no namespace; otherwise the very runtime we ship
    assert rendered.runtime["kind"] == "ClusterTrainingRuntime"
    assert "namespace" not in rendered.runtime["metadata"]
    shipped = build_runtime()
    assert rendered.runtime["spec"] == shipped["spec"]
    validate_schema(rendered.runtime, CLUSTER_RUNTIME_CRD)
    # the cluster CRD is the one applied: an unknown field in it is rejected
    bad = copy.deepcopy(rendered.runtime)
    bad["spec"]["mlPolicy"]["elastic"] = {}
    with pytest.raises(UserError) as err:
        validate_trainjob(rendered.job, bad)
    assert err.value.field == "spec.mlPolicy"
    # a reference to one kind is not satisfied by a runtime of the other
    with pytest.raises(UserError) as err:
        validate_trainjob(rendered.job, shipped)
    assert err.value.field == "spec.runtimeRef"
    with pytest.raises(UserError) as err:
        render_trainjob(spec, "kfp-nvrx-ft", "Runtime")
    assert err.value.field == "runtime_kind"


def test_render_job_cli_prints_a_cluster_training_runtime() -> None:
    out = _cli("--job-api", "trainjob", "--with-runtime", "--runtime-kind",
               "ClusterTrainingRuntime", "--runtime", "ft-shared", "--image", IMAGE, "--pvc",
               "fsx", "--name", "demo", "--namespace", "team-a", "--instance-type", "cpu")
    assert out.returncode == 0, out.stderr
    runtime, job = list(yaml.safe_load_all(out.stdout))
    assert runtime["kind"] == "ClusterTrainingRuntime" and runtime["metadata"]["name"] == \
        "ft-shared" and "namespace" not in runtime["metadata"]
    assert job["spec"]["runtimeRef"]["kind"] == "ClusterTrainingRuntime"
    assert job["metadata"]["namespace"] == "team-a"


def test_each_surface_words_the_refusal_for_its_user() -> None:
    """The library names the domain field; the CLI, the component and a pipeline word it."""
    from kfp_nvrx.components.core.fields import CLI, COMPONENT, PIPELINE

    with pytest.raises(UserError) as err:
        render_trainjob(JobSpec(image=IMAGE, pvc="fsx", nodes="2:4"))
    assert err.value.field == "nodes" and "`job_api=pytorchjob`" in err.value.message
    cli = CLI.reword(err.value).one_line()
    assert cli.startswith("--nodes: ") and "use --nodes N, or --job-api pytorchjob" in cli
    kfp = COMPONENT.reword(err.value).one_line()
    assert kfp.startswith("nodes: ") and "use nodes=N, or job_api=pytorchjob" in kfp
    assert PIPELINE.reword(err.value).field == "--param nodes"
    with pytest.raises(UserError) as err:
        render_trainjob(JobSpec(image=IMAGE, pvc="Not_A_Claim"))
    assert (err.value.field, CLI.word("pvc"), COMPONENT.word("pvc"), PIPELINE.word("pvc")) == (
        "pvc", "--pvc", "pvc_name", "--param pvc_name")
    assert PIPELINE.word("train.steps") == "--param overrides (train.steps)" == \
        f"--param overrides ({COMPONENT.word('train.steps')})"
