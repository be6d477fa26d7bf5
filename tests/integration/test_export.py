"""export: committed DCP checkpoint -> model.safetensors (bitwise), config/export.json, eval."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from kfp_nvrx.components.cli import main as cli
from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.data.prepare import prepare_dataset
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.local.run import free_port
from kfp_nvrx.components.training.export.consolidate import (
    export_checkpoint,
    list_checkpoints,
    select_checkpoint,
)
from kfp_nvrx.components.training.export.evaluate import (
    Windows,
    eval_loss,
    evaluate_export,
    load_exported_model,
    window_starts,
)
from kfp_nvrx.components.training.model import build_model

# dcp.save(no_dist=True) in the fixtures warns that it assumes a single process: it does.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(load_config("tiny").model)
    model.init_weights()
    return model


def _save(run: Path, step: int, model: torch.nn.Module, commit: bool, world_size: int = 1) -> Path:
    path = run / "checkpoints" / f"step_{step:08d}"
    optim = torch.optim.AdamW(model.parameters())
    dcp.save({"model": model.state_dict(), "optim": optim.state_dict(), "train": {"step": step}},
             checkpoint_id=str(path), no_dist=True)
    if commit:  # the marker the trainer writes: the checkpoint's files and their sizes
        files = {p.name: p.stat().st_size for p in sorted(path.iterdir())}
        (path / "COMMITTED").write_text(json.dumps(
            {"step": step, "world_size": world_size, "time": time.time(),
             "bytes": sum(files.values()), "files": files}))
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "ds"
    prepare_dataset("sample:400", out, seq_len=64)
    return out


@pytest.fixture()
def run(tmp_path: Path, dataset: Path) -> tuple[Path, dict[int, torch.nn.Module]]:
    """A run dir: step 3 and 5 committed, step 7 torn (no COMMITTED), plus config.yaml."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config("tiny", [f"data.path={dataset}"])
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    models = {3: _model(3), 5: _model(5), 7: _model(7)}
    _save(run, 3, models[3], commit=True)
    _save(run, 5, models[5], commit=True, world_size=4)
    _save(run, 7, models[7], commit=False)
    return run, models


def _snapshot(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*"))}


def test_list_and_select_skip_torn(run: tuple[Path, dict]) -> None:
    run_dir, _ = run
    assert [(c.step, c.committed) for c in list_checkpoints(run_dir)] == [
        (3, True), (5, True), (7, False)]
    assert select_checkpoint(run_dir).step == 5
    assert select_checkpoint(run_dir, 3).step == 3
    with pytest.raises(UserError) as err:
        select_checkpoint(run_dir, 7)
    assert err.value.field == "step" and "not committed" in err.value.message
    with pytest.raises(UserError) as err:
        select_checkpoint(run_dir, 99)
    assert err.value.field == "step" and "3, 5" in err.value.message


def test_damaged_committed_checkpoint_is_skipped(run: tuple[Path, dict], tmp_path: Path) -> None:
    run_dir, _ = run
    shard = run_dir / "checkpoints" / "step_00000005" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated after the commit
    logged: list[str] = []
    assert select_checkpoint(run_dir, log=logged.append).step == 3
    assert logged and "step_00000005" in logged[0] and "its commit recorded" in logged[0]
    with pytest.raises(UserError) as err:
        select_checkpoint(run_dir, 5)
    assert err.value.field == "step" and "__0_0.distcp" in err.value.message
    assert export_checkpoint(run_dir, tmp_path / "out", eval_batches=0)["source_step"] == 3


def test_export_newest_committed_bitwise(run: tuple[Path, dict], tmp_path: Path) -> None:
    run_dir, models = run
    before = _snapshot(run_dir)
    info = export_checkpoint(run_dir, tmp_path / "export")
    out = Path(info["path"])
    assert _snapshot(run_dir) == before, "the run dir is only read"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "export.json",
                                                     "model.safetensors"]
    tensors = load_file(str(out / "model.safetensors"))
    expected = models[5].state_dict()
    assert set(tensors) == set(expected)
    for key, value in expected.items():
        assert tensors[key].dtype == value.dtype and torch.equal(tensors[key], value), key
    assert not any(torch.equal(tensors[k], v) for k, v in models[7].state_dict().items()
                   if k.endswith("wq.weight")), "the torn step 7 was not used"
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert fh.metadata() == {"format": "pt"}
    exported = json.loads((out / "export.json").read_text())
    assert {k: v for k, v in info.items() if k != "path"} == exported
    assert exported["source_step"] == 5 and exported["world_size"] == 4
    assert exported["source_dir"] == str(run_dir / "checkpoints" / "step_00000005")
    assert exported["num_params"] == sum(p.numel() for p in models[5].parameters())
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert exported["sha256"] == digest
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "kfp-nvrx-llama" and config["torch_dtype"] == "float32"
    assert config["vocab_size"] == 256 and config["dim"] == 64 and config["n_layers"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "run"], "no temp dirs left"


def test_named_step_and_roundtrip_into_fresh_model(run: tuple[Path, dict], tmp_path: Path) -> None:
    run_dir, models = run
    info = export_checkpoint(run_dir, tmp_path / "e3", step=3, eval_batches=0)
    assert info["source_step"] == 3 and "eval_loss" not in info
    fresh = load_exported_model(tmp_path / "e3")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fresh(tokens), models[3](tokens))


def test_eval_loss_is_deterministic_and_tracks_the_weights(run: tuple[Path, dict], tmp_path: Path,
                                                           dataset: Path) -> None:
    run_dir, models = run
    info = export_checkpoint(run_dir, tmp_path / "e5", eval_batches=3)
    cfg = load_config("tiny")
    assert info["eval_tokens"] == 3 * cfg.data.batch_size * cfg.data.seq_len
    assert info["eval_data"] == str(dataset.resolve())
    again = evaluate_export(tmp_path / "e5", dataset, batch_size=cfg.data.batch_size, batches=3)
    assert again["loss"] == info["eval_loss"]
    # Independent computation on the same windows with the original model.
    from kfp_nvrx.components.data.shards import SplitTokens

    split = SplitTokens(dataset, "val")
    starts = window_starts(len(split), 64, 12)
    rows = torch.stack([torch.from_numpy(split.read(int(s), 65)) for s in starts])
    with torch.no_grad():
        logits = models[5](rows[:, :-1])
    manual = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), rows[:, 1:].reshape(-1))
    assert abs(float(manual) - info["eval_loss"]) < 1e-5
    other = eval_loss(models[3], dataset, Windows(seq_len=64, batch_size=4, batches=3))
    assert other["loss"] != info["eval_loss"] and other["windows"] == 12


def test_window_starts() -> None:
    assert window_starts(1000, 9, 4).tolist() == [0, 330, 660, 990]
    assert window_starts(35, 9, 8).tolist() == [0, 12, 25]  # only 3 fit without overlap
    assert window_starts(5, 9, 8).tolist() == []


def test_bad_inputs(run: tuple[Path, dict], tmp_path: Path, dataset: Path) -> None:
    run_dir, _ = run

    def bad(field: str, **kwargs: object) -> str:
        args = {"run_dir": run_dir, "out_dir": tmp_path / "out", **kwargs}
        with pytest.raises(UserError) as err:
            export_checkpoint(**args)  # type: ignore[arg-type]
        assert err.value.field == field, err.value
        assert not (tmp_path / "out").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
        return err.value.message

    names = [p.name for p in tmp_path.iterdir()]
    assert "not committed" in bad("step", step=7)
    bad("step", step=-1)
    bad("eval_batches", eval_batches=-2)
    bad("run_dir", run_dir=tmp_path / "nope")
    assert "not a dataset" in bad("data", data=str(tmp_path))
    # A dataset whose vocabulary is bigger than the model's.
    big = tmp_path / "big"
    big.mkdir()
    index = json.loads((dataset / "index.json").read_text())
    (big / "index.json").write_text(json.dumps({**index, "vocab_size": 50_000}))
    names.append("big")
    assert "vocab_size 50000" in bad("data", data=str(big))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    names.append("foreign")
    with pytest.raises(UserError) as err:
        export_checkpoint(run_dir, foreign)
    assert err.value.field == "out_dir" and (foreign / "keep.txt").read_text() == "mine"
    with pytest.raises(UserError) as err:
        export_checkpoint(run_dir, run_dir / "checkpoints" / "x")
    assert err.value.field == "out_dir"


def test_no_committed_checkpoint_and_missing_data_path(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(load_config("tiny").to_dict()))
    _save(run_dir, 2, _model(2), commit=False)
    with pytest.raises(UserError) as err:
        export_checkpoint(run_dir, tmp_path / "out")
    assert err.value.field == "run_dir" and "no committed checkpoint" in err.value.message
    _save(run_dir, 4, _model(4), commit=True)
    with pytest.raises(UserError) as err:  # config.yaml has no data.path and no --data given
        export_checkpoint(run_dir, tmp_path / "out")
    assert err.value.field == "data" and "`eval_batches=0`" in err.value.message
    assert export_checkpoint(run_dir, tmp_path / "out", eval_batches=0)["source_step"] == 4
    # Re-exporting over an earlier export replaces it.
    assert export_checkpoint(run_dir, tmp_path / "out", eval_batches=0)["source_step"] == 4


def _prune_during_the_read(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> None:
    """The first DCP read finds the run moved on: step 7 committed, step 5 pruned (keep=1)."""
    import shutil

    real = dcp.load

    def load(*args, **kwargs):
        step7 = run_dir / "checkpoints" / "step_00000007"
        if not (step7 / "COMMITTED").exists():
            files = {p.name: p.stat().st_size for p in sorted(step7.iterdir())}
            (step7 / "COMMITTED").write_text(json.dumps(
                {"step": 7, "world_size": 1, "time": time.time(),
                 "bytes": sum(files.values()), "files": files}))
            shutil.rmtree(run_dir / "checkpoints" / "step_00000005")
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", load)


def test_export_of_a_run_still_training_reads_the_newest_again(
        run: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step pruned while it was read failed the export and blamed a --step never given (30.15)."""
    run_dir, models = run
    _prune_during_the_read(monkeypatch, run_dir)
    said: list[str] = []
    info = export_checkpoint(run_dir, tmp_path / "out", eval_batches=0, log=said.append)
    assert info["source_step"] == 7 and any("removed while it was read" in m for m in said)
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in models[7].state_dict().items())


def test_a_named_step_pruned_while_read_says_so(
        run: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir, _ = run
    _prune_during_the_read(monkeypatch, run_dir)
    with pytest.raises(UserError) as err:
        export_checkpoint(run_dir, tmp_path / "out", step=5, eval_batches=0)
    assert err.value.field == "step" and "removed while it was read" in err.value.message
    assert not (tmp_path / "out").exists()


def test_a_run_made_on_fsx_names_its_data_path_not_a_data_flag_never_given(
        run: tuple[Path, dict], tmp_path: Path) -> None:
    """It said '--data: /fsx/... is not a dataset' to a user who gave no --data (issue 30.8)."""
    run_dir, _ = run
    cfg = load_config("tiny", ["data.path=/fsx/data/corpus"])
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    proc = subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "export",
                           "--run-dir", str(run_dir), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("kfp-nvrx export: error: data.path: the run's data.path"), lines[0]
    assert "/fsx/data/corpus" in lines[0] and "--data" in lines[0]
    assert "--eval-batches=0" in lines[0] and not (tmp_path / "out").exists()


def test_checkpoint_not_matching_config(run: tuple[Path, dict], tmp_path: Path) -> None:
    run_dir, _ = run
    cfg = load_config("tiny", ["model.dim=32"])
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    with pytest.raises(UserError) as err:
        export_checkpoint(run_dir, tmp_path / "out", eval_batches=0)
    assert err.value.field == "run_dir" and "does not match" in err.value.message


@pytest.fixture()
def only_export_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real CLI entry point with just this command registered (others are tested apart)."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("kfp_nvrx.components.cli.commands.export",))


def test_cli_export(only_export_cli: None, run: tuple[Path, dict], tmp_path: Path,
                    capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, _ = run
    out = tmp_path / "cli"
    assert cli.main(["export", "--run-dir", str(run_dir), "--out", str(out),
                     "--eval-batches", "2"]) == 0
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and line.startswith("exported step 5 (world size 4)")
    assert "eval_loss=" in line and str(out / "model.safetensors") in line
    rc = cli.main(["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "x"),
                   "--step", "7"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--step" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


_FSDP_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard
    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.training.model import build_model

    def main(rank, world, ckpt, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.manual_seed(0)
        model = build_model(load_config("tiny").model)
        model.init_weights()
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randint(0, 256, (2, 16))).float().pow(2).mean().backward()
        opt.step()
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, os.path.join(os.path.dirname(ckpt), "full.pt"))
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, opt), "train": {"step": 6}}
        dcp.save(state, checkpoint_id=ckpt)
        dist.barrier()
        if rank == 0:
            from pathlib import Path

            from kfp_nvrx.components.core.rundir import write_commit_marker

            write_commit_marker(Path(ckpt), 6, world)
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        mp.spawn(main, args=(2, sys.argv[1], int(sys.argv[2])), nprocs=2)
""")


@pytest.mark.slow
def test_export_of_a_two_rank_fsdp2_checkpoint(tmp_path: Path) -> None:
    """A checkpoint sharded by FSDP2 over 2 gloo ranks exports to the full tensors, bitwise."""
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "step_00000006"
    ckpt.parent.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(load_config("tiny").to_dict()))
    script = tmp_path / "fsdp_save.py"
    script.write_text(_FSDP_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(ckpt), str(free_port())],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    info = export_checkpoint(run_dir, tmp_path / "export", eval_batches=0)
    assert info["world_size"] == 2 and info["source_step"] == 6
    full = torch.load(run_dir / "checkpoints" / "full.pt")
    tensors = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(tensors) == set(full)
    for key, value in full.items():
        assert torch.equal(tensors[key], value), key
