"""Bad job input -> one UserError naming the field; each validation layer catches its own faults."""

from __future__ import annotations

import copy

import pytest
from support.rendering import render_pytorchjob

from kfp_nvrx.components.cli import main as cli
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.resolve import resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.launch.kube import validation
from kfp_nvrx.components.launch.pytorchjob import validate
from kfp_nvrx.components.launch.pytorchjob.render import build_pytorchjob

IMAGE = "registry.example/kfp-nvrx-trainer:0.1.0"
OK = dict(image=IMAGE, pvc="fsx", name="job")

BAD_SPECS = [
    ({"nodes": "0"}, "nodes"),
    ({"nodes": "3:2"}, "nodes"),
    ({"nodes": "two"}, "nodes"),
    ({"nodes": "1:2:3"}, "nodes"),
    ({"nproc_per_node": 9}, "nproc_per_node"),
    ({"nproc_per_node": 0}, "nproc_per_node"),
    ({"name": "Bad_Name"}, "name"),
    ({"name": "9lives"}, "name"),
    ({"name": "x" * 60}, "name"),
    ({"instance_type": "p6.48xlarge"}, "instance_type"),
    ({"pvc": ""}, "pvc"),
    ({"pvc": "Not_A_Claim"}, "pvc"),
    ({"image": ""}, "image"),
    ({"image": "has space:1"}, "image"),
    ({"overrides": ["resilience.heartbeat_timeout=-5"]}, "resilience.heartbeat_timeout"),
    ({"overrides": ["resilience.max_restarts=-1"]}, "resilience.max_restarts"),
    ({"overrides": ["train.nope=1"]}, "train.nope"),
    ({"overrides": ["no-equals"]}, "overrides"),
    ({"config": "no-such-preset"}, "config"),
    ({"active_deadline_s": -1}, "active_deadline_s"),
    ({"active_deadline_s": 0}, "active_deadline_s"),
    ({"ttl_after_finished_s": -3}, "ttl_after_finished_s"),
    ({"backoff_limit": -1}, "backoff_limit"),
    ({"faults": ["explode@3"]}, "faults"),
    ({"faults": ["kill@0"]}, "faults"),
    ({"faults": ["kill"]}, "faults"),
    ({"memory": "lots"}, "memory"),
    ({"shm_size": "-1Gi"}, "shm_size"),
    ({"env": {"POD_IP": "1.2.3.4"}}, "env"),
    ({"env": {"PET_NNODES": "4"}}, "env"),
    ({"env": {"MASTER_PORT": "1234"}}, "env"),
    ({"env": {"1BAD": "x"}}, "env"),
    ({"secret_env": ["TOKEN"]}, "secret_env"),
    ({"secret_env": ["NCCL_DEBUG=s:k"]}, "secret_env"),
    ({"extra_pvcs": ["data"]}, "extra_pvcs"),
    ({"extra_pvcs": ["data:relative"]}, "extra_pvcs"),
    ({"extra_pvcs": ["data:/fsx"]}, "extra_pvcs"),
    ({"run_dir": "/tmp/run"}, "run_dir"),
    ({"run_dir": "runs/x"}, "run_dir"),
    ({"mount": "fsx"}, "mount"),
    ({"config": "/home/me/my.yaml"}, "config"),
    ({"overrides": ["data.path=/home/me/data"]}, "data.path"),
    # Relative: each pod would resolve it in its own working directory (issue 30.17).
    ({"overrides": ["data.path=data/corpus"]}, "data.path"),
    ({"overrides": ["checkpoint.init_from=models/m"]}, "checkpoint.init_from"),
    ({"instance_type": "cpu", "efa": 4}, "efa"),
    ({"efa": -1}, "efa"),
    ({"image_pull_policy": "Sometimes"}, "image_pull_policy"),
]


@pytest.mark.parametrize("override,field", BAD_SPECS,
                         ids=[f"{f}:{list(o.values())[0]!s:.20}" for o, f in BAD_SPECS])
def test_bad_spec_names_the_field(override: dict, field: str) -> None:
    with pytest.raises(UserError) as err:
        render_pytorchjob(JobSpec(**{**OK, **override}))
    assert err.value.field == field, err.value
    assert "\n" not in err.value.one_line()


def test_config_file_on_the_shared_volume_is_accepted(tmp_path) -> None:
    cfg = tmp_path / "my.yaml"
    cfg.write_text("train: {steps: 3}\n")
    rendered = render_pytorchjob(JobSpec(**{**OK, "mount": str(tmp_path), "config": str(cfg)}))
    assert rendered.config.train.steps == 3


def _manifest() -> dict:
    return build_pytorchjob(resolve(JobSpec(**OK, instance_type="p5.48xlarge"))).to_dict()


def _container(m: dict) -> dict:
    return m["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


def test_crd_schema_is_strict() -> None:
    m = _manifest()
    m["spec"]["elasticPolicy"]["rdzvBackned"] = "c10d"  # typo: unknown field
    with pytest.raises(UserError) as err:
        validate.validate_schema(m)
    assert err.value.field == "spec.elasticPolicy" and "rdzvBackned" in err.value.message
    # The same manifest passes the upstream (non-strict) schema: strictness is ours.
    import jsonschema

    jsonschema.Draft7Validator(validate.crd_schema(strict=False)).validate(m)


def test_crd_schema_types_and_quantities() -> None:
    m = _manifest()
    _container(m)["resources"]["requests"]["memory"] = "lots"
    with pytest.raises(UserError, match="memory"):
        validate.validate_schema(m)
    m = _manifest()
    m["spec"]["runPolicy"]["backoffLimit"] = "3"
    with pytest.raises(UserError) as err:
        validate.validate_schema(m)
    assert err.value.field == "spec.runPolicy.backoffLimit"


def test_strict_mode_closes_only_declared_objects() -> None:
    schema = {"type": "object", "properties": {
        "closed": {"type": "object", "properties": {"a": {"type": "string"}}},
        "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                 "properties": {"a": {"type": "string"}}},
        "map": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object"},
    }}
    strict = validation.strict(schema)
    assert strict["additionalProperties"] is False
    props = strict["properties"]
    assert props["closed"]["additionalProperties"] is False
    assert "additionalProperties" not in props["open"]
    assert props["map"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in props["free"]
    assert "additionalProperties" not in schema  # the input is not modified


WEBHOOK_CASES = [
    (lambda m: m["metadata"].update(name="Bad.Name"), "metadata.name"),
    (lambda m: m["spec"]["pytorchReplicaSpecs"].update(
        Chief=copy.deepcopy(m["spec"]["pytorchReplicaSpecs"]["Worker"])),
     "spec.pytorchReplicaSpecs.Chief"),
    (lambda m: _container(m).update(name="trainer"),
     "spec.pytorchReplicaSpecs.Worker.template.spec.containers"),
    (lambda m: _container(m).update(image=""),
     "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].image"),
    (lambda m: m["spec"]["pytorchReplicaSpecs"].update(
        Master={**copy.deepcopy(m["spec"]["pytorchReplicaSpecs"]["Worker"]), "replicas": 2}),
     "spec.pytorchReplicaSpecs.Master.replicas"),
    (lambda m: m["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas=0),
     "spec.pytorchReplicaSpecs.Worker.replicas"),
    (lambda m: m["spec"]["elasticPolicy"].update(nProcPerNode=8),
     "spec.elasticPolicy.nProcPerNode"),
    (lambda m: m["spec"]["elasticPolicy"].update(minReplicas=5, maxReplicas=2),
     "spec.elasticPolicy.minReplicas"),
    (lambda m: m["spec"]["pytorchReplicaSpecs"].update(
        Master=m["spec"]["pytorchReplicaSpecs"].pop("Worker") | {"replicas": 1}),
     "spec.pytorchReplicaSpecs.Worker"),
    (lambda m: m["spec"]["pytorchReplicaSpecs"]["Worker"].update(restartPolicy="Sometimes"),
     "spec.pytorchReplicaSpecs.Worker.restartPolicy"),
    (lambda m: m["spec"]["runPolicy"].update(cleanPodPolicy="Some"),
     "spec.runPolicy.cleanPodPolicy"),
    (lambda m: m["spec"]["runPolicy"].update(managedBy="me"), "spec.runPolicy.managedBy"),
    (lambda m: m["spec"]["runPolicy"].update(activeDeadlineSeconds=-1),
     "spec.runPolicy.activeDeadlineSeconds"),
]


@pytest.mark.parametrize("mutate,field", WEBHOOK_CASES, ids=[f for _, f in WEBHOOK_CASES])
def test_webhook_rules(mutate, field: str) -> None:
    m = _manifest()
    validate.validate_webhook(m)  # the unmodified manifest passes
    mutate(m)
    with pytest.raises(UserError) as err:
        validate.validate_webhook(m)
    assert err.value.field == field


POD_CASES = [
    (lambda c: c["resources"]["limits"].update({"nvidia.com/gpu": "4"}), "resources"),
    (lambda c: c["resources"]["requests"].pop("cpu") and c["resources"]["requests"].pop("memory"),
     "resources"),
    (lambda c: c["env"].append({"name": "NCCL_DEBUG", "value": "INFO"}), "env"),
    (lambda c: c["volumeMounts"].append({"name": "nope", "mountPath": "/x"}), "volumeMounts"),
    (lambda c: c["volumeMounts"].append({"name": "dshm", "mountPath": "/fsx"}), "volumeMounts"),
]


@pytest.mark.parametrize("mutate,part", POD_CASES)
def test_pod_rules_the_schema_cannot_express(mutate, part: str) -> None:
    m = _manifest()
    validate.validate_pod(m)
    mutate(_container(m))
    with pytest.raises(UserError) as err:
        validate.validate_pod(m)
    assert err.value.field.endswith(f"containers[0].{part}"), err.value.field


def test_pod_schema_via_kubernetes_validate() -> None:
    m = _manifest()
    pod = m["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    pod["restartPolicy"] = 5  # a type error only the core Pod schema sees in this layer
    with pytest.raises(UserError) as err:
        validate.validate_pod(m)
    assert "Pod schema" in err.value.message
    assert err.value.field == "spec.pytorchReplicaSpecs.Worker.template.spec.restartPolicy"
    assert validate.worker_pod(_manifest())["metadata"]["name"] == "job-worker-0"


# -- CLI: render-job ---------------------------------------------------------------------------


def test_render_job_cli_stdout_and_out(tmp_path, capsys) -> None:
    args = ["render-job", "--instance-type", "cpu", "--image", IMAGE, "--pvc", "fsx",
            "--name", "demo", "--nodes", "1:2", "--set", "train.steps=6", "checkpoint.interval=3",
            "--fault", "kill@4/1", "--toleration", "dedicated=ml:NoSchedule",
            "--node-selector", "pool=cpu", "--env", "A=1", "--affinity",
            '{"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}']
    assert cli.main(args) == 0
    import yaml

    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["metadata"]["name"] == "demo"
    cmd = _container(printed)["command"]
    assert cmd[cmd.index("--fault") + 1] == "kill@4/1"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"] == ["train.steps=6",
                                                                        "checkpoint.interval=3"]
    out = tmp_path / "sub" / "job.yaml"
    assert cli.main([*args, "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == printed


@pytest.mark.parametrize("extra,field", [
    (["--nodes", "0"], "--nodes"), (["--nodes", "4:2"], "--nodes"),
    (["--gpus-per-node", "16"], "--nproc-per-node"), (["--name", "UPPER"], "--name"),
    (["--instance-type", "p9"], "--instance-type"), (["--pvc", ""], "--pvc"),
    (["--set", "resilience.step_timeout=-1"], "resilience.step_timeout"),
    (["--active-deadline", "-10"], "--active-deadline"), (["--toleration", "x"], "--toleration"),
    (["--affinity", "[1, 2]"], "--affinity"), (["--env", "NOEQUALS"], "--env"),
])
def test_render_job_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, extra, field) -> None:
    out = tmp_path / "job.yaml"
    args = ["render-job", "--image", IMAGE, "--pvc", "fsx", "--name", "demo", "--out", str(out)]
    assert cli.main([*args, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {field}:" in err, err
    assert not out.exists() and not list(tmp_path.iterdir())
