"""The bad-input sweep's table: one :class:`Case` per bad CLI/trainer input (tests/test_bad_inputs.py).

Each case names the field its one-line error must name; ``{name}`` placeholders in ``argv`` are the
sweep's fixture paths.
"""

from __future__ import annotations

from dataclasses import dataclass

HOST = "http://127.0.0.1:9"  # discard port: nothing answers
#: Planted in token files and URLs; must never appear in any output.
SECRET = "sweep-secret-5b1f0c9e"


@dataclass(frozen=True)
class Case:
    """One bad input: ``argv`` after the program (``{name}`` placeholders are fixture paths)."""

    id: str
    argv: tuple[str, ...]
    field: str
    program: str = "cli"  # cli | trainer
    env: tuple[tuple[str, str], ...] = ()  # extra environment


def _c(id_: str, field: str, *argv: str, program: str = "cli", **env: str) -> Case:
    return Case(id_, argv, field, program, tuple(env.items()))


NO_GPU = {"CUDA_VISIBLE_DEVICES": "-1"}  # CUDA's "no device", on any host


LAUNCH = ("launch-local", "--run-dir", "{ws}/run", "--set", "data.path={data}")
RENDER = ("render-job", "--image", "img:1", "--pvc", "shared", "--out", "{ws}/job.yaml")
TRAINER = ("--config", "tiny", "--run-dir", "{ws}/run", "--set", "data.path={data}")

CASES = [
    # prepare-data
    _c("prep-missing-source", "--source", "prepare-data", "--source", "{fx}/nope.txt", "--out",
       "{ws}/ds"),
    _c("prep-bad-jsonl", "--source", "prepare-data", "--source", "{badjsonl}", "--out", "{ws}/ds"),
    _c("prep-not-utf8", "--source", "prepare-data", "--source", "{latin1}", "--out", "{ws}/ds"),
    _c("prep-seq-len-type", "--seq-len", "prepare-data", "--source", "sample:", "--out", "{ws}/ds",
       "--seq-len", "sixty"),
    _c("prep-seq-len-zero", "--seq-len", "prepare-data", "--source", "sample:", "--out",
       "{ws}/ds", "--seq-len", "0"),
    _c("prep-val-fraction", "--val-fraction", "prepare-data", "--source", "sample:", "--out",
       "{ws}/ds", "--val-fraction", "1.5"),
    _c("prep-missing-tokenizer", "--tokenizer", "prepare-data", "--source", "sample:", "--out",
       "{ws}/ds", "--tokenizer", "{fx}/tokenizer.json"),
    # launch-local: nodes, trainer config, dataset, faults, run dir, checkpoint
    _c("local-nodes-reversed", "--nodes", *LAUNCH, "--nodes", "3:1"),
    _c("local-nproc-zero", "--nproc-per-node", *LAUNCH, "--nproc-per-node", "0"),
    _c("local-run-dir-traversal", "--run-dir", "launch-local", "--run-dir", "{ws}/a/../../escape",
       "--set", "data.path={data}"),
    _c("local-steps-type", "train.steps", *LAUNCH, "--set", "train.steps=ten"),
    _c("local-lr-negative", "train.lr", *LAUNCH, "--set", "train.lr=-0.1"),
    _c("local-unknown-key", "train.stepz", *LAUNCH, "--set", "train.stepz=3"),
    _c("local-monitor-choice", "resilience.monitor", *LAUNCH, "--set", "resilience.monitor=loud"),
    _c("local-dataset-missing", "data.path", "launch-local", "--run-dir", "{ws}/run", "--set",
       "data.path={empty}"),
    _c("local-dataset-truncated", "data.path", "launch-local", "--run-dir", "{ws}/run", "--set",
       "data.path={truncated}"),
    _c("local-vocab-mismatch", "model.vocab_size", *LAUNCH, "--set", "model.vocab_size=100"),
    _c("local-seq-len-too-long", "data.seq_len", *LAUNCH, "--set", "data.seq_len=512"),
    _c("local-fault-kind", "--fault", *LAUNCH, "--fault", "explode@3"),
    _c("local-fault-after-end", "--fault", *LAUNCH, "--fault", "kill@999"),
    _c("local-config-missing", "--config", *LAUNCH, "--config", "{fx}/nope.yaml"),
    _c("local-config-bad-yaml", "--config", *LAUNCH, "--config", "{badyaml}"),
    _c("local-config-unknown-section", "trainer", *LAUNCH, "--config", "{badsection}"),
    _c("local-deadline-negative", "--deadline", *LAUNCH, "--deadline", "-5"),
    _c("local-other-model-checkpoint", "checkpoint", "launch-local", "--run-dir", "{othermodel}",
       "--set", "data.path={data}"),
    # trainer entry point (what every pod runs)
    _c("trainer-heads", "model.dim", *TRAINER, "--set", "model.dim=66", program="trainer"),
    _c("trainer-in-process-gloo", "resilience.pg_timeout", *TRAINER, "--set",
       "resilience.in_process=true", "--set", "resilience.pg_timeout=30", program="trainer"),
    _c("trainer-without-launcher", "environment", *TRAINER, program="trainer"),
    # export
    _c("export-not-a-run", "--run-dir", "export", "--run-dir", "{empty}", "--out", "{ws}/model"),
    _c("export-missing-step", "--step", "export", "--run-dir", "{othermodel}", "--out",
       "{ws}/model", "--step", "7"),
    _c("export-eval-batches", "--eval-batches", "export", "--run-dir", "{othermodel}", "--out",
       "{ws}/model", "--eval-batches", "-1"),
    # job spec: render-job and launch
    _c("job-instance-type", "--instance-type", *RENDER, "--instance-type", "p9.huge"),
    _c("job-name", "--name", *RENDER, "--name", "Train_Job"),
    _c("job-run-dir-traversal", "--run-dir", *RENDER, "--run-dir", "/fsx/../etc/runs"),
    _c("job-run-dir-off-volume", "--run-dir", *RENDER, "--run-dir", "/tmp/run"),
    _c("job-nproc-gpus", "--nproc-per-node", *RENDER, "--nproc-per-node", "9"),
    _c("job-memory", "--memory", *RENDER, "--memory", "lots"),
    _c("job-reserved-env", "--env", *RENDER, "--env", "MASTER_ADDR=1.2.3.4"),
    _c("job-toleration", "--toleration", *RENDER, "--toleration", "gpu:Sometimes"),
    _c("job-fault", "--fault", *RENDER, "--fault", "kill@x"),
    _c("job-override", "train.steps", *RENDER, "--set", "train.steps=-1"),
    _c("trainjob-elastic-nodes", "--nodes", *RENDER, "--job-api", "trainjob", "--nodes", "2:4"),
    _c("trainjob-reserved-env", "--env", *RENDER, "--job-api", "trainjob", "--env",
       "PET_MASTER_ADDR=10.0.0.1"),
    _c("trainjob-name-too-long", "--name", *RENDER, "--job-api", "trainjob", "--nodes", "16",
       "--name", "a" * 56),
    _c("trainjob-runtime-kind", "--runtime-kind", *RENDER, "--job-api", "trainjob",
       "--runtime-kind", "Runtime"),
    _c("launch-trainjob-elastic", "--nodes", "launch", "--backend", "kubernetes", "--job-api",
       "trainjob", "--image", "i:1", "--pvc", "shared", "--nodes", "1:2"),
    _c("launch-k8s-no-image", "--image", "launch", "--backend", "kubernetes", "--pvc", "shared",
       "--kubeconfig", "{fx}/kubeconfig"),
    _c("launch-deadline", "--deadline", "launch", "--backend", "kubernetes", "--image", "i:1",
       "--pvc", "shared", "--deadline", "0"),
    _c("launch-local-nodes", "--nodes", "launch", "--backend", "local", "--nodes", "0",
       "--run-dir", "{ws}/run", "--set", "data.path={data}"),
    # pipelines: compile, run-local, submit, schedule
    _c("compile-pipeline", "--pipeline", "compile", "--out", "{ws}/compiled", "--pipeline", "nope"),
    _c("run-local-param-type", "--param seq_len", "run-local", "--out", "{ws}/local", "--param",
       "seq_len=long"),
    _c("run-local-unknown-param", "--param", "run-local", "--out", "{ws}/local", "--param",
       "bogus=1"),
    _c("run-local-bad-override", "--param overrides", "run-local", "--out", "{ws}/local",
       "--param", 'overrides=["train.steps=0"]'),
    _c("submit-unknown-param", "--param", "submit", "--host", HOST, "--param", "bogus=1"),
    _c("submit-missing-package", "--package", "submit", "--host", HOST, "--package",
       "{fx}/nope.yaml"),
    _c("schedule-5-field-cron", "--cron", "schedule", "--host", HOST, "--cron", "0 3 * * *"),
    _c("schedule-cron-range", "--cron", "schedule", "--host", HOST, "--cron", "0 0 25 * * *"),
    _c("schedule-concurrency", "--max-concurrency", "schedule", "--host", HOST, "--cron",
       "0 0 3 * * *", "--max-concurrency", "0"),
    _c("drill-scenario", "--scenario", "drill", "--out", "{ws}/drill", "--scenario", "nope"),
    # nothing that is not ours is deleted or overwritten
    _c("prep-out-is-source", "--out", "prepare-data", "--source", "{src}", "--out", "{src}",
       "--overwrite"),
    _c("prep-out-holds-source", "--out", "prepare-data", "--source", "{src}", "--out", "{fx}",
       "--overwrite"),
    _c("prep-out-cwd", "--out", "prepare-data", "--source", "sample:", "--out", ".",
       "--overwrite"),
    _c("prep-out-foreign", "--out", "prepare-data", "--source", "sample:", "--out", "{foreign}",
       "--overwrite"),
    _c("prep-out-name-too-long", "--out", "prepare-data", "--source", "sample:", "--out",
       "{ws}/" + "n" * 300),
    _c("export-out-foreign", "--out", "export", "--run-dir", "{othermodel}", "--out", "{foreign}",
       "--eval-batches", "0"),
    _c("export-out-holds-run", "--out", "export", "--run-dir", "{othermodel}", "--out", "{fx}",
       "--eval-batches", "0"),
    _c("local-run-dir-foreign", "--run-dir", "launch-local", "--run-dir", "{foreign}", "--set",
       "data.path={data}"),
    _c("local-fewer-steps-than-checkpoint", "train.steps", "launch-local", "--run-dir",
       "{othermodel}", "--set", "data.path={data}", "--set", "model.dim=32", "--set",
       "train.steps=2"),
    _c("demo-out-foreign", "--out", "demo", "--out", "{foreign}"),
    _c("drill-out-foreign", "--out", "drill", "--out", "{foreign}"),
    _c("goodput-not-a-dir", "--run-dir", "goodput", "--run-dir", "{fx}/nope"),
    # no secret in any output
    _c("submit-token-two-lines", "--token-file", "submit", "--host", HOST, "--token-file",
       "{token2}"),
    _c("submit-token-binary", "--token-file", "submit", "--host", HOST, "--token-file",
       "{tokenbin}"),
    _c("submit-host-password", "--host", "submit", "--host",
       f"http://admin:{SECRET}@127.0.0.1:9"),
    _c("submit-host-newline", "--host", "submit", "--host", "http://127.0.0.1:9\nX: 1"),
    _c("schedule-every-second", "--cron", "schedule", "--host", HOST, "--cron", "@every 1s"),
    _c("schedule-every-second-cron", "--cron", "schedule", "--host", HOST, "--cron",
       "* * * * * *"),
    # every config value is checked before anything starts (each once crashed every worker)
    _c("local-lr-nan", "train.lr", *LAUNCH, "--set", "train.lr=nan"),
    _c("local-lr-inf", "train.lr", *LAUNCH, "--set", "train.lr=inf"),
    _c("local-beta1", "train.beta1", *LAUNCH, "--set", "train.beta1=1.5"),
    _c("local-beta2-one", "train.beta2", *LAUNCH, "--set", "train.beta2=1"),
    _c("local-ffn-multiple-zero", "model.ffn_multiple_of", *LAUNCH, "--set",
       "model.ffn_multiple_of=0"),
    _c("local-norm-eps-zero", "model.norm_eps", *LAUNCH, "--set", "model.norm_eps=0"),
    _c("local-seed-huge", "train.seed", *LAUNCH, "--set", "train.seed=99999999999999999999"),
    _c("local-step-sleep-inf", "train.step_sleep", *LAUNCH, "--set", "train.step_sleep=inf"),
    _c("local-load-step", "checkpoint.load_step", *LAUNCH, "--set", "checkpoint.load_step=-2"),
    _c("local-device-cuda-no-gpu", "train.device", *LAUNCH, "--set", "train.device=cuda",
       **NO_GPU),
    _c("trainer-device-cuda-no-gpu", "train.device", *TRAINER, "--set", "train.device=cuda",
       program="trainer", **NO_GPU),
    _c("local-init-from-missing", "checkpoint.init_from", *LAUNCH, "--set",
       "checkpoint.init_from={fx}/nope.safetensors"),
    _c("local-init-from-not-safetensors", "checkpoint.init_from", *LAUNCH, "--set",
       "checkpoint.init_from={badyaml}"),
    _c("local-init-from-truncated", "checkpoint.init_from", *LAUNCH, "--set",
       "checkpoint.init_from={truncst}"),
    _c("local-init-from-other-model", "checkpoint.init_from", *LAUNCH, "--set",
       "checkpoint.init_from={otherst}"),
    _c("local-fault-rank", "--fault", *LAUNCH, "--fault", "kill@3/1"),
    _c("local-fault-rank-elastic", "--fault", *LAUNCH, "--nodes", "1:2", "--fault", "kill@3/2"),
    _c("job-fault-rank", "--fault", *RENDER, "--fault", "kill@3/8"),
    _c("job-fault-after-end", "--fault", *RENDER, "--fault", "kill@999"),
    _c("job-device-cuda-cpu-nodes", "train.device", *RENDER, "--instance-type", "cpu", "--set",
       "train.device=cuda"),
    _c("job-init-from-off-volume", "checkpoint.init_from", *RENDER, "--set",
       "checkpoint.init_from=/tmp/model.safetensors"),
    # config text: no YAML 1.1 surprises, no binary files, no silently dropped keys
    _c("local-set-sexagesimal", "train.steps", *LAUNCH, "--set", "train.steps=1:30"),
    _c("local-set-bool", "train.compile", *LAUNCH, "--set", "train.compile=maybe"),
    _c("local-config-duplicate-key", "train.steps", *LAUNCH, "--config", "{dupkey}"),
    _c("local-config-binary", "--config", *LAUNCH, "--config", "{binconfig}"),
    _c("job-config-binary", "--config", *RENDER, "--config", "{binconfig}"),
    # render-job: what the API server or the kubelet would refuse
    _c("job-out-directory", "--out", "render-job", "--image", "img:1", "--pvc", "shared",
       "--out", "{ws}"),
    _c("job-namespace", "--namespace", *RENDER, "--namespace", "Team_A"),
    _c("job-node-selector", "--node-selector", *RENDER, "--node-selector", "gpu=yes please"),
    _c("job-service-account", "--service-account", *RENDER, "--service-account", "Admin"),
    _c("job-priority-class", "--priority-class", *RENDER, "--priority-class", "high_prio"),
    _c("job-scheduler-name", "--scheduler-name", *RENDER, "--scheduler-name", "my sched"),
    _c("job-fs-group", "--fs-group", *RENDER, "--fs-group", "-1"),
    _c("job-mount-root", "--mount", *RENDER, "--mount", "/"),
    _c("job-mount-usr", "--extra-pvc", *RENDER, "--extra-pvc", "data:/usr/lib"),
]
