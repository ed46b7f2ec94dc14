"""QuantMLA benchmark suite (not installed; run from the repository root).

``python -m pytest -m benchmark benchmarks/`` runs the pytest-benchmark suite;
``python -m benchmarks.memory``, ``python -m benchmarks.serving`` and ``python -m benchmarks.report``
are the memory table, the cache-pressure serving workload and the report generator.
"""
