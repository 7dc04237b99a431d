"""The layering is checked, not hoped for: the import contracts of pyproject.toml ([tool.importlinter])
hold for the tree, and a contract that breaks is reported (so the check is not vacuous).

The contracts (docs/architecture.md, "Layers"): the client library never imports the daemon; cache and
transfer never import the server; the daemon takes nothing of the client library but the wire contract
(``kvoffd_client.protocol``) and the shared places (``kvoffd_client.paths``); ops reaches the daemon
only through the client library; transfer imports the pool, never the cache; and the floors (server over
events over cache and transfer, side by side, over pool) have no arrow that runs back up.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the tree at ``root``: its kvoffd/ and client/kvoffd_client/ come first on the path,
    whatever is installed in the environment."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "client")]))
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    res = _lint_imports(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout and "6 kept" in res.stdout, res.stdout


def test_a_broken_layer_is_reported(tmp_path):
    """A copy of the tree where the transfer layer imports the server and the cache, the pool the cache,
    and the client library the daemon: each contract must fail, naming the offending import."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "kvoffd", tmp_path / "kvoffd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "client" / "kvoffd_client", tmp_path / "client" / "kvoffd_client",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "kvoffd" / "transfer" / "base.py", "a") as f:
        f.write("\nimport kvoffd.server.sessions  # noqa: E402, F401\n")
    with open(tmp_path / "client" / "kvoffd_client" / "paths.py", "a") as f:
        f.write("\nimport kvoffd.config  # noqa: E402, F401\n")
    with open(tmp_path / "kvoffd" / "transfer" / "cpu.py", "a") as f:
        f.write("\nimport kvoffd.cache.index  # noqa: E402, F401\n")
    with open(tmp_path / "kvoffd" / "pool" / "allocator.py", "a") as f:
        f.write("\nimport kvoffd.cache.entries  # noqa: E402, F401\n")
    res = _lint_imports(tmp_path)
    assert res.returncode != 0, res.stdout
    assert "cache and transfer never import the server BROKEN" in res.stdout, res.stdout
    assert "kvoffd.transfer.base -> kvoffd.server.sessions" in res.stdout, res.stdout
    assert "the client library never imports the daemon BROKEN" in res.stdout, res.stdout
    assert "kvoffd_client.paths -> kvoffd.config" in res.stdout, res.stdout
    assert "transfer imports pool, never cache BROKEN" in res.stdout, res.stdout
    assert "kvoffd.transfer.cpu -> kvoffd.cache.index" in res.stdout, res.stdout
    assert "no arrow runs back up BROKEN" in res.stdout, res.stdout
    assert "kvoffd.pool.allocator -> kvoffd.cache.entries" in res.stdout, res.stdout
