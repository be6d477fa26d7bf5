"""The fault-kind registry: one entry makes a kind that is parsed, checked, fired and counted.

Every reader of kinds goes through ``core.faults.FAULT_KINDS``: the syntax (``parse_fault``,
``check_faults``), the trainer's injector and loop, the drills (expected restarts, torn steps,
rank folding), the CLI help and the KFP parameter descriptions. A kind registered here, in the
test, goes through all of them without another file knowing it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from kfp_nvrx.components.cli.main import main
from kfp_nvrx.components.core.faults import (
    FAULT_KINDS,
    Fault,
    FaultKind,
    Param,
    When,
    check_faults,
    fault_verb,
    parse_fault,
)
from kfp_nvrx.components.drills.scenarios import Placement, Scenario, restarts_expected
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.training.trainer.fault_injector import FaultInjector

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def freeze():
    """A new kind, registered for one test: blocks the checkpoint writer for ``seconds``."""
    fired: list[str] = []
    kind = FaultKind("freeze", "froze its checkpoint", When.CHECKPOINT,
                     "block the checkpoint writer", True,
                     lambda f, _run_dir: fired.append(f"{f} for {f.param('seconds')} s"),
                     (Param("seconds", 2, "how long the writer blocks", minimum=1),))
    FAULT_KINDS.register(kind)
    yield kind, fired
    FAULT_KINDS.unregister("freeze")


def test_a_registered_kind_is_parsed_and_checked(freeze) -> None:
    kind, _ = freeze
    assert "freeze" in FAULT_KINDS.listing() and fault_verb("freeze") == "froze its checkpoint"
    assert parse_fault("freeze@8/1") == Fault(kind, 8, 1)
    assert parse_fault("freeze@8/1:seconds=5") == Fault(kind, 8, 1, (("seconds", 5),))
    assert parse_fault("freeze@8").param("seconds") == 2  # the kind's default
    assert check_faults(["freeze@8/1", "kill@3"], steps=16, interval=4, world_size=2) == [
        Fault(kind, 8, 1), Fault(FAULT_KINDS.get("kill"), 3, 0)]
    bad = {"freeze@6/1": "needs a checkpoint step", "freeze@8:seconds=0": "seconds must be",
           "freeze@8:seconds=1.5": "must be a whole number", "freeze@8:speed=1": "known: seconds",
           "freeze@8:seconds=2,seconds=3": "each once", "freeze@20": "after the last step",
           "freeze@8/2": "aims at rank 2"}
    for text, needle in bad.items():
        with pytest.raises(UserError, match=re.escape(needle)) as err:
            check_faults([text], steps=16, interval=4, world_size=2)
        assert err.value.field == "faults", text
    with pytest.raises(ValueError, match="registered already"):
        FAULT_KINDS.register(kind)


def test_a_registered_kind_is_fired_by_the_injector_and_the_loop(freeze, tmp_path) -> None:
    from kfp_nvrx.components.training.trainer.loop import Trainer

    kind, fired = freeze
    fault = parse_fault("freeze@8/1:seconds=5")
    injector = FaultInjector([fault, parse_fault("kill@8/0")], tmp_path, rank=1)
    assert injector.due(8, When.STEP) is None  # fires in the checkpoint, not in the step
    # The loop asks at each point of a step; the faulting rank logs it and fires it once.
    trainer = SimpleNamespace(injector=injector, place=SimpleNamespace(rank=1),
                              events=SimpleNamespace(path=tmp_path / "events.jsonl"))
    Trainer._fault(trainer, 8, When.CHECKPOINT)
    Trainer._fault(trainer, 8, When.CHECKPOINT)
    assert fired == ["freeze@8/1:seconds=5 for 5 s"]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["type"], e["kind"], e["step"], e["rank"]) for e in events] == [
        ("fault", "freeze", 8, 1)]


def test_a_registered_kind_is_counted_by_the_drills(freeze) -> None:
    sc = Scenario("freeze-writer", "rank 1's writer blocks at step 8", faults=("freeze@8/1",))
    assert sc.least_restarts() == 1 and sc.torn_steps() == [8]
    assert Placement("cuda", 1).faults(sc) == ["freeze@8/0"]  # folded onto the one rank
    stall = Scenario("stall", "a slow read", faults=("stall@5/1:seconds=4", "freeze@4/1"))
    assert restarts_expected(stall.parsed_faults()) == 1  # a healthy stall restarts nothing
    assert Placement().faults(stall) == ["stall@5/1:seconds=4", "freeze@4/1"]


def test_every_builtin_kind_has_its_point_and_nature() -> None:
    kinds = {k.name: (k.when, k.failure) for k in FAULT_KINDS}
    assert kinds == {"kill": (When.STEP, True), "raise": (When.STEP, True),
                     "hang": (When.STEP, True), "kill-in-ckpt": (When.CHECKPOINT, True),
                     "stall": (When.STEP, False), "slow-write": (When.STEP, False),
                     "node-lost": (When.STEP, True)}
    assert parse_fault("stall@3").param("seconds") == 3.0
    assert parse_fault("slow-write@3:seconds=60").param("seconds") == 60.0
    assert str(parse_fault(" hang@3 ")) == "hang@3/0"
    with pytest.raises(UserError, match="takes NAME=VALUE"):
        parse_fault("kill@3:seconds=1")


def test_no_list_of_kinds_is_written_by_hand() -> None:
    """Help texts and KFP descriptions derive the list; no source spells it out."""
    spelled = re.compile(r"\bkill, raise\b")
    for path in [*ROOT.joinpath("components").rglob("*.py"), *ROOT.joinpath("pipelines").glob("*.py")]:
        assert not spelled.search(path.read_text()), path


@pytest.mark.parametrize("name", ["fsdp-train", "scheduled-retrain"])
def test_compiled_descriptions_list_every_kind(name: str) -> None:
    spec = next(yaml.safe_load_all((ROOT / "pipelines" / "compiled" / f"{name}.yaml").read_text()))
    inputs = [spec["root"], *spec["components"].values()]
    described = [" ".join(i["inputDefinitions"]["parameters"]["faults"]["description"].split())
                 for i in inputs if "faults" in i.get("inputDefinitions", {}).get("parameters", {})]
    assert described, name
    for text in described:
        assert FAULT_KINDS.listing() in text, text


def test_the_help_of_every_launcher_and_the_trainer_derive_them(capsys, monkeypatch) -> None:
    from kfp_nvrx.components.training.trainer.__main__ import parse_args

    monkeypatch.setenv("COLUMNS", "300")  # argparse wraps at a hyphen (kill-in-ckpt)

    # launch and render-job too (issue 38 item 8: only launch-local listed them)
    for show in (lambda: main(["launch-local", "--help"]), lambda: parse_args(["--help"]),
                 lambda: main(["launch", "--help"]), lambda: main(["render-job", "--help"])):
        with pytest.raises(SystemExit):
            show()
        assert FAULT_KINDS.listing() in " ".join(capsys.readouterr().out.split())


def test_a_kill_after_commits_waits_for_the_commits_then_fires_once(tmp_path, monkeypatch) -> None:
    from kfp_nvrx.components.training.trainer import fault_injector

    commits: list[int] = []
    monkeypatch.setattr(fault_injector, "open_store",
                        lambda _run_dir: type("S", (), {"committed_steps": lambda self: commits})())
    injector = fault_injector.FaultInjector(
        [parse_fault("kill@14/1:after_commits=1"), parse_fault("kill@3/1")], tmp_path, rank=1)
    assert injector.due(13, When.STEP) is None
    assert injector.due(14, When.STEP) is None  # no commit yet: it waits
    assert injector.due(4, When.STEP) is None  # a plain fault fires at its step only
    commits.append(12)
    fired = injector.due(16, When.STEP)
    assert fired is not None and fired.step == 14
    assert injector.due(17, When.STEP) is None  # once
