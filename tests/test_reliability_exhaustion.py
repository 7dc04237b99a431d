"""Drill: exhaustion. A pool full of leased blocks; a client that floods and never reads.

What must hold (issue 6, drill 4; anchors §6.2 — LMCache #3187, an allocator exhausted for good after
hours): with every slot leased, stores are dropped and counted, loads of resident blocks still
succeed byte for byte, nothing waits. A client that sends and never reads its replies does not slow
other clients, and the daemon's memory stops growing once that client's reply queue is full (the
ROUTER's SNDHWM: 10,000 messages per peer, the rest dropped).

tests/test_core_daemon.py::test_full_pool_of_pinned_blocks_drops_stores_without_blocking checks one
dropped store; this drill checks hundreds, their latency, the metric, and loads running meanwhile.
"""

from __future__ import annotations

import statistics
import threading
import time

from kvtest import chain_keys, wait_until
from reliability_util import RawPeer, ShmEngine, metric_value, record, rss_kb

from kvoffd_client import protocol as P

SLOT = 16384


def test_full_pool_of_leased_blocks(make_daemon):
    d = make_daemon("1MiB", "--eviction-policy", "lru", name="full")  # 64 slots of 16 KiB (lru: no refusals)
    eng = ShmEngine(128, SLOT, tag="full")
    c = d.client(job_deadline_s=10.0)
    try:
        c.register("full-0", "full", 0, 1, eng.memory, eng.layout)
        keys = chain_keys(64, b"full")
        eng.fill(range(64), keys)
        c.submit_store("full-0", 1, keys, range(64))
        assert c.wait_notices({1}, 10)[0].ok
        lease = c.lookup("full", keys, lease_ms=600_000)
        assert lease.hits == 64
        used = c.stats()["pool"]["used_bytes"]
        assert used == 64 * SLOT
        jobs, lat = 200, []
        for j in range(jobs):  # 200 stores of 16 new keys each: all must be dropped, at once
            new = chain_keys(16, b"new-%d" % j)
            eng.fill(range(64, 80), new)
            t0 = time.monotonic()
            c.submit_store("full-0", 10 + j, new, range(64, 80))
            n = c.wait_notices({10 + j}, 10)
            lat.append(time.monotonic() - t0)
            assert n and not n[0].ok and n[0].code == "pool_full" and n[0].failed == list(range(16)), n
            if j % 20 == 0:  # resident blocks still load, byte for byte, while stores are refused
                eng.poison(range(80, 128))
                c.submit_load("full-0", 5000 + j, keys[:48], range(80, 128))
                ln = c.wait_notices({5000 + j}, 10)
                assert ln and ln[0].ok, ln
                assert eng.matches(range(80, 128), keys[:48]).all()
        s = c.stats()
        assert s["pool"]["used_bytes"] == used and s["resident_blocks"] == 64
        dropped = metric_value(d.metrics(), 'kvoffd_dropped_stores_total{reason="pool_full"}')
        assert dropped == jobs * 16 == s["counters"]["dropped_stores"]
        # the lease goes: room again, by eviction
        c.release(lease.lease_id)
        assert wait_until(lambda: c.stats()["leases"] == 0, 5)
        c.submit_store("full-0", 9999, chain_keys(16, b"after"), range(64, 80))
        assert c.wait_notices({9999}, 10)[0].ok
        lat.sort()
        record("exhaustion_full_pool", slots=64, store_jobs_dropped=jobs, blocks_dropped=int(dropped),
               drop_notice_ms_median=round(1000 * statistics.median(lat), 2),
               drop_notice_ms_p99=round(1000 * lat[int(0.99 * len(lat))], 2),
               drop_notice_ms_max=round(1000 * lat[-1], 2))
    finally:
        eng.close()


def _lookup_latencies(c, keys: list[bytes], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert c.lookup("stall", keys, timeout_s=10).hits == len(keys)
        out.append(time.perf_counter() - t0)
    return out


def _flood(peer: RawPeer, keys: list[bytes], n: int, job0: int) -> None:
    """n messages: lookups, loads of resident blocks (copies + notices), loads of absent keys."""
    missing = chain_keys(64, b"stall-missing")
    frames = []
    for i in range(n):
        k = i % 3
        if k == 0:
            frames.append(P.encode(P.Lookup(seq=i + 1, namespace="stall", keys=keys)))
        elif k == 1:
            frames.append(P.encode(P.Load(seq=i + 1, engine_id="stall-0", job_id=job0 + i, keys=keys[:8],
                                          block_ids=range(64, 72))))
        else:
            frames.append(P.encode(P.Load(seq=i + 1, engine_id="stall-0", job_id=job0 + i, keys=missing,
                                          block_ids=range(64, 128))))
    for f in frames:
        peer.send(f)


def test_stalled_client_neither_slows_others_nor_grows_memory(make_daemon):
    d = make_daemon("64MiB", name="stall")
    pid = d.proc.pid
    eng = ShmEngine(128, SLOT, tag="stall")
    stalled = RawPeer(d.address, rcvhwm=1000)  # a normal receive queue; it just never reads
    try:
        stalled.hello()
        assert stalled.ask(P.Register(engine_id="stall-0", namespace="stall", memory=eng.memory,
                                      layout=eng.layout))["op"] == "registered"
        keys = chain_keys(64, b"stall")
        eng.fill(range(64), keys)
        stalled.send_msg(P.Store(engine_id="stall-0", job_id=1, keys=keys, block_ids=range(64)))
        assert stalled.recv_until(lambda r: r.get("op") == "notice")[-1]["ok"]
        other = d.client()
        base = _lookup_latencies(other, keys, 300)
        rss0 = rss_kb(pid)

        during: list[float] = []
        stop = threading.Event()

        def measure() -> None:
            while not stop.is_set():
                during.extend(_lookup_latencies(other, keys, 10))

        t = threading.Thread(target=measure)
        t.start()
        rss, flood_s = [rss0], []
        watcher = d.client()
        for r in range(3):  # 3 x 21,000 messages; replies beyond the peer's queue are dropped
            t0 = time.monotonic()
            _flood(stalled, keys, 21_000, 10 + r * 100_000)
            assert wait_until(lambda r=r: watcher.stats()["counters"]["lookups"] >= 7_000 * (r + 1) + len(during),
                              60, 0.05)
            flood_s.append(time.monotonic() - t0)
            assert wait_until(lambda: watcher.stats()["engines"][0]["in_flight"] == 0, 30, 0.05)
            time.sleep(0.5)
            rss.append(rss_kb(pid))
        stop.set()
        t.join()
        after = _lookup_latencies(other, keys, 300)
        assert d.proc.poll() is None
        med0, med_after = statistics.median(base), statistics.median(after)
        record("exhaustion_stalled_client", messages=63_000, flood_21k_s=[round(x, 2) for x in flood_s],
               other_lookup_ms_median_before=round(1000 * med0, 3),
               other_lookup_ms_median_during=round(1000 * statistics.median(during), 3),
               other_lookup_ms_max_during=round(1000 * max(during), 1),
               other_lookup_ms_median_after=round(1000 * med_after, 3), rss_kb_after_each_flood=rss,
               other_lookups_during=len(during))
        # once the stalled peer's reply queue is full, more messages cost nothing more: RSS stays in a
        # band (the allocator's noise, +-10 MB under load) while 42,000 more messages are processed
        assert max(rss[1:]) - min(rss[1:]) < 16 * 1024, f"daemon RSS kept growing: {rss} kB"
        assert max(rss) - rss0 < 64 * 1024, f"daemon RSS grew {max(rss) - rss0} kB for one stalled client"
        # others are served during the flood (nothing blocks) and at full speed once it is over
        assert max(during) < 2.0
        assert med_after < 3 * med0 + 0.002, f"lookups slower after the flood: {med0 * 1e3:.3f} -> {med_after * 1e3:.3f} ms"
    finally:
        stalled.close()
        eng.close()
