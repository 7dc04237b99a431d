"""Drill: the pool under several models (issue 18, defects 4 and 5).

What must hold: a block costs the daemon memory in proportion to the blocks stored, whatever its
size (a block below the 256-byte minimum is refused at REGISTER with a clear error, and a new block
size costs nothing until stored); and a second model stores and hits while a first one keeps the
pool full: each gets its fair share of the chunks, neither starves.
"""

from __future__ import annotations

import os
import threading

from kvtest import chain_keys, wait_until
from reliability_util import RawPeer, ShmEngine, proc_status, record

from kvoffd.pool.allocator import MIN_SLOT_BYTES
from kvoffd_client import protocol as P

MiB = 1 << 20


def _pool_rss_kb(pid: int, base: int) -> int:
    """Resident kB of the pool mapping alone (from /proc/PID/smaps), to tell it from the heap."""
    rss, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                inside = int(head.split("-")[0], 16) == base
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1])
    return rss


def _heap_kb(pid: int, base: int) -> int:
    return proc_status(pid)["RssAnon"] - _pool_rss_kb(pid, base)


def test_tiny_blocks_are_refused_and_new_block_sizes_cost_only_what_they_hold(make_daemon):
    """The old daemon accepted 1-byte blocks and listed every slot of a fresh 64 MiB chunk as Python
    ints when a block size first stored (2.6 GB for 1-byte slots; ~5 MB per size near 256 bytes)."""
    d = make_daemon("1GiB", name="tiny")  # 16 chunks of 64 MiB: one per block size below
    pid = d.proc.pid
    peer = RawPeer(d.address)
    engines: list[ShmEngine] = []
    try:
        peer.hello(os.getpid())
        eng = ShmEngine(4, 64, tag="tiny")
        engines.append(eng)
        r = peer.ask(P.Register(engine_id="tiny-1", namespace="tiny-1", memory=eng.memory,
                                layout={"num_blocks": 4, "segments": [[0, 1, 1]]}))
        assert r["op"] == "error" and r["code"] == "bad_field" and "minimum" in r["message"], r
        r = peer.ask(P.Register(engine_id="tiny-64", namespace="tiny-64", memory=eng.memory, layout=eng.layout))
        assert r["op"] == "error" and str(MIN_SLOT_BYTES) in r["message"], r

        c = d.client(job_deadline_s=10.0)
        base = c.stats()["pool"]["base_address"]
        pinger = d.client()
        rtts: list[float] = []
        done = threading.Event()

        def ping() -> None:
            while not done.is_set():
                rtts.append(pinger.ping(10))

        t = threading.Thread(target=ping, daemon=True)
        heap0 = _heap_kb(pid, base)
        t.start()
        sizes = [MIN_SLOT_BYTES + 64 * i for i in range(16)]
        for i, size in enumerate(sizes):
            e = ShmEngine(4, size, tag=f"tiny{size}")
            engines.append(e)
            c.register(f"tiny{size}", f"tiny{size}", 0, 1, e.memory, e.layout)
            keys = chain_keys(1, b"tiny%d" % size)
            e.fill([0], keys)
            c.submit_store(f"tiny{size}", i + 1, keys, [0])
            n = c.wait_notices({i + 1}, 10)
            assert n and n[0].ok, n
            e.poison([1])
            c.submit_load(f"tiny{size}", 100 + i, keys, [1])
            assert c.wait_notices({100 + i}, 10)[0].ok
            assert e.matches([1], keys).all()
        done.set()
        t.join(15)
        grown = _heap_kb(pid, base) - heap0
        st = c.stats()
        assert st["resident_blocks"] == len(sizes)
        assert len(st["pool"]["slabs"]) == len(sizes)
        record("pool_new_block_sizes", block_sizes=len(sizes), smallest=sizes[0], heap_growth_kb=grown,
               pings=len(rtts), ping_ms_max=round(1000 * max(rtts), 2))
        assert grown < 16 * 1024, f"16 one-block stores of new block sizes grew the heap by {grown} kB"
        assert max(rtts) < 1.0
    finally:
        peer.close()
        for e in engines:
            e.close()


def _store(c, eng_id: str, eng: ShmEngine, job: int, keys: list[bytes]) -> list[int]:
    """Store keys from blocks 0..n-1; returns the failed indices."""
    ids = list(range(len(keys)))
    eng.fill(ids, keys)
    c.submit_store(eng_id, job, keys, ids)
    n = c.wait_notices({job}, 30)
    assert n, f"no notice for store {job}"
    return n[0].failed


def _loads_back(c, eng_id: str, ns: str, eng: ShmEngine, job: int, keys: list[bytes]) -> int:
    """Lookup keys; load the hits into the engine's upper half and check them byte for byte."""
    hits = c.lookup(ns, keys).hits
    if hits:
        ids = list(range(eng.num_blocks - hits, eng.num_blocks))
        eng.poison(ids)
        c.submit_load(eng_id, job, keys[:hits], ids)
        n = c.wait_notices({job}, 30)
        assert n and n[0].ok, n
        assert eng.matches(ids, keys[:hits]).all()
    return hits


def test_a_second_model_stores_and_hits_while_the_first_keeps_the_pool_full(make_daemon):
    """Model A (16 KiB blocks) fills a 256 MiB pool (4 chunks), then keeps storing; model B (32 KiB
    blocks) starts storing too. The old daemon stored 0 of B's blocks: eviction stayed within one
    block size and a chunk changed size only once entirely free."""
    d = make_daemon("256MiB", "--eviction-policy", "lru", name="share")  # A keeps storing new blocks
    a_eng, b_eng = ShmEngine(1024, 16384, tag="shareA"), ShmEngine(512, 32768, tag="shareB")
    try:
        ca, cb = d.client(job_deadline_s=30.0), d.client(job_deadline_s=30.0)
        ca.register("A-0", "A", 0, 1, a_eng.memory, a_eng.layout)
        cb.register("B-0", "B", 0, 1, b_eng.memory, b_eng.layout)
        ka, kb = chain_keys(24 * 1024 + 40 * 512, b"A"), chain_keys(40 * 256, b"B")
        job = 0
        for i in range(24):  # 384 MiB through a 256 MiB pool: full, and evicting
            job += 1
            _store(ca, "A-0", a_eng, job, ka[1024 * i:1024 * (i + 1)])
        full = ca.stats()["pool"]
        assert full["free_chunk_bytes"] == 0 and full["used_bytes"] >= 250 * MiB, full
        pa, pb = 1024 * 24, 0
        steps, b_stored, b_tried, a_stored, a_tried, b_hits, a_hits = 40, 0, 0, 0, 0, [], []
        for _ in range(steps):  # each step: A stores 8 MiB, B stores 8 MiB
            job += 1
            new_a = ka[pa:pa + 512]
            a_tried += 512
            a_stored += 512 - len(_store(ca, "A-0", a_eng, job, new_a))
            pa += 512
            job += 1
            new_b = kb[pb:pb + 256]
            b_tried += 256
            b_stored += 256 - len(_store(cb, "B-0", b_eng, job, new_b))
            pb += 256
            job += 1
            b_hits.append(_loads_back(cb, "B-0", "B", b_eng, job, new_b))
            job += 1
            a_hits.append(_loads_back(ca, "A-0", "A", a_eng, job, new_a))
        st = ca.stats()
        slabs = {s["slot_bytes"]: s["chunks"] for s in st["pool"]["slabs"]}
        by_ns = {n["namespace"]: n["bytes"] for n in st["namespaces"]}
        cap = st["pool"]["capacity_bytes"]
        record("pool_two_models", pool_mib=cap >> 20, steps=steps, a_stored=a_stored, a_tried=a_tried,
               b_stored=b_stored, b_tried=b_tried, a_chunks=slabs.get(16384), b_chunks=slabs.get(32768),
               a_share=round(by_ns["A"] / cap, 3), b_share=round(by_ns["B"] / cap, 3),
               a_last_step_hits=a_hits[-1], b_last_step_hits=b_hits[-1],
               reclaimed_chunks=st["pool"]["reclaimed_chunks"])
        assert slabs == {16384: 2, 32768: 2}, slabs  # the fair share: half the chunks each
        assert b_stored >= 0.9 * b_tried and a_stored >= 0.9 * a_tried, (a_stored, b_stored)
        assert min(b_hits) == 256 and min(a_hits) == 512, (a_hits, b_hits)  # each step's blocks load back
        assert by_ns["A"] >= 0.4 * cap and by_ns["B"] >= 0.4 * cap, by_ns
    finally:
        a_eng.close()
        b_eng.close()


def test_a_few_leased_blocks_hold_off_another_model_only_while_leased(make_daemon):
    """Model A (1 MiB blocks) fills a 256 MiB pool and leases one block in each of its 4 chunks: B's
    stores are dropped (a pinned block is never evicted) and the leased blocks still load byte for
    byte. Once the leases go, B stores at once. The old daemon kept B out for good: A's chunks never
    became entirely free."""
    d = make_daemon("256MiB", "--eviction-policy", "lru", name="lease4")
    a_eng, b_eng = ShmEngine(64, MiB, tag="leaseA"), ShmEngine(16, 32768, tag="leaseB")
    try:
        ca, cb = d.client(job_deadline_s=30.0), d.client(job_deadline_s=30.0)
        ca.register("LA-0", "LA", 0, 1, a_eng.memory, a_eng.layout)
        cb.register("LB-0", "LB", 0, 1, b_eng.memory, b_eng.layout)
        ka, kb = chain_keys(256, b"LA"), chain_keys(32, b"LB")
        for i in range(4):
            assert not _store(ca, "LA-0", a_eng, i + 1, ka[64 * i:64 * (i + 1)])
        leased = [ka[64 * i] for i in range(4)]  # one block of each chunk
        leases = [ca.lookup("LA", [k], lease_ms=600_000) for k in leased]
        assert all(r.hits == 1 and r.lease_id for r in leases)
        for j in range(3):
            failed = _store(cb, "LB-0", b_eng, 10 + j, kb[8 * j:8 * (j + 1)])
            assert failed == list(range(8)), failed  # pool_full: every chunk holds a pinned block
        assert _loads_back(ca, "LA-0", "LA", a_eng, 20, leased[:1]) == 1
        for k in leased:
            assert ca.lookup("LA", [k]).hits == 1
        for r in leases:
            ca.release(r.lease_id)
        assert wait_until(lambda: ca.stats()["leases"] == 0, 5)  # releases are fire and forget
        assert not _store(cb, "LB-0", b_eng, 30, kb[24:32])
        assert _loads_back(cb, "LB-0", "LB", b_eng, 31, kb[24:32]) == 8
        st = cb.stats()
        record("pool_leased_chunks", a_chunks_leased=4, b_dropped_while_leased=24,
               b_stored_after_release=8, reclaimed_chunks=st["pool"]["reclaimed_chunks"])
    finally:
        a_eng.close()
        b_eng.close()
