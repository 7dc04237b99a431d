"""Issue 2 acceptance: a real daemon process, real engine processes, real sockets and shared memory."""

from __future__ import annotations

import signal

import pytest
from kvtest import chain_keys, wait_until

from kvoffd_client import protocol as P


def test_store_then_load_into_other_blocks_is_byte_exact(daemon, engines):
    eng = engines(daemon.address, "rt-0", namespace="rt", blocks=64)
    keys = chain_keys(20, b"rt")
    src, dst = list(range(3, 23)), list(range(40, 60))
    eng("fill", ids=src, seed=11)
    eng("fill", ids=dst, seed=99)  # the destination holds other bytes before the load
    want = eng("digest", ids=src)
    assert eng.store(1, keys, src) == {"seq": 0, "job_id": 1, "ok": True, "failed": [], "code": "",
                                       "message": "", "op": "notice"}
    assert eng.lookup(keys)["hits"] == 20
    assert eng.load(2, keys, dst)["ok"]
    assert eng("digest", ids=dst) == want
    # scattered: reversed order into interleaved ids
    ids = list(range(63, 23, -2))
    assert eng.load(3, keys[::-1], ids)["ok"]
    assert eng("digest", ids=ids) == want[::-1]


def test_lookup_counts_only_leading_resident_keys(daemon, engines):
    eng = engines(daemon.address, "lk-0", namespace="lk", blocks=32)
    keys = chain_keys(10, b"lk")
    eng("fill", ids=list(range(10)), seed=1)
    assert eng.store(1, keys[:4], [0, 1, 2, 3])["ok"]
    assert eng.store(2, keys[5:8], [5, 6, 7])["ok"]  # key 4 missing: 5..7 must not count
    assert eng.lookup(keys)["hits"] == 4
    assert eng.lookup(keys[5:8])["hits"] == 3
    assert eng.lookup([])["hits"] == 0
    c = daemon.client()
    assert c.lookup("no-such-namespace", keys).hits == 0
    assert c.lookup("lk", b"".join(keys)).hits == 4  # keys packed back to back, as the connector sends them
    with pytest.raises(P.ProtocolError) as bad:  # refused before it is sent
        c.lookup("lk", b"".join(keys)[:-1])
    assert bad.value.code is P.ErrorCode.BAD_KEY


def test_in_flight_store_is_invisible_until_complete(daemon):
    """A large store and a lookup sent back to back: the lookup is answered before the copy ends."""
    import torch

    from kvoffd_client.memory.cpu_fd import share_cpu_kv_caches
    from kvoffd_client.memory.layout import describe_layout

    nb = 64
    raw = torch.zeros(2 * nb * (1 << 20), dtype=torch.int8)  # 2 layers x 64 blocks x 1 MiB
    kv = {f"l{i}": raw[i * nb << 20:(i + 1) * nb << 20].view(nb, 1, 1024, 1024) for i in range(2)}
    c = daemon.client()
    c.register("inv-0", "inv", 0, 1, share_cpu_kv_caches(kv, "inv"), describe_layout(kv, nb))
    keys = chain_keys(nb, b"inv")
    for _ in range(3):
        c.clear("inv")
        c.submit_store("inv-0", 1, keys, list(range(nb)))
        seq = c.send_request(P.Lookup(namespace="inv", keys=keys[:1]))
        notices = c.wait_notices({1}, 30)
        reply = None
        while reply is None:
            reply = c.take_reply(seq)
        assert notices and notices[0].ok
        assert reply.hits == 0, "an entry became visible before its copy completed"
        assert c.lookup("inv", keys).hits == nb  # and visible right after
    c.unregister("inv-0")


def test_lru_eviction_counters_and_pinned_blocks(make_daemon, engines):
    d = make_daemon("8MiB", "--eviction-policy", "lru")  # one 8 MiB chunk; slots of 16 KiB -> N = 512 blocks
    eng = engines(d.address, "lru-0", namespace="lru", blocks=256, layers=2, heads=1, block_size=16, head_dim=64)
    assert eng.info["slot_bytes"] == 16384
    n = (8 << 20) // 16384
    eng("fill", ids=list(range(256)), seed=3)
    keys = chain_keys(3 * n, b"lru")
    # pin the first 100 blocks with a lease, as a scheduler does before a load
    for j in range(2):
        assert eng.store(100 + j, keys[j * 256:(j + 1) * 256], list(range(256)))["ok"]
    lease = eng.lookup(keys[:100], lease_ms=60_000)
    assert lease["hits"] == 100 and lease["lease_id"]
    # 3N blocks in all: the oldest unpinned ones go, the pinned 100 stay
    for j in range(2, 6):
        r = eng.store(100 + j, keys[j * 256:(j + 1) * 256], list(range(256)))
        assert r["ok"], r
    c = d.client()
    stats = c.stats()
    assert stats["counters"]["stored_blocks"] == 3 * n
    assert stats["counters"]["evicted_blocks"] == 2 * n
    assert stats["pool"]["used_bytes"] == n * 16384
    assert c.lookup("lru", keys[:100]).hits == 100, "a leased block was evicted"
    assert c.lookup("lru", keys[100:]).hits == 0  # evicted (LRU) ...
    assert c.lookup("lru", keys[-(n - 100):]).hits == n - 100  # ... the newest stayed
    assert c.explain("lru", keys[100:101])[0]["state"] == "evicted"
    # a pinned block is loaded fine, and then the lease is consumed by the load
    assert eng.load(200, keys[:100], list(range(100)), lease=lease["lease_id"])["ok"]
    metrics = d.metrics()
    assert f"kvoffd_evicted_blocks_total {float(2 * n)}" in metrics
    assert f"kvoffd_stored_blocks_total {float(3 * n)}" in metrics


def test_a_block_stored_again_is_most_recently_used(make_daemon, engines):
    """An engine that stores a resident block computed it itself: the block is in use, so the no-op
    store refreshes it and eviction takes the next oldest instead."""
    d = make_daemon("1MiB", "--eviction-policy", "lru")  # 64 slots of 16 KiB
    eng = engines(d.address, "touch-0", namespace="touch", blocks=128, layers=2, heads=1, block_size=16,
                  head_dim=64)
    keys = chain_keys(66, b"touch")
    eng("fill", ids=list(range(128)), seed=6)
    assert eng.store(1, keys[:64], list(range(64)))["ok"]  # the pool is full; keys[0] is the oldest
    r = eng.store(2, [keys[0], keys[64], keys[64]], [0, 64, 64])  # a no-op, and a new key given twice
    assert r["ok"], r
    assert eng.store(3, keys[65:66], [65])["ok"]
    c = d.client()
    assert c.stats()["counters"]["evicted_blocks"] == 2
    assert c.lookup("touch", keys[:1]).hits == 1, "the block stored again was evicted"
    assert c.lookup("touch", keys[1:2]).hits == 0 and c.lookup("touch", keys[2:3]).hits == 0
    assert c.lookup("touch", keys[3:64]).hits == 61
    assert eng.load(4, keys[:1], [100])["ok"]
    assert eng("digest", ids=[100]) == eng("digest", ids=[0])


def test_full_pool_of_pinned_blocks_drops_stores_without_blocking(make_daemon, engines):
    d = make_daemon("1MiB", "--eviction-policy", "lru")  # 64 slots of 16 KiB (lru: no refusals)
    eng = engines(d.address, "full-0", namespace="full", blocks=128, layers=2, heads=1, block_size=16, head_dim=64)
    keys = chain_keys(128, b"full")
    eng("fill", ids=list(range(128)), seed=5)
    assert eng.store(1, keys[:64], list(range(64)))["ok"]
    lease = eng.lookup(keys[:64], lease_ms=60_000)
    assert lease["hits"] == 64
    r = eng.store(2, keys[64:], list(range(64, 128)))
    assert not r["ok"] and r["code"] == "pool_full" and r["failed"] == list(range(64))
    assert eng.store(3, keys[:64], list(range(64)))["ok"]  # already resident: a counted no-op
    stats = d.client().stats()
    assert stats["counters"]["dropped_stores"] == 64
    assert stats["counters"]["store_noop_blocks"] == 64
    assert eng.load(4, keys[:64], list(range(64, 128)), lease=lease["lease_id"])["ok"]
    assert eng("digest", ids=list(range(64, 128))) == eng("digest", ids=list(range(64)))


def test_two_engines_share_a_namespace_and_a_new_engine_gets_hits(daemon, engines):
    a = engines(daemon.address, "sh-a", namespace="shared", blocks=32)
    b = engines(daemon.address, "sh-b", namespace="shared", blocks=32)
    keys = chain_keys(8, b"shared")
    a("fill", ids=list(range(8)), seed=21)
    want = a("digest", ids=list(range(8)))
    assert a.store(1, keys, list(range(8)))["ok"]
    assert b.lookup(keys)["hits"] == 8
    assert b.load(1, keys, list(range(16, 24)))["ok"]
    assert b("digest", ids=list(range(16, 24))) == want
    # engine a is killed; the daemon notices and keeps its blocks for the next engine
    c = daemon.client()
    before = len(c.stats()["engines"])
    a.kill()
    assert wait_until(lambda: len(c.stats()["engines"]) == before - 1, 2.0), "dead engine not noticed within 2 s"
    fresh = engines(daemon.address, "sh-c", namespace="shared", blocks=32)
    assert fresh.lookup(keys)["hits"] == 8
    assert fresh.load(1, keys, list(range(8)))["ok"]
    assert fresh("digest", ids=list(range(8))) == want


def test_engine_timeout_unregisters_silent_engines(make_daemon):
    """Without a pidfd (another pid namespace), missed heartbeats unregister the engine."""
    import torch

    from kvoffd_client.client import KvoffdClient
    from kvoffd_client.memory.cpu_fd import share_cpu_kv_caches
    from kvoffd_client.memory.layout import describe_layout

    d = make_daemon("16MiB", "--engine-timeout", "0.5")
    kv = {"l0": torch.zeros(8, 1, 16, 64)}
    c = KvoffdClient(d.address, heartbeat=False)  # a client that goes silent
    assert c.connect(5)
    c.register("silent-0", "silent", 0, 1, share_cpu_kv_caches(kv, "silent"), describe_layout(kv, 8))
    watcher = d.client()
    assert any(e["engine_id"] == "silent-0" for e in watcher.stats()["engines"])
    # keep talking on the watcher's connection only; the silent engine's pid is alive (it is us),
    # so only the heartbeat rule can remove it
    assert wait_until(lambda: not watcher.stats()["engines"], 3.0)
    assert "timed_out" in d.log() or "silent for" in d.log()
    c.close()


def test_daemon_sigterm_exits_cleanly(make_daemon):
    d = make_daemon("16MiB", name="term")
    assert d.stop(signal.SIGTERM) == 0
    assert "kvoffd stopped" in d.log()


def test_client_connects_by_itself_when_the_daemon_starts_late(make_daemon, tmp_path):
    from kvoffd_client.client import KvoffdClient

    c = KvoffdClient(f"ipc://{tmp_path}/late.sock", timeout_s=0.2)
    try:
        assert not c.connect(0.3)
        make_daemon("16MiB", name="late")
        # nobody calls the client: its heartbeat thread alone must complete the handshake
        assert wait_until(lambda: c.connected, 5.0)
        assert c.lookup("late", chain_keys(2)).hits == 0
    finally:
        c.close()


def test_client_fails_jobs_and_reregisters_when_the_daemon_restarts(make_daemon, tmp_path):
    import torch

    from kvoffd_client.client import DaemonUnavailable, KvoffdClient
    from kvoffd_client.memory.cpu_fd import share_cpu_kv_caches
    from kvoffd_client.memory.layout import describe_layout

    d = make_daemon("16MiB", name="restart")
    raw = torch.zeros(2, 16, 1, 16, 64)
    kv = {"l0": raw[0], "l1": raw[1]}
    c = KvoffdClient(d.address, link_grace_s=0.3)
    try:
        assert c.connect(5)
        c.register("rs-0", "rs", 0, 1, share_cpu_kv_caches(kv, "rs"), describe_layout(kv, 16))
        d.stop(signal.SIGKILL)
        assert wait_until(lambda: not c.connected, 3.0)
        with pytest.raises(DaemonUnavailable):  # nothing is queued for a daemon that is not there
            c.submit_load("rs-0", 7, chain_keys(2), [0, 1])
        d2 = make_daemon("16MiB", name="restart")
        assert wait_until(lambda: c.connected, 5.0)
        # the new daemon knows the engine again without the engine doing anything
        assert wait_until(lambda: any(e["engine_id"] == "rs-0" for e in c.stats()["engines"]), 3.0)
        assert d2.client().stats()["daemon"]["id"] == c.daemon_id
    finally:
        c.close()


def test_verify_mode_round_trip(make_daemon, engines):
    d = make_daemon("16MiB", "--verify", name="verify")
    eng = engines(d.address, "vf-0", namespace="vf", blocks=16)
    keys = chain_keys(8, b"vf")
    eng("fill", ids=list(range(8)), seed=4)
    assert eng.store(1, keys, list(range(8)))["ok"]
    assert eng.load(2, keys, list(range(8, 16)))["ok"]
    assert eng("digest", ids=list(range(8, 16))) == eng("digest", ids=list(range(8)))
    stats = d.client().stats()
    assert stats["verify"] is True and stats["pool"]["base_address"] > 0
    assert "kvoffd_checksum_failures_total 0.0" in d.metrics()


def test_a_job_past_its_deadline_is_refused_not_run(make_daemon):
    """A daemon that stalled must not run jobs the client has given up on (late writes into reused blocks)."""
    import time

    import torch

    from kvoffd_client import protocol as P
    from kvoffd_client.client import KvoffdClient, KvoffdError
    from kvoffd_client.memory.cpu_fd import share_cpu_kv_caches
    from kvoffd_client.memory.layout import describe_layout

    d = make_daemon("16MiB", name="expiry")
    raw = torch.zeros(2, 8, 1, 16, 64)
    kv = {"l0": raw[0], "l1": raw[1]}
    c = KvoffdClient(d.address)
    try:
        assert c.connect(5)
        c.register("ex-0", "ex", 0, 1, share_cpu_kv_caches(kv, "ex"), describe_layout(kv, 8))
        keys = chain_keys(2, b"ex")
        with pytest.raises(KvoffdError, match="expired"):
            c.request(P.Store(engine_id="ex-0", job_id=1, keys=keys, block_ids=[0, 1],
                              expires_ns=time.monotonic_ns() - 1))
        assert c.lookup("ex", keys).hits == 0  # nothing was stored
        c.submit_store("ex-0", 2, keys, [0, 1])  # the client's own deadline is in the future: runs
        assert c.wait_notices({2}, 5)[0].ok
        assert 'kvoffd_expired_jobs_total 1.0' in d.metrics()
    finally:
        c.close()
