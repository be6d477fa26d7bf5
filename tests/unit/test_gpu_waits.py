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


def test_no_wait_measured_or_a_stopped_loop_means_pace_at_once():
    waits = GpuWaits()
    t0 = time.perf_counter()
    assert not waits.wait_for(0.01, timeout=30)  # the loop never waited: no estimate
    with _Loop(waits, busy=0.01, wait=0.05):
        time.sleep(0.3)
    time.sleep(0.3)
    assert not waits.wait_for(0.001, timeout=0.2)  # the loop stopped waiting 0.3 s ago
    assert time.perf_counter() - t0 < 5


def test_a_piece_longer_than_the_waits_is_refused_at_once():
    waits = GpuWaits()
    with _Loop(waits, busy=0.01, wait=0.02):
        time.sleep(0.3)
        t0 = time.perf_counter()
        assert not waits.wait_for(0.5, timeout=30)
        assert time.perf_counter() - t0 < 5
        assert waits.budget() is not None and waits.budget() < 0.5


def test_yes_only_inside_a_wait_with_room_left():
    waits = GpuWaits()
    with _Loop(waits, busy=0.05, wait=0.3) as loop:
        time.sleep(0.8)
        answers = []
        for _ in range(10):
            ok = waits.wait_for(0.05, timeout=5)
            answers.append((ok, loop.inside))
            time.sleep(0.07)
    assert all(ok for ok, _ in answers)
    assert all(inside for _, inside in answers)


def test_bank_pins_every_piece_inside_the_loops_waits(monkeypatch, tmp_path):
    # Registration is CUDA's; here a recorder stands in for it and notes whether the loop was
    # waiting for the GPU when each piece was registered.
    seen: list[bool] = []
    loop_box: list[_Loop] = []
    monkeypatch.setattr(bank_mod, "_host_register",
                        lambda: lambda ptr, n, flags: seen.append(loop_box[0].inside) or 0)
    waits = GpuWaits()
    bank = bank_mod._Bank(0, tmp_path / "bank-0")
    piece, count = 64 << 10, 24
    bank.map(piece * count, create=True)
    try:
        with _Loop(waits, busy=0.1, wait=0.3) as loop:
            loop_box.append(loop)
            time.sleep(0.5)
            in_waits = bank.pin([(i * piece, piece) for i in range(count)], waits)
    finally:
        bank.pinned = []  # nothing was registered for real
        bank.unmap()
    assert len(seen) == count and in_waits == count
    assert all(seen), f"{seen.count(False)} of {count} pieces pinned while the loop launched"


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
