"""Issue 12 point 3: KV that every rank of a TP group holds identically (MLA latents) is stored once.

Two stand-in engine processes act as TP ranks 0 and 1 of one engine, each with its own memory, against
a real daemon. In a namespace registered with ``replicas=2`` rank 0 stores, the daemon keeps one copy
per block, and both ranks look it up and load it byte-exact into their own blocks; without replicas a
block hits only once both ranks stored it. The daemon refuses what would let a rank read bytes that do
not describe its memory (another layout, another replication) and never evicts a copy one rank's
lease still holds after the other rank loaded it.
"""

from __future__ import annotations

import pytest
from kvtest import chain_keys

from kvoffd_client import protocol as P
from kvoffd_client.client import KvoffdError

SMALL = {"blocks": 64, "layers": 2, "heads": 1, "block_size": 16, "head_dim": 64}  # 16 KiB blocks


def _ns_stats(client, namespace: str) -> dict:
    return next(n for n in client.stats()["namespaces"] if n["namespace"] == namespace)


def _tp_pair(engines, address: str, namespace: str, replicas: int, **kw):
    shape = {**SMALL, **kw}
    return [engines(address, f"{namespace}-r{r}", namespace=namespace, rank=r, world_size=2, replicas=replicas,
                    **shape) for r in (0, 1)]


def test_one_copy_per_block_and_both_ranks_load_it_byte_exact(make_daemon, engines):
    d = make_daemon("8MiB", "--eviction-policy", "lru")
    r0, r1 = _tp_pair(engines, d.address, "mla", replicas=2)
    n = 24
    keys = chain_keys(n, b"mla")
    src = list(range(n))
    r0("fill", ids=src, seed=7)
    r1("fill", ids=list(range(64)), seed=8)  # rank 1's memory holds other bytes until it loads
    want = r0("digest", ids=src)
    assert r1("digest", ids=list(range(32, 32 + n))) != want
    assert r0.store(1, keys, src)["ok"]
    c = d.client()
    ns = _ns_stats(c, "mla")
    assert (ns["blocks"], ns["bytes"], ns["ranks"], ns["replicas"]) == (n, n * 16384, [0], 2)
    assert c.stats()["pool"]["used_bytes"] == n * 16384  # one copy, not one per rank
    for eng in (r0, r1):
        got = eng.lookup(keys)
        assert (got["hits"], got["world_size"]) == (n, 2)
    dst = list(range(32, 32 + n))
    assert r1.load(2, keys, dst)["ok"]
    assert r1("digest", ids=dst) == want
    assert r0.load(3, keys[::-1], dst)["ok"]  # rank 0 too, reversed into other blocks
    assert r0("digest", ids=dst) == want[::-1]
    assert c.explain("mla", keys[:1])[0]["state"] == "resident"
    # rank 1 reads rank 0's copy and never writes it: its STORE is refused, nothing is copied
    r1("fill", ids=src, seed=9)
    refused = r1.store(4, chain_keys(4, b"other"), src[:4])
    assert not refused["ok"] and refused["code"] == "bad_field" and "does not store" in refused["message"]
    assert refused["failed"] == [0, 1, 2, 3]
    assert r1.store(5, keys, src)["code"] == "bad_field"  # even for keys rank 0 stored
    assert _ns_stats(c, "mla")["blocks"] == n
    assert r1.load(6, keys, dst)["ok"] and r1("digest", ids=dst) == want  # the copy is rank 0's bytes


def test_without_replicas_a_block_hits_only_once_every_rank_stored_it(make_daemon, engines):
    d = make_daemon("8MiB", "--eviction-policy", "lru")
    r0, r1 = _tp_pair(engines, d.address, "gqa", replicas=1)
    n = 16
    keys = chain_keys(n, b"gqa")
    r0("fill", ids=list(range(n)), seed=1)
    r1("fill", ids=list(range(n)), seed=2)
    assert r0.store(1, keys, list(range(n)))["ok"]
    assert r0.lookup(keys)["hits"] == 0 and r1.lookup(keys)["hits"] == 0
    assert r1.store(2, keys, list(range(n)))["ok"]
    assert r0.lookup(keys)["hits"] == n
    ns = _ns_stats(d.client(), "gqa")
    assert (ns["blocks"], ns["ranks"], ns["replicas"]) == (2 * n, [0, 1], 1)
    dst = list(range(32, 32 + n))
    assert r1.load(3, keys, dst)["ok"]
    assert r1("digest", ids=dst) == r1("digest", ids=list(range(n)))  # its own copy, not rank 0's
    assert r1("digest", ids=dst) != r0("digest", ids=list(range(n)))


def test_a_rank_that_does_not_match_the_replicated_copy_is_refused(make_daemon, engines):
    import torch
    from standin_engine import allocate

    from kvoffd_client.memory.cpu_fd import share_cpu_kv_caches
    from kvoffd_client.memory.layout import describe_layout

    d = make_daemon("8MiB")
    r0 = engines(d.address, "rep-r0", namespace="rep", rank=0, world_size=2, replicas=2, **SMALL)
    c = d.client()

    def register(engine_id: str, rank: int, head_dim: int, replicas: int, world_size: int = 2):
        kv = allocate(64, 2, 1, 16, head_dim, torch.float32)
        return c.register(engine_id, "rep", rank, world_size, share_cpu_kv_caches(kv, engine_id),
                          describe_layout(kv, 64), replicas=replicas)

    with pytest.raises(KvoffdError) as other_layout:  # half the bytes per block: would read rank 0's bytes wrong
        register("rep-r1-small", 1, 32, 2)
    assert other_layout.value.code == P.ErrorCode.LAYOUT_MISMATCH.value
    assert "another layout" in str(other_layout.value)
    with pytest.raises(KvoffdError) as not_replicated:  # would keep its own table: its stores never join
        register("rep-r1-own", 1, 64, 1)
    assert not_replicated.value.code == P.ErrorCode.LAYOUT_MISMATCH.value
    assert "one copy per 2 ranks" in str(not_replicated.value)
    with pytest.raises(KvoffdError) as odd:
        register("rep-r1-odd", 1, 64, 2, world_size=3)
    assert odd.value.code == P.ErrorCode.BAD_FIELD.value
    assert [e["engine_id"] for e in c.stats(detail=True)["engines"]] == ["rep-r0"]  # nothing was registered
    register("rep-r1", 1, 64, 2)  # the matching rank joins
    keys = chain_keys(4, b"rep")
    r0("fill", ids=[0, 1, 2, 3], seed=3)
    assert r0.store(1, keys, [0, 1, 2, 3])["ok"]
    assert c.lookup("rep", keys).hits == 4


def test_a_copy_leased_for_both_ranks_survives_eviction_until_the_last_rank_loads(make_daemon, engines):
    """The lease of a LOOKUP pins the copy once per rank; rank 0's LOAD consumes only its own pin. The
    pool is then filled past capacity: the copy must stay for rank 1, and go once rank 1 loaded it."""
    d = make_daemon("1MiB", "--eviction-policy", "lru")  # 64 slots of 16 KiB
    r0, r1 = _tp_pair(engines, d.address, "ev", replicas=2, blocks=128)
    a, b = chain_keys(32, b"ev-a"), chain_keys(64, b"ev-b")
    r0("fill", ids=list(range(128)), seed=4)
    want = r0("digest", ids=list(range(32)))
    assert r0.store(1, a, list(range(32)))["ok"]
    lease = r0.lookup(a, lease_ms=60_000)  # the scheduler's lookup: one lease for every rank
    assert lease["hits"] == 32 and lease["lease_id"]
    assert r0.load(2, a, list(range(64, 96)), lease=lease["lease_id"])["ok"]
    assert r0("digest", ids=list(range(64, 96))) == want
    c = d.client()
    assert all(e["held"] for e in c.explain("ev", a))  # rank 1's share still holds every block
    full = r0.store(3, b, list(range(64, 128)))  # 64 new blocks, 32 free slots: the leased copy is not a victim
    assert full["code"] == "pool_full" and full["failed"] == list(range(32, 64))
    assert c.stats()["counters"]["evicted_blocks"] == 0
    assert c.lookup("ev", a).hits == 32
    dst = list(range(96, 128))
    r1("fill", ids=dst, seed=5)
    assert r1.load(4, a, dst, lease=lease["lease_id"])["ok"]
    assert r1("digest", ids=dst) == want
    assert not any(e["held"] for e in c.explain("ev", a))  # both shares consumed: evictable again
    assert r0.store(5, chain_keys(64, b"ev-c"), list(range(64, 128)))["ok"]  # 64 new blocks evict all
    assert c.stats()["counters"]["evicted_blocks"] == 64
    assert c.lookup("ev", a).hits == 0
