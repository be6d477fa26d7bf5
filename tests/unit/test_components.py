"""Each component's ``python_func`` called directly with local artifacts (real work, tiny sizes).

One tiny training run (1 local node, 6 steps) is shared by the train/export/compare/promote
tests; the goodput timeline and Metrics mapping are also checked on synthetic events.
"""

import json
import os
import re
from pathlib import Path

import pytest
from kfp import dsl

from kfp_nvrx.components.core.events import parse_events
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.evaluate_promote.component import compare_models, promote_model
from kfp_nvrx.components.export_checkpoint.component import export_checkpoint
from kfp_nvrx.components.launch import ui_outputs
from kfp_nvrx.components.prepare_dataset.component import prepare_dataset
from kfp_nvrx.components.train_fsdp.component import train_fsdp

TINY = ["train.steps=6", "checkpoint.interval=3", "train.log_every=3"]


def _art(cls, root, name):
    return cls(name=name, uri=str(Path(root) / name), metadata={})


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("components")


@pytest.fixture(scope="module")
def dataset(work):
    ds = _art(dsl.Dataset, work / "art", "dataset")
    prepare_dataset.python_func(source="sample:200", workspace=str(work / "ws"), dataset=ds,
                                dataset_name="d1", seq_len=64, val_fraction=0.1)
    return ds


@pytest.fixture(scope="module")
def trained(work, dataset):
    arts = {n: _art(c, work / "art", n) for n, c in
            (("run", dsl.Artifact), ("metrics", dsl.Metrics), ("timeline", dsl.HTML))}
    train_fsdp.python_func(dataset=dataset, workspace=str(work / "ws"), overrides=TINY,
                           nodes="1", backend="local", kfp_run_id="run-123",
                           kfp_task="train-fsdp", **arts)
    return arts


@pytest.fixture(scope="module")
def exported(work, trained):
    model = _art(dsl.Model, work / "art", "model")
    metrics = _art(dsl.Metrics, work / "art", "export-metrics")
    export_checkpoint.python_func(run=trained["run"], model=model, metrics=metrics)
    return model, metrics


def test_prepare_dataset_writes_on_shared_volume_and_reuses(work, dataset):
    path = Path(dataset.metadata["path"])
    assert path == (work / "ws" / "datasets" / "d1").absolute()
    assert dataset.metadata["status"] == "written"
    index = json.loads((Path(dataset.path) / "index.json").read_text())
    assert index == json.loads((path / "index.json").read_text())
    assert index["splits"]["train"]["tokens"] == dataset.metadata["train_tokens"] > 0
    assert dataset.metadata["vocab_size"] == 256
    again = _art(dsl.Dataset, work / "art2", "dataset")
    prepare_dataset.python_func(source="sample:200", workspace=str(work / "ws"), dataset=again,
                                dataset_name="d1", seq_len=64, val_fraction=0.1)
    assert again.metadata["status"] == "skipped"
    assert again.metadata["fingerprint"] == dataset.metadata["fingerprint"]


def test_prepare_dataset_bad_source(work):
    with pytest.raises(UserError, match="source"):
        prepare_dataset.python_func(source=str(work / "missing.txt"), workspace=str(work / "ws"),
                                    dataset=_art(dsl.Dataset, work / "bad", "dataset"))


def test_train_fsdp_outputs(work, trained):
    run_dir = Path(trained["run"].metadata["path"])
    assert run_dir.parent == (work / "ws" / "runs").resolve()
    assert re.fullmatch(r"train-fsdp-[0-9a-f]{10}", run_dir.name)
    assert trained["run"].metadata["state"] == "Succeeded"
    assert (Path(trained["run"].path) / "events.jsonl").read_bytes() == \
        (run_dir / "events.jsonl").read_bytes()
    m = trained["metrics"].metadata
    # Snapshots at steps 3 and 6; the durable writes behind them take what the writer's pace
    # allows, and the final step always.
    assert m["steps_final"] == 6 and m["steps_redone"] == 0 and m["snapshots"] == 2
    assert 1 <= m["checkpoints"] <= 2 and m["snapshots_skipped"] == 0
    assert 0 < m["goodput"] <= 1 and m["final_loss"] > 0
    assert {"restarts_in_job", "restarts_in_process", "recovery_mean_s", "recovery_max_s",
            "checkpoint_stall_s", "snapshot_stall_s", "snapshot_stall_max_s"} <= set(m)
    page = Path(trained["timeline"].path).read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "<script" not in page
    assert "Steps kept" in page and f"{100 * m['goodput']:.1f}%" in page


def test_train_fsdp_init_from_checks(work, dataset):
    arts = {n: _art(c, work / "art-init", n) for n, c in
            (("run", dsl.Artifact), ("metrics", dsl.Metrics), ("timeline", dsl.HTML))}
    with pytest.raises(UserError, match="init_from"):
        train_fsdp.python_func(dataset=dataset, workspace=str(work / "ws"), overrides=TINY,
                               nodes="1", backend="local", init_from=str(work / "no-such-model"),
                               kfp_run_id="run-init", kfp_task="train-fsdp", **arts)
    from kfp_nvrx.components.launch.jobspec.naming import derive_name

    assert not (work / "ws" / "runs" / derive_name("run-init", "train-fsdp")).exists()
    assert not (work / "art-init").exists()  # no output written either


def test_export_checkpoint(exported, trained):
    from kfp_nvrx.components.training.export.evaluate import load_exported_model

    model, metrics = exported
    assert {"model.safetensors", "config.json", "export.json"} <= set(os.listdir(model.path))
    info = json.loads((Path(model.path) / "export.json").read_text())
    assert info["source_step"] == 6 == metrics.metadata["source_step"]
    assert metrics.metadata["eval_loss"] == pytest.approx(info["eval_loss"])
    assert model.metadata["sha256"] == info["sha256"]
    net = load_exported_model(model.path)
    assert sum(p.numel() for p in net.parameters()) == metrics.metadata["num_params"]


def test_compare_and_promote(work, exported, dataset):
    model, _ = exported
    promoted = work / "ws" / "models" / "m" / "promoted"
    first = _art(dsl.Metrics, work / "art", "cmp1")
    assert compare_models.python_func(candidate=model, dataset=dataset,
                                      promoted_dir=str(promoted), metrics=first) == "promote"
    assert first.metadata["promote"] == 1 and first.metadata["has_promoted_model"] == 0
    version = Path(promote_model.python_func(candidate=model, promoted_dir=str(promoted),
                                             kfp_run_id="run-123"))
    assert promoted.is_symlink() and promoted.resolve() == version.resolve()
    assert (promoted / "model.safetensors").read_bytes() == \
        (Path(model.path) / "model.safetensors").read_bytes()
    record = json.loads((version / "promotion.json").read_text())
    assert record["kfp_run_id"] == "run-123" and record["sha256"] == model.metadata["sha256"]
    # the same model again is not better than itself
    second = _art(dsl.Metrics, work / "art", "cmp2")
    assert compare_models.python_func(candidate=model, dataset=dataset,
                                      promoted_dir=str(promoted), metrics=second) == "keep"
    assert second.metadata["promote"] == 0
    assert second.metadata["candidate_eval_loss"] == pytest.approx(
        second.metadata["promoted_eval_loss"])
    assert second.metadata["candidate_eval_loss"] == pytest.approx(
        first.metadata["candidate_eval_loss"])


def test_compare_rejects_negative_margin(work, exported, dataset):
    with pytest.raises(UserError, match="min_improvement"):
        compare_models.python_func(candidate=exported[0], dataset=dataset,
                                   promoted_dir=str(work / "nothing"), min_improvement=-1.0,
                                   metrics=_art(dsl.Metrics, work / "art", "cmp3"))


def test_promote_refuses_a_real_directory(work, exported):
    real = work / "ws" / "models" / "hand" / "promoted"
    real.mkdir(parents=True)
    with pytest.raises(UserError, match="real directory"):
        promote_model.python_func(candidate=exported[0], promoted_dir=str(real))
    assert not (real.parent / "versions").exists() or not any(
        (real.parent / "versions").iterdir())


# -- report on synthetic events ----------------------------------------------------------------

def _events():
    """A run's events as its events.jsonl holds them: 6 steps, a fault, an in-job restart, 5 more."""
    ev = [{"type": "start", "time": 100.0, "incarnation": 0, "iteration": 0, "world_size": 2,
           "resumed_from": None, "load_s": 0.0}]
    t = 101.0
    for s in range(1, 7):
        ev.append({"type": "step", "time": t + 1, "step": s, "start": t, "end": t + 1,
                   "incarnation": 0, "iteration": 0, "loss": 5.0, "tokens": 10})
        t += 1
        if s == 3:
            ev.append({"type": "checkpoint", "time": t + 0.5, "step": 3, "blocking_s": 0.1,
                       "total_s": 0.5, "bytes": 2 ** 20})
    ev.append({"type": "fault", "time": t, "kind": "kill", "step": 6, "rank": 1})
    ev.append({"type": "restart", "time": t + 3, "kind": "in-job", "incarnation": 1,
               "iteration": 0})
    ev.append({"type": "start", "time": t + 4, "incarnation": 1, "iteration": 0,
               "world_size": 2, "resumed_from": 3, "load_s": 0.2})
    t += 5
    for s in range(4, 9):
        ev.append({"type": "step", "time": t + 1, "step": s, "start": t, "end": t + 1,
                   "incarnation": 1, "iteration": 0, "loss": 4.0, "tokens": 10})
        t += 1
    ev.append({"type": "end", "time": t, "step": 8, "status": "completed"})
    return ev


def test_metrics_from_summary():
    from kfp_nvrx.components.core.goodput import summarize_events

    m = ui_outputs.metrics_from_summary(summarize_events(parse_events(_events())).to_dict())
    assert m["steps_final"] == 8 and m["steps_run"] == 11 and m["steps_redone"] == 3
    assert m["restarts_in_job"] == 1 == m["restarts_total"] and m["restarts_in_process"] == 0
    assert m["recovery_max_s"] == pytest.approx(6.0) and m["faults"] == 1
    assert m["final_loss"] == 4.0 and m["checkpoint_stall_s"] == pytest.approx(0.1)
    assert all(isinstance(v, (int, float)) for v in m.values())
    no_loss = ui_outputs.metrics_from_summary({"restarts": {"in-process": 2, "other kind": 1}})
    assert "final_loss" not in no_loss and no_loss["restarts_in_process"] == 2
    assert no_loss["restarts_other_kind"] == 1 and no_loss["restarts_total"] == 3


def test_summary_says_what_happened_in_words():
    from kfp_nvrx.components.core.goodput import summarize_events

    events = _events()
    rep = summarize_events(parse_events(events))
    assert rep.what_happened == ["rank 1 killed at step 6, resumed from step 3 in 6.0 s, "
                                 "3 steps redone"]
    page = ui_outputs.render_timeline(parse_events(events), rep.to_dict(), "run-x")
    assert rep.what_happened[0] in page
    # no fault event (a real failure) and nothing committed: said so, every step redone
    crash = [dict(e, resumed_from=None) if e["type"] == "start" else e
             for e in events if e["type"] != "fault"]
    assert summarize_events(parse_events(crash)).what_happened == [
        "workers failed after step 6, restarted from scratch in 6.0 s, 6 steps redone"]
    # a fault-free run tells no story
    assert summarize_events(parse_events([e for e in events if _before_fault(e)])).what_happened == []


def _before_fault(e):
    return e["type"] in ("start", "step", "checkpoint") and e.get("incarnation", 0) == 0


def test_timeline_shows_every_kind_of_event():
    from kfp_nvrx.components.core.goodput import summarize_events

    events = parse_events(_events())
    page = ui_outputs.render_timeline(events, summarize_events(events).to_dict(), "run-x")
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    # kept steps merge into one segment per incarnation; steps 4-6 of incarnation 0 were redone
    assert "steps 1-3 kept (incarnation 0" in page and "steps 4-8 kept (incarnation 1" in page
    assert "steps 4-6 redone (incarnation 0" in page
    assert "fault: kill at step 6, rank 1" in page and "in-job restart (incarnation 1" in page
    assert "checkpoint step 3: 0.500 s total, 0.100 s blocking, 1.0 MiB" in page
    assert "resumed from step 3" in page and "recovery 6.00 s" in page
    assert "run-x" in page and "1 final" not in page and "8 final, 3 redone" in page
    for label in ("Steps kept", "Steps redone", "Checkpoints", "Faults", "Restarts"):
        assert label in page


def test_timeline_without_events():
    page = ui_outputs.render_timeline([], {}, "empty")
    assert "No events were recorded" in page and "<svg" in page
