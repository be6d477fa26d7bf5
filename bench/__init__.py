"""GPU benchmarks of the shipped trainer: ``python -m bench.run`` / ``make bench``.

Each benchmark is a module runnable on its own (``python -m bench.<name> --out FILE``) that writes
one JSON file; :mod:`bench.run` runs them as subprocesses and :mod:`bench.summary` turns the JSON
into ``docs/benchmarks/`` (markdown table, PNG plots, ``summary.json``). Nothing here asserts a
timing: these are measurements, not tests.
"""
