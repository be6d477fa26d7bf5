"""Fast unit tests of the trainer's pure parts: config, faults, goodput, model factory, FSDP2 build."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.core.events import parse_events
from kfp_nvrx.components.core.faults import FAULT_KINDS, Fault, When, parse_fault
from kfp_nvrx.components.core.goodput import summarize_events
from kfp_nvrx.components.core.launch_command import (
    POD_STOP_MARGIN_S,
    FtLauncher,
    TrainerArgs,
    ft_flags,
    ft_launcher_argv,
    pod_grace_period_s,
)
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.model import build_model, num_params
from kfp_nvrx.components.training.trainer.fault_injector import FaultInjector


def tiny_factory(cfg):  # used through model.factory below
    return torch.nn.Sequential(torch.nn.Embedding(cfg.vocab_size, 8), torch.nn.Linear(8, cfg.vocab_size))


def test_presets_load_and_size():
    sizes = {}
    for name in ("tiny", "125m", "1b", "8b"):
        cfg = load_config(name)
        with torch.device("meta"):
            sizes[name] = num_params(build_model(cfg.model))
    assert sizes["tiny"] < 1e6 < sizes["125m"] < 2e8 < sizes["1b"] < 1.5e9 < sizes["8b"] < 8.1e9
    # the launcher side sizes the export step without torch: the same counts
    from kfp_nvrx.components.core.sizing import export_memory, param_count

    gqa = load_config("tiny", ["model.n_kv_heads=2", "model.ffn_dim_multiplier=1.3"]).model
    with torch.device("meta"):
        sizes["gqa"] = num_params(build_model(gqa))
    counted = {name: param_count(load_config(name).model) for name in ("tiny", "125m", "1b", "8b")}
    assert counted | {"gqa": param_count(gqa)} == sizes
    assert export_memory("8b") == "92Gi" and export_memory("tiny") == "3Gi"
    assert export_memory("8b", requested="120Gi") == "120Gi"
    assert param_count(load_config("tiny", ["model.factory=x.y:z"]).model) is None


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {dim: 32, n_heads: 2}\ntrain: {steps: 7}\nresilience: {monitor: off}\n")
    cfg = load_config(str(path), ["train.lr=1e-2", "train.activation_checkpointing=true",
                                  "data.path=/x/y"])
    assert (cfg.model.dim, cfg.train.steps, cfg.train.lr) == (32, 7, 1e-2)
    assert cfg.train.activation_checkpointing is True and cfg.resilience.monitor == "off"
    assert cfg.data.path == "/x/y"


@pytest.mark.parametrize("yaml_text, sets, field", [
    ("bogus: {a: 1}\n", [], "bogus"),
    ("train: {stepz: 1}\n", [], "train.stepz"),
    ("train: {steps: ten}\n", [], "train.steps"),
    ("train: [1, 2]\n", [], "train"),
    ("", ["train.steps=0"], "train.steps"),
    ("", ["model.dim=65"], "model.dim"),
    ("", ["data.seq_len=4096"], "data.seq_len"),
    ("", ["resilience.monitor=loud"], "resilience.monitor"),
    ("", ["resilience.restart_policy=sometimes"], "resilience.restart_policy"),
    ("", ["model.factory=nomodule"], "model.factory"),
    ("", ["train.lr=-1"], "train.lr"),
    ("", ["train.steps=1.5"], "train.steps"),
])
def test_bad_config_names_the_field(tmp_path, yaml_text, sets, field):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(UserError) as err:
        load_config(str(path), sets)
    assert err.value.field == field or err.value.field.endswith(field)


def test_model_factory_hook():
    cfg = load_config("tiny", [f"model.factory={__name__}:tiny_factory"])
    assert isinstance(build_model(cfg.model), torch.nn.Sequential)
    with pytest.raises(UserError, match="model.factory"):
        build_model(load_config("tiny", ["model.factory=nope.nothing:fn"]).model)


def test_fault_parsing_and_fire_once(tmp_path):
    kill, hang, raise_ = (FAULT_KINDS.get(k) for k in ("kill", "hang", "raise"))
    assert parse_fault("kill@5/1") == Fault(kill, 5, 1)
    assert parse_fault("hang@3") == Fault(hang, 3, 0)
    for bad in ("kill", "kill@0", "boom@3", "kill@x/1", "kill@3/-1"):
        with pytest.raises(UserError, match="faults"):
            parse_fault(bad)
    inj = FaultInjector([Fault(raise_, 4, 1)], tmp_path, rank=1)
    assert inj.due(3, When.STEP) is None
    assert inj.due(4, When.CHECKPOINT) is None
    assert inj.due(4, When.STEP) == Fault(raise_, 4, 1)
    again = FaultInjector([Fault(raise_, 4, 1)], tmp_path, rank=1)  # a restarted worker
    assert again.due(4, When.STEP) is None
    assert FaultInjector([Fault(raise_, 4, 1)], tmp_path, rank=0).faults == []


def test_goodput_recovery_and_redone_steps():
    def step(n, t, inc=0, it=0, loss=1.0):
        return {"type": "step", "step": n, "start": t, "end": t + 1, "time": t + 1,
                "incarnation": inc, "iteration": it, "loss": loss, "tokens": 10}

    events = [{"type": "start", "time": 0.0, "incarnation": 0, "iteration": 0},
              step(1, 0), step(2, 1), step(3, 2), {"type": "checkpoint", "time": 3.5, "step": 2,
                                                   "blocking_s": 0.25, "total_s": 1, "bytes": 9},
              {"type": "fault", "time": 4.0, "kind": "kill", "step": 4, "rank": 1},
              {"type": "restart", "time": 8.0, "kind": "in-job", "incarnation": 1, "iteration": 0},
              step(3, 9, inc=1), step(4, 10, inc=1, loss=0.5)]
    rep = summarize_events(parse_events(events))
    assert rep.steps_final == 4 and rep.steps_run == 5 and rep.steps_redone == 1
    assert rep.productive_s == 4 and rep.lost_work_s == 1 and rep.wall_s == 11
    assert rep.goodput == pytest.approx(4 / 11)
    assert rep.recovery_s == [6.0]  # fault at t=4 -> first step of the next incarnation ends at 10
    assert rep.restarts == {"in-job": 1} and rep.checkpoint_stall_s == 0.25
    assert rep.final_loss == 0.5 and rep.faults == 1


def test_one_builder_for_pod_and_local_commands():
    res = load_config("tiny").resilience
    trainer = TrainerArgs("tiny", "/fsx/runs/r", ["train.steps=5"], ["kill@3/1"])
    pod = ft_launcher_argv(res, trainer, local_addr="$(POD_IP)", nic_monitor=True)
    local = ft_launcher_argv(res, trainer, local_addr="127.0.0.1",
                             launcher=FtLauncher("/venv/bin/ft_launcher"))
    strip = {0, pod.index("--local-addr=$(POD_IP)")}
    assert [a for i, a in enumerate(pod) if i not in strip and "nic-monitor" not in a] == \
        [a for i, a in enumerate(local) if i not in strip and "nic-monitor" not in a]
    flags = ft_flags(res)
    assert any(f.startswith("--ft-rank-section-timeouts=setup:") for f in flags)
    # any-failed is every NVRx's default, and NVRx 0.7 deprecates the flag: never written out.
    assert not any("restart-policy" in f for f in flags)
    res.in_process = True
    assert not any("restart-policy" in f for f in ft_flags(res, nvrx_version="0.7.0"))
    res.restart_policy = "min-healthy"
    assert "--ft-restart-policy=min-healthy" in ft_flags(res, nvrx_version="0.4.1")
    for version in ("0.7.0", None):  # None: a pod, whose image ships 0.7
        with pytest.raises(UserError, match="NVRx <= 0.5") as err:
            ft_flags(res, nvrx_version=version)
        assert err.value.field == "resilience.restart_policy"
    res.restart_policy = "auto"
    res.monitor = "heartbeats"
    assert not any("section" in f for f in ft_flags(res))


def test_fsdp2_build_with_activation_checkpointing_single_rank(one_rank_env):
    import torch.distributed as dist

    from kfp_nvrx.components.training.trainer.build import build

    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cfg = load_config("tiny", ["train.activation_checkpointing=true"])
        model, opt, sched = build(cfg, torch.device("cpu"))
        tokens = torch.randint(0, 256, (2, 16))
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        sched.step()
        assert "checkpoint_wrapper" in type(model.layers[0]).__name__.lower() or any(
            "checkpoint" in n for n, _ in model.layers[0].named_modules())
        assert sched.get_last_lr()[0] < cfg.train.lr  # warmup
    finally:
        dist.destroy_process_group()


def test_stop_timeouts_for_restarts_a_stopped_pod_and_its_grace_period():
    """A restart stops workers at once; a stopped pod's workers save first (issue 31)."""
    res = load_config("tiny", ["resilience.workers_stop_timeout=12.5",
                               "resilience.stop_save_timeout=20"]).resilience
    argv = ft_launcher_argv(res, TrainerArgs("tiny", "/r"), local_addr="x")
    assert "--workers-stop-timeout=12.5" in argv and "--term-timeout=32.5" in argv
    assert pod_grace_period_s(res) == 33 + POD_STOP_MARGIN_S > 32.5
    off = load_config("tiny", ["resilience.stop_save_timeout=0"]).resilience
    assert f"--term-timeout={off.workers_stop_timeout:g}" in ft_launcher_argv(
        off, TrainerArgs("tiny", "/r"), local_addr="x")


def test_trainer_creates_the_flight_recorder_folder_the_pod_env_names(tmp_path, monkeypatch):
    from kfp_nvrx.components.launch.jobspec.env import gpu_env
    from kfp_nvrx.components.training.trainer.__main__ import make_nccl_trace_dir

    run_dir = tmp_path / "run"
    prefix = gpu_env(str(run_dir))["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix)
    assert not (run_dir / "nccl_trace").exists()
    assert make_nccl_trace_dir() == run_dir / "nccl_trace"
    assert (run_dir / "nccl_trace").is_dir()
    Path(prefix + "0").write_text("dump")  # where torch writes rank 0's dump
    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    assert make_nccl_trace_dir() is None


def test_checkpoint_policy_saves_every_interval_and_the_final_step(one_rank_env, tmp_path):
    import torch.distributed as dist

    from kfp_nvrx.components.training.checkpoint import Checkpointer

    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        def saved(*sets: str) -> tuple[bool, list[int]]:
            cfg = load_config("tiny", ["train.device=cpu", *sets])
            ckpt = Checkpointer(tmp_path, cfg.checkpoint, torch.device("cpu"), final_step=10)
            return ckpt.periodic, [s for s in range(1, 11) if ckpt.should_save(s)]

        assert saved("checkpoint.interval=3", "checkpoint.save_final=true") == (True, [3, 6, 9, 10])
        assert saved("checkpoint.interval=5", "checkpoint.save_final=false") == (True, [5, 10])
        assert saved("checkpoint.interval=4", "checkpoint.save_final=false") == (True, [4, 8])
        assert saved("checkpoint.interval=0", "checkpoint.save_final=true") == (False, [10])
        assert saved("checkpoint.interval=0", "checkpoint.save_final=false") == (False, [])
    finally:
        dist.destroy_process_group()


def test_a_worker_failure_is_one_line_with_the_traceback_kept_in_the_run(tmp_path, monkeypatch):
    """Issue 30 item 8: a healthy rank whose peer died printed a page of torch internals."""
    from kfp_nvrx.components.training.trainer.__main__ import failure_line

    monkeypatch.setenv("RANK", "0")
    try:
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                           "closed by peer [127.0.0.1]:12345\nmore lines")
    except RuntimeError as err:
        line = failure_line(err, tmp_path)
    assert line.startswith("[trainer] rank 0 lost a peer rank in a collective ([../third_party")
    assert "\n" not in line and "more lines" not in line and "own lines say why" in line
    kept = next((tmp_path / "logs").glob("traceback-rank0-*.txt"))
    assert f"traceback: {kept}" in line
    assert "Traceback (most recent call last)" in kept.read_text()
    assert "more lines" in kept.read_text()
    try:
        raise ValueError("a bug of ours")
    except ValueError as err:
        assert failure_line(err, tmp_path).startswith(
            "[trainer] rank 0 failed: ValueError: a bug of ours (traceback: ")
