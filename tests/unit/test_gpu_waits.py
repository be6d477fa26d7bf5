"""Background pinning runs while the loop waits for the GPU, and paces itself otherwise."""

from __future__ import annotations

import threading
import time

import pytest

from kfp_nvrx.components.training.checkpoint import bank as bank_mod
from kfp_nvrx.components.training.checkpoint.gpu_waits import GpuWaits


class _Loop:
    """A training loop's rhythm: launches (busy) then a wait for the GPU, until stopped."""

    def __init__(self, waits: GpuWaits, busy: float, wait: float) -> None:
        self.waits, self.busy, self.wait = waits, busy, wait
        self.inside = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            time.sleep(self.busy)
            with self.waits.waiting():
                self.inside = True
                time.sleep(self.wait)
                self.inside = False

    def __enter__(self) -> _Loop:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def test_no_wait_measured_or_a_stopped_loop_means_no_room():
    waits = GpuWaits()
    assert not waits.room(0.01)  # the loop never waited: no estimate
    with _Loop(waits, busy=0.01, wait=0.05):
        time.sleep(0.3)
    assert waits.budget() is not None
    assert not waits.room(0.001)  # the loop stopped: no wait is open


def test_a_piece_longer_than_the_waits_has_no_room():
    waits = GpuWaits()
    with _Loop(waits, busy=0.01, wait=0.02):
        time.sleep(0.3)
        assert not any(waits.room(0.5) for _ in range(50))
        assert waits.budget() is not None and waits.budget() < 0.5


def test_room_only_inside_a_wait_with_room_left():
    waits = GpuWaits()
    with _Loop(waits, busy=0.05, wait=0.3) as loop:
        time.sleep(0.8)
        answers = []
        for _ in range(40):
            ok = waits.room(0.05)
            answers.append((ok, loop.inside))
            time.sleep(0.02)
    assert any(ok for ok, _ in answers)
    assert all(inside for ok, inside in answers if ok)


def _recording_register(monkeypatch, seen: list[bool], loop: _Loop, seconds: float) -> None:
    """Registration is CUDA's; here a recorder stands in for it (taking ``seconds``) and notes
    whether the loop was waiting for the GPU when each piece was registered."""
    def register(ptr: int, n: int, flags: int) -> int:
        seen.append(loop.inside)
        time.sleep(seconds)
        return 0

    monkeypatch.setattr(bank_mod, "_host_register", lambda: register)


def _pin_beside(loop: _Loop, tmp_path, count: int, settle) -> tuple[int, float]:
    """Pins a bank of ``count`` pieces while ``loop`` runs (once ``settle()`` returned):
    the pieces pinned in its waits and the seconds it took."""
    bank = bank_mod._Bank(0, tmp_path / "bank-0")
    piece = 64 << 10
    bank.map(piece * count, create=True)
    try:
        with loop:
            settle()
            t0 = time.perf_counter()
            in_waits = bank.pin([(i * piece, piece) for i in range(count)], loop.waits)
            return in_waits, time.perf_counter() - t0
    finally:
        bank.pinned = []  # nothing was registered for real
        bank.unmap()


def test_bank_pins_in_the_loops_waits_where_it_finds_them(monkeypatch, tmp_path):
    seen: list[bool] = []
    loop = _Loop(GpuWaits(), busy=0.1, wait=0.3)
    _recording_register(monkeypatch, seen, loop, 0.005)
    in_waits, _ = _pin_beside(loop, tmp_path, 40, lambda: time.sleep(0.5))
    assert len(seen) == 40 and 0 < in_waits <= seen.count(True)


def test_no_piece_waits_for_the_loop_to_wait(monkeypatch, tmp_path):
    # A loop that seldom waits for the GPU: the pieces go paced rather than holding the bank
    # back until a wait opens (that made 1b banks take 20-27 s instead of ~10 s).
    seen: list[bool] = []
    loop = _Loop(GpuWaits(), busy=1.5, wait=0.2)
    _recording_register(monkeypatch, seen, loop, 0.01)

    def first_wait_measured() -> None:
        while not loop.waits.budget():
            time.sleep(0.01)

    _, took = _pin_beside(loop, tmp_path, 10, first_wait_measured)
    assert len(seen) == 10
    assert took < 1.2, took  # paced: ~0.2 s; waiting for the next wait: 1.5 s at least


def test_bank_without_a_loop_pins_paced_and_finishes(monkeypatch, tmp_path):
    calls: list[float] = []
    monkeypatch.setattr(bank_mod, "_host_register",
                        lambda: lambda ptr, n, flags: calls.append(time.perf_counter()) or 0)
    bank = bank_mod._Bank(0, tmp_path / "bank-0")
    piece = 64 << 10
    bank.map(piece * 8, create=True)
    t0 = time.perf_counter()
    try:
        in_waits = bank.pin([(i * piece, piece) for i in range(8)], GpuWaits())
    finally:
        bank.pinned = []
        bank.unmap()
    assert len(calls) == 8 and in_waits == 0
    assert time.perf_counter() - t0 < 10  # never waits for a loop that does not run


def test_a_failed_registration_names_its_size(monkeypatch, tmp_path):
    monkeypatch.setattr(bank_mod, "_host_register", lambda: lambda ptr, n, flags: 2)
    bank = bank_mod._Bank(0, tmp_path / "bank-0")
    bank.map(4096, create=True)
    try:
        with pytest.raises(bank_mod.StagingUnavailable, match="cudaHostRegister"):
            bank.pin([(0, 4096)])
    finally:
        bank.unmap()
