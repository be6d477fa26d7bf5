"""The incarnation's heap frozen after its first step (trainer/heap.py).

``gc.freeze`` is process-wide: the freezing runs in a child process, never in the test's own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_frozen_heap_leaves_full_collections_and_refcounting_still_frees_it() -> None:
    code = textwrap.dedent("""
        import gc, time, weakref
        from kfp_nvrx.components.training.trainer.heap import CollectionClock, freeze_heap

        class Node:
            pass

        heap = [[Node() for _ in range(20)] for _ in range(20000)]  # 420,000 tracked objects
        t0 = time.perf_counter(); gc.collect(); before = time.perf_counter() - t0
        probe = Node()
        alive = weakref.ref(probe)
        frozen, _ = freeze_heap()
        clock = CollectionClock.shared()
        t0 = time.perf_counter(); gc.collect(); after = time.perf_counter() - t0
        seconds, full = clock.take()
        del probe  # frozen, but not in a cycle: refcounting frees it
        print(frozen, before, after, seconds, full, alive() is None)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    frozen, before, after, seconds, full, freed = out.stdout.split()
    assert int(frozen) > 420_000
    assert float(after) < float(before) / 10, (before, after)
    assert 0 < float(seconds) <= float(after) + 1e-6 and int(full) == 1
    assert freed == "True"
