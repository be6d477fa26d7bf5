"""We delete or overwrite only what we provably created.

Each case points an output at something that is not ours (the source, a folder holding it, the
working directory, a folder with the user's files next to our own) and checks that the command
refuses in one line and that every byte of the user's files is still there.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
import yaml

from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.core.ownership import RUN_MARKER, check_run_dir_owned, is_run_dir
from kfp_nvrx.components.data.prepare import prepare_dataset
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.export.consolidate import export_checkpoint
from kfp_nvrx.components.training.model import build_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("\n\n".join(f"document number {i} " * 20 for i in range(40)))
    return src


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("where", ["source", "parent", "cwd"])
def test_prepare_data_never_replaces_its_source_or_the_working_directory(
        where: str, corpus: Path, tmp_path: Path) -> None:
    out = {"source": str(corpus), "parent": str(tmp_path), "cwd": "."}[where]
    cwd = corpus if where == "cwd" else tmp_path
    before = _tree(tmp_path)
    proc = _cli("prepare-data", "--source", str(corpus), "--out", out, "--overwrite",
                "--seq-len", "16", cwd=cwd)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--out" in proc.stderr
    assert _tree(tmp_path) == before


def test_damaged_dataset_with_user_files_is_not_rebuilt(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    prepare_dataset(str(corpus), out, seq_len=16)
    shard = next(out.glob("train_*.bin"))
    os.truncate(shard, 1)  # damaged: a rebuild would replace the folder
    (out / "my-notes.md").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(UserError) as err:
            prepare_dataset(str(corpus), out, seq_len=16, overwrite=overwrite)
        assert err.value.field == "out_dir" and "my-notes.md" in err.value.message
        assert (out / "my-notes.md").read_text() == "mine"
    (out / "my-notes.md").unlink()  # once the folder is only ours, it is rebuilt
    assert prepare_dataset(str(corpus), out, seq_len=16)["status"] == "written"


def test_a_folder_without_our_index_is_never_replaced(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    out.mkdir()
    (out / "index.json").write_text('{"format": "somebody-else/1"}')
    for overwrite in (False, True):
        with pytest.raises(UserError):
            prepare_dataset(str(corpus), out, seq_len=16, overwrite=overwrite)
    assert _tree(out) == {"index.json": b'{"format": "somebody-else/1"}'}


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    prepare_dataset("sample:200", data, seq_len=64)
    run = tmp_path / "run"
    cfg = load_config("tiny", [f"data.path={data}"])
    path = run / "checkpoints" / "step_00000002"
    path.mkdir(parents=True)
    dcp.save({"model": build_model(cfg.model).state_dict()}, checkpoint_id=str(path),
             no_dist=True)
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    (path / "COMMITTED").write_text(json.dumps({"step": 2, "world_size": 1, "files": files}))
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    return run


def test_export_keeps_foreign_files_next_to_an_earlier_export(run_dir: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "model"
    export_checkpoint(run_dir, out, eval_batches=0)
    mode = stat.S_IMODE((out / "model.safetensors").stat().st_mode)
    assert mode == 0o644, oct(mode)  # readable by a server sharing the volume
    export_checkpoint(run_dir, out, eval_batches=0)  # an export of ours alone: replaced
    (out / "README.md").write_text("my model card")
    before = _tree(out)
    with pytest.raises(UserError) as err:
        export_checkpoint(run_dir, out, eval_batches=0)
    assert err.value.field == "out_dir" and "README.md" in err.value.message
    assert _tree(out) == before
    for bad in (tmp_path, run_dir.parent):  # folders holding the run dir
        with pytest.raises(UserError):
            export_checkpoint(run_dir, bad, eval_batches=0)


def test_run_dir_must_be_new_empty_or_ours(tmp_path: Path) -> None:
    sections = ["model", "data", "train", "checkpoint", "resilience"]
    foreign = tmp_path / "project"
    foreign.mkdir()
    (foreign / "config.yaml").write_text("database: {host: db}\n")
    with pytest.raises(UserError) as err:
        check_run_dir_owned(foreign, sections)
    assert err.value.field == "run_dir"
    check_run_dir_owned(tmp_path / "new", sections)
    (tmp_path / "empty").mkdir()
    check_run_dir_owned(tmp_path / "empty", sections)
    marked = tmp_path / "marked"
    marked.mkdir()
    (marked / RUN_MARKER).write_text("{}")
    (marked / "notes").write_text("x")
    assert is_run_dir(marked)
    older = tmp_path / "older"  # a run dir from before the marker: config.yaml + checkpoints/
    (older / "checkpoints").mkdir(parents=True)
    (older / "config.yaml").write_text("train: {steps: 3}\nmodel: {dim: 64}\n")
    assert is_run_dir(older, sections) and not is_run_dir(foreign, sections)


def test_launch_local_refuses_a_foreign_run_dir(tmp_path: Path) -> None:
    data = tmp_path / "data"
    prepare_dataset("sample:200", data, seq_len=64)
    foreign = tmp_path / "project"
    foreign.mkdir()
    (foreign / "config.yaml").write_text("database: {host: db}\n")
    proc = _cli("launch-local", "--run-dir", str(foreign), "--set", f"data.path={data}",
                cwd=tmp_path)
    assert proc.returncode == 2 and "--run-dir" in proc.stderr, proc.stderr
    assert _tree(foreign) == {"config.yaml": b"database: {host: db}\n"}


@pytest.mark.parametrize("command", ["demo", "drill"])
def test_demo_and_drill_never_empty_a_foreign_folder(command: str, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    (out / "run").mkdir(parents=True)
    (out / "runs").mkdir()
    (out / "run" / "thesis.tex").write_text("years of work")
    (out / "runs" / "thesis.tex").write_text("years of work")
    before = _tree(out)
    proc = _cli(command, "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2 and "--out" in proc.stderr, proc.stderr
    assert _tree(out) == before


def test_prepare_data_stopped_by_sigterm_leaves_nothing(tmp_path: Path) -> None:
    """Signalled once its work folder exists, it removes that and the sample corpus copy."""
    import signal
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    work_parent = tmp_path / "out"
    work_parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "kfp_nvrx.components.cli", "prepare-data",
                             "--source", "sample:400000", "--out", str(work_parent / "ds"),
                             "--quiet"], env={**os.environ, "TMPDIR": str(tmp)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 120
    while not any(work_parent.iterdir()) and time.monotonic() < end and proc.poll() is None:
        time.sleep(0.05)
    assert any(p.name.startswith(".ds.tmp-") for p in work_parent.iterdir())
    assert any(tmp.iterdir())  # the sample corpus copy
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert list(work_parent.iterdir()) == [] and list(tmp.iterdir()) == []


#: One rank's start (check, then claim and record, as ``bootstrap.prepare_job`` does) while a
#: second rank checks the same run dir before each of the first rank's file-system calls and
#: after the last: every state the folder passes through is one a concurrent rank may read.
_CLAIM_SCRIPT = r"""
import json, sys
from pathlib import Path
from kfp_nvrx.components.core.config import load_config
from kfp_nvrx.components.core.run_record import check_run_dir, record_config
from kfp_nvrx.components.errors import UserError

run, cfg = Path(sys.argv[1]), load_config("tiny", ["data.path=/data/a"])
refused, calls, active = [], [], False
MUTATING = {"open", "os.mkdir", "os.rename", "os.link", "os.remove", "os.symlink"}

def second_rank(event, args):
    global active
    if not active or event not in MUTATING:
        return
    active = False  # the second rank's own reads are not audited
    try:
        calls.append(event)
        check_run_dir(run, cfg)
    except UserError as err:
        refused.append(f"before {event} {args[:1]}: {err.message}")
    finally:
        active = True

sys.addaudithook(second_rank)
active = True
check_run_dir(run, cfg)
record_config(cfg, run)
second_rank("open", ("(after the last call)",))
active = False
print(json.dumps({"refused": refused, "calls": len(calls)}))
"""


def test_a_rank_checking_the_run_dir_while_another_claims_it_is_never_refused(
        tmp_path: Path) -> None:
    """Issue 30 item 1: a rank that read the run dir mid-claim refused it and exited 2.

    Deterministic: the second rank's check runs at every step of the first rank's start (an
    audit hook before each file-system call), instead of hoping two processes interleave.
    """
    for run in (tmp_path / "new", tmp_path / "made"):  # a folder to create, and one that exists
        if run.name == "made":
            run.mkdir()
        proc = subprocess.run([sys.executable, "-c", _CLAIM_SCRIPT, str(run)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["calls"] >= 2, out  # the claim and the record were watched
        assert out["refused"] == [], out["refused"]
        assert is_run_dir(run) and (run / "config.yaml").is_file()
        assert sorted(p.name for p in run.iterdir()) == [RUN_MARKER, "config.yaml"]


def test_ranks_claiming_one_run_dir_at_once_make_one_marker(tmp_path: Path) -> None:
    """Many ranks claim the same folder: one create wins, the rest find the marker (no temp)."""
    import concurrent.futures

    from kfp_nvrx.components.core.ownership import claim_run_dir

    run = tmp_path / "run"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: claim_run_dir(run), range(16)))
    assert [p.name for p in run.iterdir()] == [RUN_MARKER]
    assert json.loads((run / RUN_MARKER).read_text())["kind"] == "run"
