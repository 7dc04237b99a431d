"""bench/ttft.py --cpu-smoke end to end: a real daemon (CPU backend), a storer, an engine and two
contending engines, each its own process; the loaded prefix KV must be byte-exact and the greedy
tokens after a hit equal those after recomputing. (The H200 run is the same code with the 8B shape.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("torch")


@pytest.mark.slow
def test_cpu_smoke_hits_are_exact(tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ttft.py"), "--cpu-smoke", "--lengths", "40", "64",
                           "--contention-length", "40", "--decode-tokens", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    s = r["summary"]
    assert s["prefix_kv_exact_all"] and s["tokens_hit_equal_split_all"], s
    assert s["contention"]["engines"] == 2 and s["contention"]["tokens_hit_equal_split"], s
    for n, res in r["engine"]["lengths"].items():
        assert res["hit_blocks"] == (int(n) - 1) // 16
        assert res["prefix_kv_inproc_equals_computed"] and res["tokens_inproc"] == res["tokens_hit"]
        assert len(res["tokens_hit"]) == 4
    assert r["store"]["fingerprint"] == r["engine"]["fingerprint"]
