"""Every config value is checked where it is set: ranges, finiteness, ``--set`` text, YAML files.

Also the torch-free checks the launcher side makes before a job exists: a warm-start file's
safetensors header and a fault's rank against the job's world size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kfp_nvrx.components.core.config import Config, load_config
from kfp_nvrx.components.core.config_text import parse_set_value, read_config_file
from kfp_nvrx.components.core.faults import check_faults
from kfp_nvrx.components.core.safetensors_header import read_header
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.resolve import LOCAL, resolve
from kfp_nvrx.components.launch.jobspec.spec import JobSpec
from kfp_nvrx.components.training.model import build_model
from kfp_nvrx.components.training.trainer.bootstrap import check_init_from


@pytest.mark.parametrize("item, field", [
    ("train.lr=nan", "train.lr"), ("train.lr=inf", "train.lr"), ("train.lr=-inf", "train.lr"),
    ("train.beta1=1.5", "train.beta1"), ("train.beta1=-0.1", "train.beta1"),
    ("train.beta2=1", "train.beta2"), ("model.ffn_multiple_of=0", "model.ffn_multiple_of"),
    ("model.ffn_dim_multiplier=0", "model.ffn_dim_multiplier"), ("model.norm_eps=0", "model.norm_eps"),
    ("model.rope_theta=-1", "model.rope_theta"), ("train.seed=-1", "train.seed"),
    (f"train.seed={2**63}", "train.seed"), ("train.step_sleep=inf", "train.step_sleep"),
    ("train.weight_decay=nan", "train.weight_decay"), ("train.grad_clip=inf", "train.grad_clip"),
    ("resilience.heartbeat_timeout=inf", "resilience.heartbeat_timeout"),
    ("checkpoint.finalize_timeout=nan", "checkpoint.finalize_timeout"),
    ("checkpoint.load_step=-2", "checkpoint.load_step"), ("checkpoint.store=s3", "checkpoint.store"),
    ("train.steps=1:30", "train.steps"), ("train.steps=0x10", "train.steps"),
    ("train.lr=1:30", "train.lr"), ("train.compile=maybe", "train.compile"),
    ("train.compile=1", "train.compile"),
])
def test_bad_value_is_refused_naming_the_field(item, field) -> None:
    with pytest.raises(UserError) as err:
        load_config("tiny", [item])
    assert err.value.field == field, err.value.one_line()


def test_bounds_are_inclusive_where_declared() -> None:
    cfg = load_config("tiny", ["train.beta1=0", "train.beta2=0.999999", "model.ffn_multiple_of=1",
                               f"train.seed={2**63 - 1}", "train.seed=0", "train.lr=0",
                               "checkpoint.load_step=-1", "checkpoint.load_step=0"])
    assert (cfg.train.beta1, cfg.train.beta2, cfg.model.ffn_multiple_of) == (0, 0.999999, 1)
    assert (cfg.train.seed, cfg.train.lr, cfg.checkpoint.load_step) == (0, 0, 0)
    torch.manual_seed(2**63 - 1)  # the largest seed the config accepts is one torch accepts


def test_every_float_field_refuses_nan_and_inf() -> None:
    cfg = Config()
    for section in ("model", "data", "train", "checkpoint", "resilience"):
        obj = getattr(cfg, section)
        for name, value in vars(obj).items():
            if isinstance(value, float):
                for bad in (math.nan, math.inf):
                    with pytest.raises(UserError, match=f"{section}.{name}"):
                        setattr(obj, name, bad)


def test_set_values_are_read_as_their_field_type_not_yaml() -> None:
    cfg = load_config("tiny", ["data.path=/runs/a #1", "model.factory=pkg.mod:fn",
                               "checkpoint.init_from=1:30", "train.lr=1e-3", "train.lr=2e-3",
                               "resilience.monitor=off", "train.compile=Yes",
                               "train.steps=1_000", "model.factory='pkg.other:fn'"])
    assert cfg.data.path == "/runs/a #1"  # a '#' is not a comment
    assert cfg.checkpoint.init_from == "1:30"  # not base 60
    assert cfg.train.lr == 2e-3  # a key set twice keeps the last (CLI convention)
    assert cfg.resilience.monitor == "off" and cfg.train.compile is True
    assert cfg.train.steps == 1000 and cfg.model.factory == "pkg.other:fn"
    assert parse_set_value("x.y", "", str) == "" and parse_set_value("x.y", '""', str) == ""
    assert parse_set_value("x.y", "-3", int) == -3 and parse_set_value("x.y", "1e-3", float) == 1e-3


def test_yaml_file_without_base_60_and_duplicate_keys_refused(tmp_path: Path) -> None:
    sexa = tmp_path / "sexa.yaml"
    sexa.write_text("model: {factory: 1:30}\ntrain: {steps: 7, lr: 1.5e-3}\n")
    cfg = load_config(str(sexa))
    assert (cfg.model.factory, cfg.train.steps, cfg.train.lr) == ("1:30", 7, 1.5e-3)
    sexa.write_text("train: {steps: 1:30}\n")
    with pytest.raises(UserError, match="train.steps"):
        load_config(str(sexa))
    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  steps: 3\nmodel: {dim: 32}\ntrain:\n  lr: 0.1\n")
    with pytest.raises(UserError) as err:
        load_config(str(dup))
    assert err.value.field == "train" and "lines 1 and 4" in err.value.message
    dup.write_text("model: {dim: 32, n_heads: 2, dim: 64}\n")
    with pytest.raises(UserError) as err:
        read_config_file(dup)
    assert err.value.field == "model.dim"


def test_binary_config_file_is_one_line_naming_config(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(UserError) as err:
        load_config(str(path))
    assert err.value.field == "config" and "UTF-8" in err.value.message


def _tiny_weights(tmp_path: Path, **overrides: str) -> tuple[Config, Path]:
    cfg = load_config("tiny", [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()])
    state = {k: v.contiguous() for k, v in build_model(cfg.model).state_dict().items()}
    out = tmp_path / "export" / "model.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out))
    return cfg, out


def test_safetensors_header_of_a_real_file_and_broken_ones(tmp_path: Path) -> None:
    cfg, file = _tiny_weights(tmp_path)
    shapes = read_header("checkpoint.init_from", file.parent)  # an export dir works too
    assert shapes == {k: tuple(v.shape) for k, v in build_model(cfg.model).state_dict().items()}
    data = file.read_bytes()
    bad = tmp_path / "bad.safetensors"
    n = int.from_bytes(data[:8], "little")
    for broken in (data[:-1],  # truncated: the last tensor lies past the end
                   data[:4],  # no header length
                   (10**9).to_bytes(8, "little") + data[8:],  # header longer than the file
                   data[:8] + b"x" + data[9:],  # not JSON
                   len(b"[1]").to_bytes(8, "little") + b"[1]",  # JSON but not a mapping
                   b"train: {steps: 3}\n"):
        bad.write_bytes(broken)
        with pytest.raises(UserError) as err:
            read_header("checkpoint.init_from", bad)
        assert err.value.field == "checkpoint.init_from"
    assert json.loads(data[8:8 + n])  # the untouched file's header is JSON
    with pytest.raises(UserError, match="does not exist"):
        read_header("checkpoint.init_from", tmp_path / "nope.safetensors")
    with pytest.raises(UserError, match="no model.safetensors"):
        read_header("checkpoint.init_from", tmp_path)


def test_init_from_must_fit_the_model(tmp_path: Path) -> None:
    cfg, file = _tiny_weights(tmp_path)
    cfg.checkpoint.init_from = str(file)
    check_init_from(cfg)  # fits
    other = load_config("tiny", ["model.dim=32", f"checkpoint.init_from={file}"])
    with pytest.raises(UserError) as err:
        check_init_from(other)
    assert err.value.field == "checkpoint.init_from" and "does not fit" in err.value.message


def test_fault_rank_is_checked_against_the_most_workers_started() -> None:
    assert [f.rank for f in check_faults(["kill@3/1", "hang@4"], 10, 5, world_size=2)] == [1, 0]
    with pytest.raises(UserError, match="rank 2 but the job has 2"):
        check_faults(["kill@3/2"], 10, 5, world_size=2)
    check_faults(["kill@3/7"], 10, 5)  # world size unknown (an elastic worker): not checked
    # Resolving a job checks its faults against its config and its largest world (2 x 1 here).
    assert resolve(JobSpec(nodes="1:2", faults=["kill@3/1"]), LOCAL).faults == ("kill@3/1",)
    with pytest.raises(UserError, match="faults"):
        resolve(JobSpec(nodes="1:2", faults=["kill@3/2"]), LOCAL)
    with pytest.raises(UserError, match="after the last step"):
        resolve(JobSpec(faults=["kill@999"]), LOCAL)
