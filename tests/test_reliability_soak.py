"""Drill: soak. Millions of mixed block operations from several engine processes on the CPU path.

The key space is larger than the pool, so slots are evicted and reused for other keys all the time:
the situation in which offloaders have served stale blocks and leaked pins. Every loaded block is
checked byte for byte against the content its key must have; at the end the pool's accounting must
be exact (bytes used == resident blocks x slot size; no lease, pin or job left) and the daemon's RSS
must have stayed flat (within 2 %) after warm-up.

One operation = one block named in one request (see tests/support/reliability_util.py: soak_worker).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from kvtest import ROOT, wait_until
from reliability_util import keyspace, proc_status, record

SLOT = 16384


def run_soak(make_daemon, total_ops: int, workers: int = 4, pool: str = "32MiB", keys: int = 3072,
             batch: int = 64, name: str = "soak") -> None:
    d = make_daemon(pool, "--log-level", "info", name=name)
    pid = d.proc.pid
    per = total_ops // workers + 1
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "reliability_util.py"), "soak",
                               "--address", d.address, "--engine-id", f"{name}-{i}", "--ops", str(per),
                               "--seed", str(i), "--keys", str(keys), "--batch", str(batch),
                               "--slot-bytes", str(SLOT), "--salt", name, "--namespace", name, "--hold"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for i in range(workers)]
    for p in procs:
        assert json.loads(p.stdout.readline()).get("ready"), "soak worker failed to start"
    samples: list[tuple[float, dict[str, int]]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.monotonic(), proc_status(pid)))
            stop.wait(0.25)

    t0 = time.monotonic()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    summaries = []
    try:
        for p in procs:  # every engine stays mapped until the last sample
            assert json.loads(p.stdout.readline() or "{}").get("done"), "soak worker failed"
        stop.set()
        sampler.join()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            out = p.stdout.read()
            assert p.wait(60) == 0, f"soak worker failed:\n{out}"
            summaries.append(json.loads(out.strip().splitlines()[-1])["summary"])
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
    wall = time.monotonic() - t0
    tot = {k: sum(s[k] for s in summaries) for k in summaries[0] if isinstance(summaries[0][k], int)}

    # --- every block byte-exact; no job lost; a leased block always loads -----------------------------
    assert tot["ops"] >= total_ops
    assert tot["mismatched_blocks"] == 0, f"{tot['mismatched_blocks']} loaded blocks held wrong bytes"
    assert tot["verified_blocks"] == tot["loaded_blocks"] > 0
    assert tot["leased_load_failed"] == 0, "a block pinned by a lease failed to load"
    assert tot["lost_notices"] == 0

    # --- the daemon's books -----------------------------------------------------------------------------
    c = d.client()
    assert wait_until(lambda: not c.stats()["engines"], 10), "workers' engines still registered"
    s = c.stats()
    cnt = s["counters"]
    assert s["in_flight_jobs"] == 0 and s["leases"] == 0
    assert s["pool"]["used_bytes"] == s["resident_blocks"] * SLOT, "pool bytes disagree with resident blocks"
    assert sum(ns["blocks"] for ns in s["namespaces"]) == s["resident_blocks"]
    assert cnt["stored_blocks"] - cnt["evicted_blocks"] == s["resident_blocks"]
    assert cnt["stored_blocks"] + cnt["store_noop_blocks"] + cnt["dropped_stores"] \
        + cnt["admission_refused_blocks"] == tot["store_keys"]  # the default policy refuses some
    assert cnt["loaded_blocks"] == tot["loaded_blocks"]
    assert cnt["lookup_hit_blocks"] == tot["lookup_hits"]
    assert cnt["lookup_hit_blocks"] + cnt["lookup_miss_blocks"] == tot["lookup_keys"]
    assert cnt["errors"] == 0
    sample_keys = keyspace(keys, name.encode())[:: max(1, keys // 512)]
    assert not any(e.get("held") for e in c.explain(name, sample_keys)), "a ref outlived its job/lease"
    cleared = c.clear(name)
    s2 = c.stats()
    assert cleared.removed_blocks == s["resident_blocks"]
    assert s2["pool"]["used_bytes"] == 0 and s2["resident_blocks"] == 0, "slots leaked past a CLEAR"

    # --- RSS flat after warm-up (the first third of the run) --------------------------------------------
    warm = samples[0][0] + (samples[-1][0] - samples[0][0]) / 3
    after = [st for t, st in samples if t >= warm]
    rss = [st["VmRSS"] for st in after]
    anon = [st["RssAnon"] for st in after]
    spread = (max(rss) - min(rss)) / min(rss)
    record(name, workers=workers, ops=tot["ops"], messages=tot["messages"], wall_s=round(wall, 1),
           ops_per_s=round(tot["ops"] / wall), loaded_blocks=tot["loaded_blocks"],
           verified_blocks=tot["verified_blocks"], stored_blocks=cnt["stored_blocks"],
           store_noop_blocks=cnt["store_noop_blocks"], evicted_blocks=cnt["evicted_blocks"],
           dropped_stores=cnt["dropped_stores"], admission_refused_blocks=cnt["admission_refused_blocks"],
           lookup_hit_rate=round(tot["lookup_hits"] / tot["lookup_keys"], 3),
           unleased_load_misses=tot["load_failed"], released_leases=tot["released_leases"],
           rss_kb_first=samples[0][1]["VmRSS"], rss_kb_after_warmup_min=min(rss), rss_kb_after_warmup_max=max(rss),
           rss_spread_pct=round(100 * spread, 2), rss_anon_kb_min=min(anon), rss_anon_kb_max=max(anon),
           rss_samples=len(rss), resident_end=s["resident_blocks"], used_bytes_end=s["pool"]["used_bytes"])
    assert len(rss) >= 5
    assert spread <= 0.02, f"daemon RSS moved {100 * spread:.2f} % after warm-up: {rss}"


def test_soak_one_million_block_operations(make_daemon):
    """CI variant: >= 1,000,000 block operations (about 20 s on 2 cores)."""
    run_soak(make_daemon, 1_000_000)


@pytest.mark.slow
def test_soak_ten_million_block_operations(make_daemon):
    """Long variant: 10,000,000 block operations (a few minutes)."""
    run_soak(make_daemon, 10_000_000, name="soak-long")
