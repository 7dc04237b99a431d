"""bench/ttft.py --cpu-smoke end to end: a real daemon (CPU backend), a storer, an engine, two
contending engines and a layer-wise store phase, each its own process; the loaded prefix KV must be
byte-exact and the greedy tokens after a hit equal those after recomputing, for today's whole-block
LOAD and the LOAD in parts (LANDED per part), for the in-process copy whole and in parts, and the
blocks a STORE in parts put in the pool must be the prefill's. (The H200 run is the same code with
the 8B shape.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ttft_module():
    spec = importlib.util.spec_from_file_location("bench_ttft", ROOT / "bench" / "ttft.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_ttft"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def test_parts_cut_a_block_contiguous_slot_at_layer_groups() -> None:
    t = _ttft_module()
    s = t.LLAMA3_8B
    assert s.layer_bytes * s.layers == s.block_bytes == 2 << 20
    four = t.Parts.of(s, 4)
    assert four.count == 8 and four.cuts == tuple(k * 4 * s.layer_bytes for k in range(1, 8))
    assert [four.of_layer(li) for li in (0, 3, 4, 31)] == [0, 0, 1, 7]
    assert [li for li in range(s.layers) if four.ends_part(li)] == [3, 7, 11, 15, 19, 23, 27, 31]
    assert t.Parts.of(s, 32).cuts == () and t.Parts.of(s, 64).count == 1  # one part: a whole-block job
    five = t.Parts.of(s, 5)  # a grouping that does not divide the layers: the last part is shorter
    assert five.count == 7 and five.cuts[-1] == 30 * s.layer_bytes and five.ends_part(31) and five.ends_part(29)
    tail = t.Parts.of(s, 4, tail=True)  # groups of 4 for layers 0-30, layer 31 alone
    assert tail.count == 9 and tail.cuts[-1] == 31 * s.layer_bytes and tail.cuts[-2] == 28 * s.layer_bytes
    assert [tail.of_layer(li) for li in (0, 27, 28, 30, 31)] == [0, 6, 7, 7, 8] and tail.label == "4+1"
    assert [li for li in range(s.layers) if tail.starts_part(li)] == [0, 4, 8, 12, 16, 20, 24, 28, 31]
    assert [li for li in range(s.layers) if tail.ends_part(li)] == [3, 7, 11, 15, 19, 23, 27, 30, 31]


@pytest.mark.slow
def test_cpu_smoke_hits_are_exact(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "ttft.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ttft.py"), "--cpu-smoke", "--lengths", "40", "64",
                           "--contention-length", "40", "--decode-tokens", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    s = r["summary"]
    assert s["prefix_kv_exact_all"] and s["tokens_hit_equal_split_all"], s
    assert s["contention"]["engines"] == 2 and s["contention"]["tokens_hit_equal_split"], s
    engine = r["engine"]
    assert engine["parts_supported"], "the daemon's HELLO_OK lists 'parts'"
    for n, res in engine["lengths"].items():
        assert res["hit_blocks"] == (int(n) - 1) // 16
        assert res["prefix_kv_inproc_equals_computed"] and res["tokens_inproc"] == res["tokens_hit"]
        assert len(res["tokens_hit"]) == 4
        # layer-wise: 2 layers, 1 per part: a LOAD in 2 parts, the suffix waiting for each
        assert res["parts"] == 2 and len(res["lw_hit_s"]) == 1
        assert res["prefix_kv_lw_equals_computed"] and res["tokens_lw_hit"] == res["tokens_split"], n
        assert res["prefix_kv_lw_inproc_equals_computed"] and res["tokens_lw_inproc"] == res["tokens_split"], n
        assert res["bound_s"] > 0 and res["lw_hit_over_bound"] > 0
    assert s["lw_prefix_kv_exact_all"] and s["lw_tokens_equal_split_all"], s
    sweep = engine["parts_sweep"]
    assert set(sweep["rows"]) == {"whole", "1"} and sweep["chosen_layers_per_part"] == 1
    assert all(row["prefix_kv_exact"] and row["first_token_equal_split"] for row in sweep["rows"].values()), sweep
    stores = r["stores"]
    assert stores["layers_per_part"] == 1 and set(stores["lengths"]) == {"40", "64"}
    for res in stores["lengths"].values():
        assert res["stored_bytes_exact"] and res["first_token_same"], res
        assert res["blocks"] == res["length"] // 16 and len(res["layered_visible_s"]) == 1
    assert r["store"]["fingerprint"] == engine["fingerprint"] == stores["fingerprint"]
