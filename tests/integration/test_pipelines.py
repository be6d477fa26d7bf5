"""Pipelines: compile, committed YAML is current, platform spec, and local end-to-end runs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kfp_nvrx.components import __version__
from kfp_nvrx.components.cli.main import main
from kfp_nvrx.pipelines.compile import COMPILED_DIR, PIPELINES

FAST = ["train.steps=8", "checkpoint.interval=4", "train.log_every=4"]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """Compile every pipeline in a clean process with the default registry."""
    out = tmp_path_factory.mktemp("compiled")
    done = _compile(out)
    assert done.returncode == 0, done.stderr
    return out


def _docs(path):
    with open(path) as f:
        return list(yaml.safe_load_all(f))


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_committed_yaml_is_current(fresh, name):
    committed = COMPILED_DIR / f"{name}.yaml"
    assert committed.is_file(), f"{committed} missing: run `kfp-nvrx compile` and commit it"
    assert committed.read_text() == (fresh / f"{name}.yaml").read_text(), (
        f"{committed} is stale: run `kfp-nvrx compile` and commit pipelines/compiled/")


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_platform_spec(name):
    spec, platform = _docs(COMPILED_DIR / f"{name}.yaml")
    execs = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(execs) == set(spec["deploymentSpec"]["executors"])
    for label, cfg in execs.items():
        # inside dsl.If the pipeline parameter arrives as 'pipelinechannel--pvc_name'
        param = "pipelinechannel--pvc_name" if label == "exec-promote-model" else "pvc_name"
        assert cfg["pvcMount"] == [{"componentInputParameter": param, "mountPath": "/fsx",
                                    "pvcNameParameter": {"componentInputParameter": param}}]
        assert int(cfg["activeDeadlineSeconds"]) > 0, label
    train = execs["exec-train-fsdp"]
    assert train["emptyDirMounts"] == [{"medium": "Memory", "mountPath": "/dev/shm",
                                        "sizeLimit": "2Gi", "volumeName": "dshm"}]
    assert train["nodeSelector"] == {
        "nodeSelectorJson": {"componentInputParameter": "launcher_node_selector"}}
    assert train["tolerations"] == [
        {"tolerationJson": {"componentInputParameter": "launcher_tolerations"}}]
    assert int(train["activeDeadlineSeconds"]) == 7 * 24 * 3600
    components = f"localhost:5000/kfp-nvrx/kfp-nvrx-components:{__version__}"
    trainer = f"localhost:5000/kfp-nvrx/kfp-nvrx-trainer:{__version__}"
    for label, ex in spec["deploymentSpec"]["executors"].items():
        # steps that run the model need torch: the trainer image; the rest the component image
        torch_steps = ("exec-export-checkpoint", "exec-compare-models")
        assert ex["container"]["image"] == (trainer if label in torch_steps else components)
        assert "pip install" not in json.dumps(ex["container"])
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["trainer_image"]["defaultValue"] == trainer
    assert params["backend"]["defaultValue"] == "kubernetes"
    tasks = spec["root"]["dag"]["tasks"]
    assert tasks["train-fsdp"]["cachingOptions"] == {}  # caching off (enableCache absent)
    for retried in ("prepare-dataset", "export-checkpoint"):
        assert tasks[retried]["retryPolicy"]["maxRetryCount"] == 2


def _compile(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k != "KFP_NVRX_REGISTRY"}
    return subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "compile", "--out",
                           str(tmp_path), *args], env=env, capture_output=True, text=True)


def test_compile_with_registry(tmp_path):
    reg = "123456789012.dkr.ecr.us-west-2.amazonaws.com/kfp-nvrx"
    done = _compile(tmp_path, "--registry", reg, "--pipeline", "fsdp-train")
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["fsdp-train.yaml"]
    text = (tmp_path / "fsdp-train.yaml").read_text()
    assert f"image: {reg}/kfp-nvrx-components:{__version__}" in text
    assert f"image: {reg}/kfp-nvrx-trainer:{__version__}" in text
    assert f"{reg}/kfp-nvrx-trainer:{__version__}" in text and "localhost:5000" not in text


@pytest.mark.parametrize("args, needle", [
    (["--registry", "https://bad"], "--registry:"),
    (["--pipeline", "nope"], "--pipeline: unknown pipeline"),
])
def test_compile_bad_input_one_line(tmp_path, args, needle):
    done = _compile(tmp_path / "out", *args)
    assert done.returncode == 2 and needle in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_fsdp_train_parameters():
    spec, _ = _docs(COMPILED_DIR / "fsdp-train.yaml")
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {"source", "workspace", "pvc_name", "config", "overrides", "faults", "nodes",
            "nproc_per_node", "instance_type", "trainer_image", "backend", "deadline_s",
            "launcher_node_selector", "launcher_tolerations"} <= set(params)
    assert params["workspace"]["defaultValue"] == "/fsx/kfp-nvrx"
    assert params["faults"]["parameterType"] == "LIST"
    assert params["launcher_node_selector"]["parameterType"] == "STRUCT"
    assert set(spec["root"]["outputDefinitions"]["artifacts"]) == {
        "model", "train_metrics", "eval_metrics", "timeline"}
    assert list(spec["root"]["dag"]["tasks"]) == ["export-checkpoint", "prepare-dataset",
                                                  "size-export", "train-fsdp"]


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_surface_defaults_to_the_one_job_api(name):
    """CLI ``launch``, the train component and the pipelines share options.DEFAULT_JOB_API."""
    from kfp_nvrx.components.launch.job_apis import choices
    from kfp_nvrx.components.launch.options import DEFAULT_JOB_API, KubernetesOptions
    from kfp_nvrx.components.train_fsdp.component import train_fsdp

    spec, _ = _docs(COMPILED_DIR / f"{name}.yaml")
    assert spec["root"]["inputDefinitions"]["parameters"]["job_api"]["defaultValue"] \
        == DEFAULT_JOB_API
    # The component's signature holds a literal (KFP runs its source alone): the same value.
    assert train_fsdp.component_spec.inputs["job_api"].default == DEFAULT_JOB_API
    assert KubernetesOptions().job_api == DEFAULT_JOB_API in choices()
    launch = subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "launch", "--help"],
                            capture_output=True, text=True, check=True).stdout
    assert f"default {DEFAULT_JOB_API}" in " ".join(launch.split())


@pytest.mark.parametrize("name", ["fsdp-train", "scheduled-retrain"])
def test_parameter_descriptions_read_plainly(name):
    spec, _ = _docs(COMPILED_DIR / f"{name}.yaml")
    params = spec["root"]["inputDefinitions"]["parameters"]
    for key, param in params.items():
        assert "``" not in param.get("description", ""), key
    assert "JSON list" in params["launcher_tolerations"]["description"]
    assert "JSON list" in params["overrides"]["description"]
    if "faults" in params:
        assert "JSON list" in params["faults"]["description"]


@pytest.mark.parametrize("name", ["fsdp-train", "scheduled-retrain"])
def test_export_step_is_sized_and_placed(name):
    spec, platform = _docs(COMPILED_DIR / f"{name}.yaml")
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["export_memory"]["defaultValue"] == ""
    assert params["export_cpu"]["defaultValue"] == "2"
    assert params["export_node_selector"]["parameterType"] == "STRUCT"
    tasks = spec["root"]["dag"]["tasks"]
    size = tasks["size-export"]["inputs"]["parameters"]
    assert size["config"] == {"componentInputParameter": "config"}
    assert size["export_memory"] == {"componentInputParameter": "export_memory"}
    execs = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    sized = ["exec-export-checkpoint"] + (["exec-compare-models"] if "compare-models" in tasks
                                          else [])
    for label in sized:
        res = spec["deploymentSpec"]["executors"][label]["container"]["resources"]
        memory = "{{$.inputs.parameters['pipelinechannel--size-export-Output']}}"
        assert res["resourceMemoryRequest"] == memory == res["resourceMemoryLimit"], label
        assert res["resourceCpuRequest"] == "{{$.inputs.parameters['pipelinechannel--export_cpu']}}"
        assert execs[label]["nodeSelector"] == {
            "nodeSelectorJson": {"componentInputParameter": "export_node_selector"}}
    task = tasks["export-checkpoint"]["inputs"]["parameters"]
    assert task["pipelinechannel--size-export-Output"] == {
        "taskOutputParameter": {"outputParameterKey": "Output", "producerTask": "size-export"}}


def test_scheduled_retrain_promotes_under_condition():
    spec, _ = _docs(COMPILED_DIR / "scheduled-retrain.yaml")
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {"model_name", "min_improvement", "source"} <= set(params)
    tasks = spec["root"]["dag"]["tasks"]
    cond = tasks["condition-1"]
    assert cond["triggerPolicy"]["condition"] == (
        "inputs.parameter_values['pipelinechannel--compare-models-Output'] == 'promote'")
    inner = spec["components"]["comp-condition-1"]["dag"]["tasks"]
    assert list(inner) == ["promote-model"]
    promoted = ("{{$.inputs.parameters['pipelinechannel--workspace']}}/models/"
                "{{$.inputs.parameters['pipelinechannel--model_name']}}/promoted")
    assert tasks["train-fsdp"]["inputs"]["parameters"]["init_from"]["runtimeValue"][
        "constant"] == promoted
    assert tasks["compare-models"]["cachingOptions"] == {}


# -- kfp-nvrx run-local -------------------------------------------------------------------------

@pytest.mark.parametrize("param, needle", [
    ("bogus=1", "--param bogus: unknown parameter"),
    ("backend=kubernetes", "run-local runs the local backend only"),
    ("overrides=train.nope=1", "--param overrides (train.nope)"),
    ("faults=explode@3", "--param faults"),
    ("faults=kill@100", "--param faults: kill@100 is after the last step (40)"),
    ("nodes=0", "--param nodes"),
    ("config=no-such-preset", "--param config"),
    ("source=/no/such/corpus.jsonl", "--param source: /no/such/corpus.jsonl does not exist"),
])
def test_run_local_bad_params_one_line(tmp_path, capsys, param, needle):
    rc = main(["run-local", "--out", str(tmp_path), "--param", param])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and needle in err, err
    assert not (tmp_path / "pipeline_root").exists()


def test_run_local_scheduled_retrain_needs_a_source(tmp_path, capsys):
    rc = main(["run-local", "--pipeline", "scheduled-retrain", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--param source: /fsx/kfp-nvrx/incoming does not exist" in err, err


def test_run_local_drops_retries_only_in_its_copy():
    from kfp_nvrx.components.cli.commands.run_local import without_retries
    from kfp_nvrx.pipelines.compile import load_pipeline

    pipeline = load_pipeline("scheduled-retrain")
    local_copy = without_retries(pipeline)
    tasks = pipeline.pipeline_spec.root.dag.tasks
    assert tasks["prepare-dataset"].retry_policy.max_retry_count == 2
    assert not local_copy.pipeline_spec.root.dag.tasks["prepare-dataset"].HasField("retry_policy")
    inner = local_copy.pipeline_spec.components["comp-condition-1"].dag.tasks["promote-model"]
    assert not inner.HasField("retry_policy")


def test_run_local_failed_task_exit_1(tmp_path, capsys):
    # passes the up-front checks, then the prepare task fails (one sample document)
    rc = main(["run-local", "--out", str(tmp_path), "--param", "source=sample:1"])
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert rc == 1
    assert last.startswith("kfp-nvrx run-local: fsdp-train failed:") and "prepare-dataset" in last
    assert "\x1b[" not in last
    assert "at least 2 documents" in captured.out  # the task's own error is shown above


@pytest.mark.slow
def test_fsdp_train_end_to_end_with_fault(tmp_path, capsys):
    rc = main(["run-local", "--pipeline", "fsdp-train", "--out", str(tmp_path),
               "--param", f"overrides={json.dumps(FAST)}", "--param", "faults=kill@6/1",
               "--param", "nodes=2", "--param", "source=sample:300"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    table = out[out.index("fsdp-train finished locally:"):]
    for row in ("goodput", "recovery", "eval loss", "model", "timeline"):
        assert f"  {row} " in table
    # Resumed from the newest snapshot every rank holds: the host-memory tier's, or the disk's.
    assert re.search(r"what happened +rank 1 killed at step 6, (resumed from step \d+"
                     r"( \(host memory\))?|restarted from scratch) in [0-9.]+ s, \d+ steps? "
                     r"redone", table), table
    (run_root,) = (tmp_path / "pipeline_root").iterdir()
    model_dir = run_root / "export-checkpoint" / "model"
    assert f"{model_dir}/model.safetensors" in table
    from kfp_nvrx.components.training.export.evaluate import load_exported_model

    assert load_exported_model(model_dir) is not None
    train = json.loads((run_root / "train-fsdp" / "executor_output.json").read_text())
    metrics = train["artifacts"]["metrics"]["artifacts"][0]["metadata"]
    assert metrics["steps_final"] == 8 and metrics["faults"] == 1
    assert metrics["steps_redone"] >= 1 and metrics["goodput"] < 1
    page = (run_root / "train-fsdp" / "timeline").read_text()
    assert "fault: kill at step 6, rank 1" in page and "redone" in page
    export = json.loads((run_root / "export-checkpoint" / "executor_output.json").read_text())
    assert export["artifacts"]["metrics"]["artifacts"][0]["metadata"]["eval_loss"] > 0


@pytest.mark.slow
def test_scheduled_retrain_twice(tmp_path, kfp_local):
    from kfp_nvrx.pipelines.scheduled_retrain import scheduled_retrain

    ws = tmp_path / "ws"
    common = {"source": "sample:300", "workspace": str(ws), "nodes": "1", "model_name": "m",
              "backend": "local"}
    first = scheduled_retrain(**common, overrides=FAST)
    d1 = first.outputs["decision_metrics"].metadata
    assert d1["promote"] == 1 and d1["has_promoted_model"] == 0
    promoted = ws / "models" / "m" / "promoted"
    assert promoted.is_symlink()
    v1 = promoted.resolve()
    weights = (promoted / "model.safetensors").read_bytes()
    assert weights == (Path(first.outputs["model"].path) / "model.safetensors").read_bytes()

    # A far too high learning rate wrecks the warm-started model: it must not be promoted.
    second = scheduled_retrain(**common, overrides=[*FAST, "train.lr=3.0",
                                                    "train.warmup_steps=0"])
    d2 = second.outputs["decision_metrics"].metadata
    assert d2["promote"] == 0 and d2["has_promoted_model"] == 1
    assert d2["candidate_eval_loss"] > d2["promoted_eval_loss"]
    assert promoted.resolve() == v1 and (promoted / "model.safetensors").read_bytes() == weights
    assert len(list((ws / "models" / "m" / "versions").iterdir())) == 1
    # the second run started from the promoted model (warm start), not from scratch
    runs = sorted((ws / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    config = yaml.safe_load((runs[-1] / "config.yaml").read_text())
    assert config["checkpoint"]["init_from"] == str(promoted)


def test_summary_rows_for_scheduled_retrain():
    from kfp import dsl

    from kfp_nvrx.components.cli.commands.run_local import format_table, summary_rows

    outputs = {
        "train_metrics": dsl.Metrics(uri="/x/m", metadata={
            "goodput": 0.5, "steps_final": 8.0, "steps_redone": 2.0, "restarts_total": 1.0,
            "restarts_in_job": 1.0, "recovery_mean_s": 3.25, "recovery_max_s": 3.25,
            "checkpoint_stall_s": 0.1, "final_loss": 2.5}),
        "decision_metrics": dsl.Metrics(uri="/x/d", metadata={
            "promote": 0.0, "candidate_eval_loss": 3.0, "promoted_eval_loss": 2.0}),
        "model": dsl.Model(uri="/x/model"), "timeline": dsl.HTML(uri="/x/timeline"),
    }
    table = dict(summary_rows("scheduled-retrain", outputs, 12.0))
    assert table["goodput"] == "50.0%" and table["steps"] == "8 final, 2 redone"
    assert table["restarts"] == "1 (in-job 1, in-process 0, pod 0)"
    assert table["recovery"] == "mean 3.25 s, max 3.25 s"
    assert table["decision"] == "keep" and table["promoted eval loss"] == "2.0000"
    assert table["model"] == "/x/model/model.safetensors" and table["timeline"] == "/x/timeline"
    text = format_table(list(table.items()))
    assert text.splitlines()[0].startswith("  pipeline ")
