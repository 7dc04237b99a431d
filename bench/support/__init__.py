"""What the benches share, so that no bench reaches into tests/ for it.

A bench script runs as ``python bench/<name>.py``: its own folder is first on ``sys.path``, so
``from support.daemon import BenchDaemon`` needs no path trick (tests that import a bench put
``bench/`` on the path, as tests/test_bench_*.py do).

* ``support.daemon``: one kvoffd for a bench, ready on its own READY=1, its pool given back at the end.
* ``support.valkey_cluster``: real Valkey/Redis servers and 3-shard clusters (the cluster tier's benches
  and tests).
"""
