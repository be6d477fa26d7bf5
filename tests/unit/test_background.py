"""Background work yields the CPU to the training loop on a GPU host (core/background.py)."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import Future

import pytest

from kfp_nvrx.components.core import background
from kfp_nvrx.components.training.checkpoint.async_save import _write_then_seal
from kfp_nvrx.components.training.checkpoint.commit import CommitJob
from kfp_nvrx.components.training.checkpoint.integrity import Sealer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(fn) -> int:
    """Runs ``fn`` on a fresh thread (a lowered thread never gets its priority back)."""
    out: Future = Future()
    threading.Thread(target=lambda: out.set_result(fn())).start()
    return out.result(timeout=30)


def test_nothing_is_lowered_unless_the_trainer_asked(monkeypatch):
    monkeypatch.delenv(background.NICE_ENV, raising=False)
    loop = _nice()

    def work() -> int:
        background.yield_to_loop()
        return _nice()

    assert _in_thread(work) == loop


def test_a_background_thread_is_lowered_and_the_loop_is_not(monkeypatch):
    monkeypatch.delenv(background.NICE_ENV, raising=False)
    loop = _nice()
    background.lower_background_work()
    assert os.environ[background.NICE_ENV] == str(background.BACKGROUND_NICE)

    def work() -> tuple[int, int]:
        background.yield_to_loop()
        child = _in_thread(_nice)  # threads it starts inherit the lowered priority
        return _nice(), child

    mine, child = _in_thread(work)
    assert mine == child == max(loop, background.BACKGROUND_NICE)
    assert _nice() == loop


def test_checkpoint_background_threads_yield(monkeypatch, tmp_path):
    monkeypatch.setenv(background.NICE_ENV, "12")
    loop = _nice()
    want = max(loop, 12)
    sealer = Sealer(None, threading.Lock())  # type: ignore[arg-type]
    assert sealer.pool().submit(_nice).result(timeout=30) == want  # CRC32 threads
    job = CommitJob([_nice])  # rank 0's commit file work
    job.join(30)
    assert job.result == want
    seen: list[int] = []  # the writer process's job: NVRx's write runs after the lowering
    _in_thread(lambda: _write_then_seal(lambda *a: seen.append(_nice()), lambda files: None, 0, []))
    assert seen == [want]
    assert _nice() == loop
