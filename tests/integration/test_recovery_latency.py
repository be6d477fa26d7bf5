"""Recovery-latency settings: config fields, the ft_launcher flags they become, and the
in-process wrapper's configuration (``last_call_wait``, frozen heap, restart timing line).

The end-to-end restarts themselves (kill/hang/raise resume bit-exactly) are in
``test_trainer_resume.py``.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest

from kfp_nvrx.components.core.config import ResilienceConfig, load_config
from kfp_nvrx.components.core.launch_command import (
    FtLauncher,
    TrainerArgs,
    ft_flags,
    ft_launcher_argv,
    launcher_nvrx_version,
)
from kfp_nvrx.components.errors import UserError

GPU_POLL = "--ft-gpu-memory-poll-interval"


def test_defaults() -> None:
    res = load_config("tiny").resilience
    assert res.last_call_wait == 0.1
    assert res.launcher_poll_interval == 0.1


@pytest.mark.parametrize("item", [
    "resilience.last_call_wait=-0.5",
    "resilience.last_call_wait=nan",
    "resilience.last_call_wait=soon",
    "resilience.launcher_poll_interval=0",
    "resilience.launcher_poll_interval=-1",
    "resilience.launcher_poll_interval=61",
])
def test_bad_value_is_a_user_error_naming_the_field(item: str) -> None:
    field = item.split("=")[0]
    with pytest.raises(UserError) as err:
        load_config("tiny", [item])
    assert err.value.field == field
    assert "\n" not in err.value.one_line() and field in err.value.one_line()


def test_bad_value_in_python_and_yaml(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="resilience.last_call_wait"):
        ResilienceConfig(last_call_wait=-1)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("resilience: {launcher_poll_interval: 0}\n")
    with pytest.raises(UserError, match="resilience.launcher_poll_interval"):
        load_config(str(cfg))
    assert load_config("tiny", ["resilience.last_call_wait=0"]).resilience.last_call_wait == 0


def test_trainer_cli_bad_value_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kfp_nvrx.components.training.trainer", "--config", "tiny",
         "--run-dir", str(tmp_path / "run"), "--set", "resilience.launcher_poll_interval=0"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "resilience.launcher_poll_interval" in lines[0]
    assert not (tmp_path / "run").exists()


def test_launcher_flags_follow_the_poll_interval() -> None:
    res = load_config("tiny", ["resilience.launcher_poll_interval=0.25"]).resilience
    argv = ft_launcher_argv(res, TrainerArgs("tiny", "/r"), local_addr="$(POD_IP)")
    assert "--monitor-interval=0.25" in argv
    assert not any(a.startswith(GPU_POLL) for a in argv)  # pod: the image's NVRx is unknown
    assert f"{GPU_POLL}=0.25" in ft_flags(res, nvrx_version="0.7.0")
    assert f"{GPU_POLL}=0.25" in ft_flags(res, nvrx_version="1.0.0rc1")
    for old in ("0.4.1", "0.6.2", None, ""):
        assert not any(a.startswith(GPU_POLL) for a in ft_flags(res, nvrx_version=old))
    local = ft_launcher_argv(res, TrainerArgs("tiny", "/r"), local_addr="127.0.0.1",
                             launcher=FtLauncher("/elsewhere/bin/ft_launcher", "0.7.0"))
    assert f"{GPU_POLL}=0.25" in local


def test_iteration_file_flag_only_for_an_nvrx_that_reads_it() -> None:
    res = load_config("tiny").resilience
    flag = "--ft-checkpoint-iteration-file"
    new = ft_launcher_argv(res, TrainerArgs("tiny", "/runs/r1"), local_addr="127.0.0.1",
                           launcher=FtLauncher("/x/ft_launcher", "0.7.0"))
    assert f"{flag}=/runs/r1/checkpoints/latest_committed_step" in new
    assert new.index(f"{flag}=/runs/r1/checkpoints/latest_committed_step") < new.index("-m")
    for old in ("0.4.1", "0.6.2", None):  # 0.4.1 has no progress tracking and rejects the flag
        argv = ft_launcher_argv(res, TrainerArgs("tiny", "/runs/r1"), local_addr="127.0.0.1",
                                launcher=FtLauncher("/x/ft_launcher", old))
        assert not any(a.startswith(flag) for a in argv), old


def test_launcher_version_is_the_installed_one_only_for_this_environment() -> None:
    from importlib.metadata import version

    here = str(Path(sys.executable).parent / "ft_launcher")
    assert launcher_nvrx_version(here) == version("nvidia-resiliency-ext")
    assert launcher_nvrx_version("ft_launcher") is None
    assert launcher_nvrx_version("/venv/bin/ft_launcher") is None


@pytest.mark.slow
def test_installed_ft_launcher_knows_every_flag_we_pass_it() -> None:
    """launch-local's argv (version-dependent flags included) against this environment's parser."""
    import re

    exe = Path(sys.executable).parent / "ft_launcher"
    helped = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr[-2000:]
    known = set(re.findall(r"--[a-z][a-z0-9_-]*", helped.stdout))
    argv = ft_launcher_argv(ResilienceConfig(), TrainerArgs("tiny", "/r"), local_addr="127.0.0.1",
                            launcher=FtLauncher(str(exe)))
    ours = {a.split("=")[0] for a in argv[1:argv.index("-m")]}
    assert ours <= known, f"flags unknown to the installed ft_launcher: {ours - known}"


class _FakeWrapper:
    """Stands in for ``inprocess.Wrapper``: records its arguments, calls the function once."""

    seen: dict = {}

    def __init__(self, **kwargs) -> None:
        _FakeWrapper.seen = kwargs

    def __call__(self, fn):
        def wrapped(*args):
            return fn(*args, call_wrapper=None)

        return wrapped


def test_in_process_wrapper_settings_and_frozen_heap(monkeypatch) -> None:
    import gc

    from nvidia_resiliency_ext import inprocess

    from kfp_nvrx.components.training.trainer import resilience

    monkeypatch.setattr(inprocess, "Wrapper", _FakeWrapper)
    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    cfg = load_config("tiny", ["resilience.in_process=true",
                               "resilience.last_call_wait=0.05"]).resilience
    calls = []
    out = resilience.in_process_wrapper(cfg, store_port=1)(
        lambda *a, call_wrapper=None: calls.append(a) or "done")("job", "store")
    assert out == "done" and calls == [("job", "store")] and frozen == [True]
    kw = _FakeWrapper.seen
    assert kw["last_call_wait"] == datetime.timedelta(seconds=0.05)
    assert kw["soft_timeout"] < kw["hard_timeout"] < kw["barrier_timeout"]
    assert isinstance(kw["initialize"], inprocess.initialize.Initialize)
    assert isinstance(kw["finalize"], inprocess.finalize.Finalize)


def test_restart_clock_prints_the_split_on_rank_0(monkeypatch, capsys) -> None:
    from kfp_nvrx.components.training.trainer.restart_clock import RestartClock

    monkeypatch.setenv("RANK", "0")
    clock = RestartClock()
    clock.entered(0)
    clock.exited()
    clock.decided()
    clock.next_iteration()
    clock.entered(1)
    line = capsys.readouterr().out.strip()
    assert line.startswith("[trainer] in-process restart 1: exit->decision ")
    assert "wrapper total" in line
    clock.entered(2)  # nothing recorded since: no line
    monkeypatch.setenv("RANK", "1")
    clock.exited(), clock.decided(), clock.next_iteration(), clock.entered(3)
    assert capsys.readouterr().out == ""


def test_boot_record_splits_the_worker_start() -> None:
    import time
    from types import SimpleNamespace

    from kfp_nvrx.components.training.trainer.__main__ import boot_parts, process_start_time
    from kfp_nvrx.components.training.trainer.train import boot_line, boot_record

    started = process_start_time()
    assert started is not None and 0 <= time.time() - started < 3600
    first = boot_parts(100.0, 100.5, 103.0, {"checks": 0.5, "cuda_context": 1.0, "nvrx_client": 0.2})
    assert list(first) == ["interpreter", "imports", "checks", "cuda_context", "nvrx_client"]
    job = SimpleNamespace(boot=first, boot_origin=100.0, boot_mark=107.0)
    marks = [("pg_init", 108.5), ("monitor_connect", 108.75), ("load", 110.0)]
    boot = boot_record(job, 0, marks, 108.0, 110.25)
    assert boot["wrapper"] == 1.0 and boot["pg_init"] == 0.5 and boot["load"] == 1.25
    assert boot["total"] == 10.25 and sum(v for k, v in boot.items() if k != "total") <= 10.25
    # An in-process re-entry: only its own parts, timed from the re-entry.
    again = boot_record(job, 1, marks, 108.0, 110.25)
    assert list(again) == ["pg_init", "monitor_connect", "load", "total"]
    assert again["total"] == 2.25
    line = boot_line(boot)
    assert line.startswith("boot: interpreter ") and line.endswith("; total 10.25s")
    assert "cuda_context 1.00s" in line
