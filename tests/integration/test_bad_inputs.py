"""Bad-input sweep: every bad input is one line naming the field, exit code 2, and nothing behind.

CLI and trainer cases run as real processes (``python -m kfp_nvrx.components.cli ...``), three at
a time, each in its own empty working directory: afterwards that directory and the shared
fixtures must be byte-for-byte unchanged (no run dir, out dir, YAML or partial file) and no
process carrying the case's environment marker may be alive. Kubernetes/KFP cases point at an
address where nothing listens, so an input checked too late shows up as a connection error
naming ``--host`` (or a kubeconfig error) instead of the expected field. Component cases call the
KFP components' Python functions in-process (the KFP executor would wrap any exception in its own
traceback); they must raise :class:`UserError` naming the parameter before anything is created.
No case may start training.

The table is tests/support/bad_input_cases.py plus, when present, tests/support/bad_input_cases_proc.py and
tests/support/bad_input_cases_io.py (their
``CASES``, ``COMPONENT_CASES`` and ``fixtures(fx) -> {placeholder: path}``). ``pytest -k <id>``
runs only the selected cases' processes.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.bad_input_cases import CASES as BASE_CASES
from support.bad_input_cases import SECRET, TWO_TO_THE_70, Case
from support.recorded_runs import recorded_run

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.trainer.bootstrap import LAUNCHER_ENV

SWEEP_ENV = "KFP_NVRX_SWEEP"


#: More case tables: the secrets/network/process classes, and what is read and written around
#: a run (outputs, run-dir files, init_from, kubeconfigs); each is used when it exists.
EXTRA_TABLES = ("bad_input_cases_proc", "bad_input_cases_io", "bad_input_cases_resume")


def _extra_modules() -> list:
    """The modules of :data:`EXTRA_TABLES` that exist."""
    found = []
    for name in EXTRA_TABLES:
        module = f"support.{name}"
        try:
            found.append(importlib.import_module(module))
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
    return found


EXTRA = _extra_modules()
CASES: list[Case] = [*BASE_CASES, *(c for m in EXTRA for c in getattr(m, "CASES", []))]


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size if p.is_file() else -1, st.st_mtime_ns)
    return out


def _alive_with(token: str) -> list[int]:
    needle = f"{SWEEP_ENV}={token}".encode()
    pids = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def _other_model_run(run_dir: Path, data: Path) -> None:
    """A run dir whose committed step 4 holds a model of other sizes (dim 32, not tiny's 64)."""
    import torch.distributed.checkpoint as dcp

    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.core.run_record import record_config
    from kfp_nvrx.components.core.rundir import COMMIT_MARKER, step_dir
    from kfp_nvrx.components.training.model import build_model

    cfg = load_config("tiny", ["model.dim=32", f"data.path={data}"])
    record_config(cfg, run_dir)  # complete records: a cut-down config.yaml is refused
    path = step_dir(run_dir / "checkpoints", 4)
    path.mkdir(parents=True)
    state = {"model": build_model(cfg.model).state_dict()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    (path / COMMIT_MARKER).write_text(json.dumps({"step": 4, "world_size": 1, "files": files}))


def _link_fixtures(fx: Path) -> dict[str, str]:
    """Run dirs of ours holding a link where we write; the targets are fixtures themselves."""
    from kfp_nvrx.components.core.ownership import claim_run_dir

    foreign = fx / "foreignsteps" / "step_00000001"
    foreign.mkdir(parents=True)
    (foreign / "COMMITTED").write_text('{"step": 1}')
    (fx / "precious.txt").write_text("years of work")
    out = {}
    for name, link, target in (("linkedckpt", "checkpoints", fx / "foreignsteps"),
                               ("linkedstep", "checkpoints/step_00000008", foreign),
                               ("linkedevents", "events.jsonl", fx / "precious.txt"),
                               ("linkedlog", "logs/node0.log", fx / "precious.txt")):
        run = claim_run_dir(fx / name)
        (run / link).parent.mkdir(parents=True, exist_ok=True)
        (run / link).symlink_to(target)
        out[name] = str(run)
    zero = claim_run_dir(fx / "zeroevents")
    (zero / "events.jsonl").symlink_to("/dev/zero")
    out["zeroevents"] = str(zero)
    return out


def _input_fixtures(fx: Path) -> dict[str, str]:
    """Devices, FIFOs, huge files, YAML bombs and numbers YAML 1.1 and 1.2 read differently."""
    os.mkfifo(fx / "pipe.txt")
    for name, kind in (("zeroindex", "zero"), ("fifoindex", "fifo"), ("bigindex", "big"),
                       ("deepindex", "deep")):
        (fx / name).mkdir()
        index = fx / name / "index.json"
        if kind == "zero":
            index.symlink_to("/dev/zero")
        elif kind == "fifo":
            os.mkfifo(index)
        elif kind == "big":
            index.write_text('{"format": "kfp-nvrx-tokens/1", "pad": "' + "x" * (17 << 20) + '"}')
        else:
            index.write_text("[" * 100_000 + "]" * 100_000)
    (fx / "big.yaml").write_text("# padding\n" * (220 << 10))  # 2.2 MiB of comments
    (fx / "bigtoken").write_text("t" * 100_000)
    laughs = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(8):
        prev, cur = chr(ord("a") + i), chr(ord("b") + i)
        laughs.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 9) + "]")
    yamls = {"bomb": "\n".join(laughs) + "\n", "deepyaml": "train: " + "[" * 10_000 + "]" * 10_000,
             "recursive": "train: &t {steps: *t}\n", "octal": "train: {steps: 010}\n",
             "hexyaml": "model: {vocab_size: 0x100}\n", "underscore": "train: {steps: 1_000}\n",
             "hexpath": "data: {path: 0x1F}\n", "hugesteps": f"train: {{steps: {TWO_TO_THE_70}}}\n"}
    out = {"fifo": str(fx / "pipe.txt"), "bigyaml": str(fx / "big.yaml"),
           "bigtoken": str(fx / "bigtoken"),
           **{name: str(fx / name) for name in ("zeroindex", "fifoindex", "bigindex", "deepindex")}}
    for name, text in yamls.items():
        (fx / f"{name}.yaml").write_text(text)
        out[name] = str(fx / f"{name}.yaml")
    return out


def _safetensors(path: Path, tensors: dict[str, tuple], body: int) -> None:
    """A safetensors file by hand: header length, JSON header, ``body`` bytes of data."""
    header = json.dumps({k: {"dtype": d, "shape": s, "data_offsets": o}
                         for k, (d, s, o) in tensors.items()}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(body))


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, str]:
    from kfp_nvrx.components.data.prepare import prepare_dataset

    fx = tmp_path_factory.mktemp("fixtures")
    data = fx / "data"
    prepare_dataset("sample:200", data, seq_len=64)
    truncated = fx / "truncated"
    prepare_dataset("sample:200", truncated, seq_len=64)
    shard = next(truncated.glob("train*"))
    os.truncate(shard, shard.stat().st_size // 2)
    (fx / "empty").mkdir()
    (fx / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (fx / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (fx / "bad.yaml").write_text("train: {steps: 3\n")
    (fx / "section.yaml").write_text("trainer: {steps: 3}\n")
    (fx / "kubeconfig").write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    _other_model_run(fx / "othermodel", data)
    (fx / "src").mkdir()
    (fx / "src" / "a.txt").write_text("\n\n".join(f"document {i} " * 30 for i in range(20)))
    (fx / "foreign" / "run").mkdir(parents=True)
    (fx / "foreign" / "config.yaml").write_text("database: {host: db}\n")
    (fx / "foreign" / "run" / "thesis.tex").write_text("years of work")
    (fx / "token2").write_text(f"{SECRET}\n{SECRET}\n")
    (fx / "tokenbin").write_bytes(b"\xff\xfe" + SECRET.encode())
    (fx / "dup.yaml").write_text("train:\n  steps: 3\n  lr: 0.01\n  steps: 5\n")
    (fx / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe train: {}")
    _safetensors(fx / "trunc.safetensors", {"w": ("F32", [4], [0, 16])}, body=8)
    _safetensors(fx / "other.safetensors", {"w": ("F32", [2], [0, 8])}, body=8)
    prepare_dataset("sample:150", fx / "data2", seq_len=64)
    recorded_run(fx / "recorded", str(data))
    recorded_run(fx / "damaged", str(data), damaged=True)
    extra = {**_link_fixtures(fx), **_input_fixtures(fx), "data2": str(fx / "data2"),
             "recorded": str(fx / "recorded"), "damaged": str(fx / "damaged")}
    for module in EXTRA:
        if hasattr(module, "fixtures"):
            extra.update(module.fixtures(fx))
    return {**extra, "src": str(fx / "src"), "foreign": str(fx / "foreign"),
            "token2": str(fx / "token2"), "tokenbin": str(fx / "tokenbin"),
            "dupkey": str(fx / "dup.yaml"), "binconfig": str(fx / "binary.yaml"),
            "truncst": str(fx / "trunc.safetensors"), "otherst": str(fx / "other.safetensors"),
            "fx": str(fx), "data": str(data), "truncated": str(truncated),
            "empty": str(fx / "empty"), "badjsonl": str(fx / "bad.jsonl"),
            "latin1": str(fx / "latin1.txt"), "badyaml": str(fx / "bad.yaml"),
            "badsection": str(fx / "section.yaml"), "othermodel": str(fx / "othermodel")}


def _run_case(case: Case, fixtures: dict[str, str], root: Path) -> dict:
    ws = root / case.id
    ws.mkdir()
    argv = [a.format(ws=ws, **fixtures) for a in case.argv]
    module = ("kfp_nvrx.components.cli" if case.program == "cli"
              else "kfp_nvrx.components.training.trainer")
    token = uuid.uuid4().hex
    env = {**os.environ, SWEEP_ENV: token, "KUBECONFIG": str(Path(fixtures["fx"], "kubeconfig")),
           **{k: v.format(ws=ws, **fixtures) for k, v in case.env}}
    for key in ("KFP_NVRX_REGISTRY", *LAUNCHER_ENV):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=ws, env=env,
                          capture_output=True, text=True, timeout=180)
    return {"rc": proc.returncode, "stderr": proc.stderr, "stdout": proc.stdout,
            "ws_after": _snapshot(ws), "alive": _alive_with(token)}


@pytest.fixture(scope="module")
def results(fixtures, tmp_path_factory, request) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("sweep")
    before = _snapshot(Path(fixtures["fx"]))
    selected = {item.callspec.params["case"].id for item in request.session.items
                if hasattr(item, "callspec") and isinstance(item.callspec.params.get("case"), Case)}
    run = [c for c in CASES if c.id in selected] or CASES
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {c.id: pool.submit(_run_case, c, fixtures, root) for c in run}
        out = {k: f.result() for k, f in futures.items()}
    out["__fixtures_unchanged__"] = before == _snapshot(Path(fixtures["fx"]))
    return out


def test_sweep_is_large_and_spans_every_surface() -> None:
    assert len(CASES) + len(COMPONENT_CASES) >= 300 and len({c.id for c in CASES}) == len(CASES)
    commands = {c.argv[0] for c in CASES if c.program == "cli"}
    assert {"prepare-data", "launch-local", "export", "render-job", "launch", "compile",
            "run-local", "submit", "schedule"} <= commands


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(case: Case, results) -> None:
    r = results[case.id]
    lines = r["stderr"].strip().splitlines()
    assert r["rc"] == 2, (r["rc"], r["stderr"][-2000:])
    assert len(lines) == 1, r["stderr"]
    assert "Traceback" not in r["stderr"] + r["stdout"]
    assert SECRET not in r["stderr"] + r["stdout"]
    assert "error: " in lines[0] and case.field in lines[0].split("error: ", 1)[1], lines[0]
    assert case.says in lines[0], lines[0]
    assert r["ws_after"] == {}, f"left behind: {sorted(r['ws_after'])}"
    assert r["alive"] == []


def test_no_case_touched_the_shared_fixtures(results) -> None:
    assert results["__fixtures_unchanged__"]


# -- KFP components, called as the KFP executor calls them (in-process) ----------------------------

COMPONENT_CASES = [  # (id, component, parameters, field the error must name)
    ("train-nodes", "train", {"nodes": "0"}, "nodes"),
    ("train-backend", "train", {"backend": "cloud"}, "backend"),
    ("train-instance-type", "train", {"instance_type": "p9.huge", "backend": "kubernetes"},
     "instance_type"),
    ("train-fault", "train", {"faults": ["explode@3"]}, "fault"),
    ("train-override", "train", {"overrides": ["train.steps=abc"]}, "train.steps"),
    ("train-init-from", "train", {"init_from": "{fx}/nope/model.safetensors"}, "init_from"),
    ("prepare-source", "prepare", {"source": "{fx}/nope.txt"}, "source"),
    ("prepare-seq-len", "prepare", {"seq_len": 0}, "seq_len"),
    ("export-no-checkpoint", "export", {"run_path": "{empty}"}, "run_dir"),
    ("export-step", "export", {"step": 7}, "step"),
    ("compare-min-improvement", "compare", {"min_improvement": -1.0}, "min_improvement"),
    *(c for m in EXTRA for c in getattr(m, "COMPONENT_CASES", [])),
]


def _call_component(kind: str, params: dict, ws: Path, fx: dict[str, str]):
    from kfp import dsl

    params = {k: v.format(**fx) if isinstance(v, str) else v for k, v in params.items()}
    out = ws / "outputs"
    if kind == "train":
        from kfp_nvrx.components.train_fsdp.component import train_fsdp

        args = dict(dataset=dsl.Dataset(uri=fx["data"], metadata={"path": fx["data"]}),
                    workspace=str(ws / "workspace"), run=dsl.Artifact(uri=str(out / "run")),
                    metrics=dsl.Metrics(uri=str(out / "metrics")),
                    timeline=dsl.HTML(uri=str(out / "timeline")), backend="local",
                    kfp_run_id="run-1", kfp_task="train-fsdp")
        return train_fsdp.python_func(**{**args, **params})
    if kind == "prepare":
        from kfp_nvrx.components.prepare_dataset.component import prepare_dataset

        args = dict(source="sample:", workspace=str(ws / "workspace"),
                    dataset=dsl.Dataset(uri=str(out / "dataset")))
        return prepare_dataset.python_func(**{**args, **params})
    if kind == "export":
        from kfp_nvrx.components.export_checkpoint.component import export_checkpoint

        run_path = params.pop("run_path", fx["othermodel"])
        args = dict(run=dsl.Artifact(uri=str(out / "run"), metadata={"path": run_path}),
                    model=dsl.Model(uri=str(out / "model")),
                    metrics=dsl.Metrics(uri=str(out / "metrics")))
        return export_checkpoint.python_func(**{**args, **params})
    from kfp_nvrx.components.evaluate_promote.component import compare_models

    args = dict(candidate=dsl.Model(uri=str(ws / "nope")),
                dataset=dsl.Dataset(uri=fx["data"], metadata={"path": fx["data"]}),
                promoted_dir=str(ws / "promoted"), metrics=dsl.Metrics(uri=str(out / "m")))
    return compare_models.python_func(**{**args, **params})


@pytest.mark.parametrize("case", COMPONENT_CASES, ids=[c[0] for c in COMPONENT_CASES])
def test_component_bad_parameter_is_a_user_error_before_anything_exists(
        case, fixtures, tmp_path, monkeypatch) -> None:
    _, kind, params, field = case  # (id, component, parameters, field the error must name)
    monkeypatch.setenv("KUBECONFIG", str(Path(fixtures["fx"], "kubeconfig")))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as err:
        _call_component(kind, dict(params), tmp_path, fixtures)
    assert field in err.value.field, err.value.one_line()
    assert "\n" not in err.value.one_line() and UserError.exit_code == 2
    assert _snapshot(tmp_path) == {}, sorted(_snapshot(tmp_path))
