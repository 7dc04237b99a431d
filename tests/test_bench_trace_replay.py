"""bench/trace_replay.py on a small synthetic Mooncake-format trace, through real daemon processes.

The bench itself refuses to finish when the daemon's counters or per-request hits differ from its
own count and its model of the daemon's LRU; these tests also hold its figures to the ordering
every cache obeys (LRU <= optimum <= unbounded) and to the JSON schema bench/plot.py reads.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import trace_replay as T  # noqa: E402

CAPACITIES = (40, 120)


def synthetic_trace(path: Path, n: int = 200, seed: int = 7) -> Path:
    """Multi-turn conversations over a few shared system prompts, interleaved at random.

    Each turn re-sends its conversation's history and appends 1-6 blocks; a few long requests pass
    the smaller capacity, so stores that find no room (dropped from the end) are exercised too.
    """
    rng = random.Random(seed)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + k))
        next_id += k
        return out

    systems = [fresh(rng.randint(2, 5)) for _ in range(3)]
    convs: list[list[int]] = []
    lines = []
    for i in range(n):
        if not convs or rng.random() < 0.3:
            convs.append(list(rng.choice(systems)))
        c = rng.choice(convs[-12:])
        c += fresh(rng.randint(1, 6) if rng.random() > 0.03 else 45)
        tokens = len(c) * T.BLOCK_TOKENS - rng.randint(0, T.BLOCK_TOKENS - 1)  # a partial last block
        lines.append(json.dumps({"timestamp": i * 10, "input_length": tokens, "output_length": 20,
                                 "hash_ids": list(c)}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> tuple[dict, str, Path]:
    tmp = tmp_path_factory.mktemp("trace")
    trace = synthetic_trace(tmp / "synthetic.jsonl")
    out, png = tmp / "result.json", tmp / "hit_ratio.png"
    env = dict(os.environ)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "trace_replay.py"), "--trace", str(trace),
                        "--capacities", ",".join(map(str, CAPACITIES)), "--out", str(out), "--plot", str(png),
                        "--policy", "lru"],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, f"bench failed:\n{r.stdout}\n{r.stderr}"
    return json.loads(out.read_text()), r.stdout, png


def test_schema_and_plot(replayed):
    res, _, png = replayed
    assert res["daemon_policy"] == "lru"
    assert set(res) == {"trace", "block_tokens", "daemon_policy", "capacities", "policies", "token_policies", "unbounded",
                        "token_unbounded", "daemon_counters"}
    assert res["trace"] == "synthetic" and res["block_tokens"] == 512
    assert res["capacities"] == list(CAPACITIES)
    for group in ("policies", "token_policies"):
        assert set(res[group]) == {"daemon", "lru", "optimum"}
        assert all(len(v) == len(CAPACITIES) for v in res[group].values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_daemon_counts_what_the_bench_counts(replayed):
    res, out, _ = replayed
    assert "agree at every capacity" in out
    for cap in CAPACITIES:
        c = res["daemon_counters"][str(cap)]
        assert c["capacity_blocks"] == cap  # read back from STATS after the pool filled
        assert c["resident_blocks"] == cap
        assert c["evicted_blocks"] > 0 and c["lookup_hit_blocks"] > 0  # the trace really exercises the pool
        assert c["lookup_hit_blocks"] == c["bench_hit_blocks"] == c["loaded_blocks"] == c["bench_loaded_blocks"]
        assert c["lookups"] == 200
    assert res["daemon_counters"]["40"]["dropped_stores"] > 0  # a 45-block request cannot fit in 40


def test_lru_model_is_the_daemon_and_ordering_holds(replayed):
    res, _, _ = replayed
    p, tp = res["policies"], res["token_policies"]
    assert p["daemon"] == p["lru"] and tp["daemon"] == tp["lru"]
    for i in range(len(CAPACITIES)):
        assert p["lru"][i] <= p["optimum"][i] <= res["unbounded"]
        assert tp["lru"][i] <= tp["optimum"][i] <= res["token_unbounded"]
    assert p["lru"][0] < p["optimum"][0]  # at 40 blocks the optimum keeps what LRU loses
    assert p["lru"] == sorted(p["lru"]) and p["optimum"] == sorted(p["optimum"])


def test_optimum_keeps_prefixes_whole(tmp_path):
    """With chained ids the optimum's resident set stays prefix-closed: no resident block is ever
    found behind a missing parent (what makes its figure a bound on prefix hits)."""
    trace = T.load_trace(synthetic_trace(tmp_path / "s.jsonl"))
    assert T.prefix_consistent(trace)
    for cap in (5, *CAPACITIES):
        opt = T.simulate_optimum(trace, cap)
        assert opt.noop == 0 and opt.evicted > 0


def test_realtime_honours_timestamps(tmp_path):
    """--realtime: request i is not sent before its timestamp (relative to the first request)."""
    lines = [json.dumps({"timestamp": 50 * i, "input_length": 1024, "hash_ids": [0, i + 1]}) for i in range(21)]
    path = tmp_path / "timed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    trace = T.load_trace(path)
    res = T.run(trace, [8], 4096, realtime=True, log=lambda s: None)
    assert res.daemon_counters["8"]["seconds"] >= 1.0  # the last request is due 1,000 ms after the first
    assert res.daemon_counters["8"]["lookup_hit_blocks"] == 20  # block 0 hits from the second request on


def _brute_force_optimum(trace: T.Trace, capacity: int) -> int:
    """Most leading hits over every admit/evict choice (exponential: tiny traces only)."""
    best = 0
    reqs = trace.requests

    def go(i: int, cache: frozenset, hits: int) -> None:
        nonlocal best
        if i == len(reqs):
            best = max(best, hits)
            return
        ids = reqs[i].hash_ids
        h = 0
        while h < len(ids) and ids[h] in cache:
            h += 1
        states = {cache}
        for b in ids:  # each block in turn: keep out, or admit evicting any one (or none if room)
            nxt = set()
            for s in states:
                nxt.add(s)
                if b in s:
                    continue
                if len(s) < capacity:
                    nxt.add(s | {b})
                else:
                    nxt.update((s - {v}) | {b} for v in s)
            states = nxt
        for s in states:
            go(i + 1, s, hits + h)

    go(0, frozenset(), 0)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_optimum_is_the_true_optimum_on_tiny_traces(tmp_path, seed):
    rng = random.Random(seed)
    lines, tree = [], {0: [1, 2], 1: [3], 2: [4], 3: [], 4: []}
    for i in range(6):
        chain, node = [0], 0
        while tree[node] and rng.random() < 0.8:
            node = rng.choice(tree[node])
            chain.append(node)
        lines.append(json.dumps({"timestamp": i, "input_length": len(chain) * 512, "hash_ids": chain}))
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(lines) + "\n")
    trace = T.load_trace(path)
    for cap in (1, 2, 3):
        assert sum(T.simulate_optimum(trace, cap).hits) == _brute_force_optimum(trace, cap)
        assert sum(T.simulate_lru(trace, cap).hits) <= sum(T.simulate_optimum(trace, cap).hits)


def test_pool_geometry_holds_exactly_the_capacity():
    for cap in (1, 40, 120, 1000, 2000, 4000, 8000, 18000, 100_000):
        for block in (512, 1000, 4096):
            g = T.pool_geometry(cap, block)
            assert g.pool_bytes >= T.MIN_POOL and g.pool_bytes % T.PAGE == 0
            assert g.pool_bytes < T.POOL_CHUNK and g.pool_bytes // g.slot_bytes == cap


def test_default_policy_daemon_agrees_with_its_simulation(tmp_path):
    """With the default policy (guarded-doorkeeper) the bench holds the daemon to bench/policy_sim.py's
    simulation of that policy, request for request: the run finishing is the agreement."""
    trace = synthetic_trace(tmp_path / "synthetic.jsonl")
    out = tmp_path / "result.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "trace_replay.py"), "--trace", str(trace),
                        "--capacities", ",".join(map(str, CAPACITIES)), "--out", str(out)],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, f"bench failed:\n{r.stdout}\n{r.stderr}"
    assert "agree at every capacity" in r.stdout
    res = json.loads(out.read_text())
    assert res["daemon_policy"] == "guarded-doorkeeper"
    refused = [res["daemon_counters"][str(c)]["admission_refused_blocks"] for c in CAPACITIES]
    assert refused[0] > 0  # the small pool thrashes: the doorkeeper really refused first-time blocks
    for c in CAPACITIES:
        d = res["daemon_counters"][str(c)]
        assert d["bench_dropped_blocks"] == d["dropped_stores"] + d["admission_refused_blocks"]


def test_disk_blocks_add_disk_hits_and_loads_stay_exact(tmp_path):
    """--disk-blocks: a disk tier under each pool; the replay's LOADs are still checked byte for byte
    (a wrong byte stops the bench), and the disk serves hits the pool alone would have missed."""
    trace = T.load_trace(synthetic_trace(tmp_path / "synthetic.jsonl"))
    alone = T.run(trace, [40], 4096, policy="lru", log=lambda s: None)
    tiered = T.run(trace, [40], 4096, policy="lru", log=lambda s: None, disk_blocks=400)
    c = tiered.daemon_counters["40"]
    assert c["disk_hits"] > 0 and c["disk_promotion_failures"] == 0
    assert c["bench_loaded_blocks"] == c["bench_hit_blocks"]  # every hit was loaded, none failed
    assert tiered.policies["daemon"][0] > alone.policies["daemon"][0]
