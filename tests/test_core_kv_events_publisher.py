"""The KV-event publisher on a real Index over a real Pool, with real sockets, in this process.

What a daemon test cannot hold still: the publisher thread. Here it is held at a real gate (the lock
of the counter it increments after each send, taken by the test), so that its queue fills for
certain: the loop goes on, the batches beyond the queue are dropped and counted, and they leave a
gap in the sequence numbers that a subscriber sees and no replay fills.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from kvevents_sub import EventSubscriber

from kvoffd.cache.index import Index
from kvoffd.cache.pool import Pool
from kvoffd.events.publisher import Endpoints, KvEventPublisher
from kvoffd.events.wire import MEDIUM_DISK, EventIdentity, HashForm
from kvoffd.metrics import Metrics

SLOT = 4096


def _key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def _store(index: Index, keys: list[bytes]) -> None:
    t = index.table("pub", 0, 1, SLOT, (SLOT,))
    plan = index.prepare_store(t, keys)
    index.add_pending(plan)
    index.complete_store(plan, True)


def _wait(pred, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not pred():
        time.sleep(0.01)
    return pred()


def _no_state() -> dict:
    return {"pool": dict.fromkeys(("capacity", "used", "pinned", "free_chunks", "total"), 0), "engines": 0,
            "leases": 0, "resident_blocks": 0, "in_flight": {"store": 0, "load": 0}, "oldest_in_flight_s": 0.0}


def test_a_publisher_behind_drops_and_counts_and_the_loop_never_waits():
    metrics = Metrics("test", _no_state)
    index = Index(Pool(64 * SLOT, chunk_bytes=64 * SLOT), "lru")
    pub = KvEventPublisher(Endpoints("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"), metrics, queue_batches=1)
    pub.bind()
    pub.start()
    index.observers.append(pub)
    pub.set_identity("pub", EventIdentity(HashForm.BYTES, 16))
    published, dropped = metrics.kv_events_published, metrics.kv_events_dropped
    gate = published._value._lock  # the thread takes it after each send
    gate.acquire()

    async def turns() -> None:
        for i in range(6):  # one store per loop turn: six batches of one event
            _store(index, [_key(i)])
            await asyncio.sleep(0)  # the turn ends: the flush runs

    try:
        asyncio.run(turns())  # returned although the publisher thread is stuck: the loop never waited
        # the stuck thread holds at most one batch and the queue one more: four or more were dropped
        assert dropped._value.get() >= 4
    finally:
        gate.release()
    assert _wait(lambda: published._value.get() + dropped._value.get() == 6)
    sent = int(published._value.get())
    sub = EventSubscriber(pub.bound.publish, pub.bound.replay)
    try:
        assert sub.catch_up() == sent
        seqs = sorted(sub.batches)
        assert len(seqs) == sent and seqs[-1] < 6 and seqs != list(range(6)), seqs  # the gap shows
        assert [sub.batches[s][1][0]["block_hashes"] for s in seqs] == [[_key(s)] for s in seqs]
    finally:
        sub.close()
        pub.close()


def test_another_tier_publishes_under_its_own_medium():
    """The seam a disk tier uses: its blocks are published like the pool's, with medium "DISK",
    in the same numbered stream; a namespace without an event identity publishes nothing."""
    metrics = Metrics("test", _no_state)
    index = Index(Pool(64 * SLOT, chunk_bytes=64 * SLOT), "lru")
    pub = KvEventPublisher(Endpoints("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"), metrics)
    pub.bind()
    pub.start()
    index.observers.append(pub)
    pub.set_identity("pub", EventIdentity(HashForm.INT64, 16))

    async def turns() -> None:
        _store(index, [_key(1), _key(2)])
        await asyncio.sleep(0)
        pub.tier_changed(MEDIUM_DISK, "pub", stored=[_key(1)], removed=[])
        pub.tier_changed(MEDIUM_DISK, "unknown-namespace", stored=[_key(3)], removed=[])
        await asyncio.sleep(0)
        pub.tier_changed(MEDIUM_DISK, "pub", stored=[], removed=[_key(1)])
        await asyncio.sleep(0)

    asyncio.run(turns())
    published = metrics.kv_events_published
    assert _wait(lambda: published._value.get() == 3)
    sub = EventSubscriber(pub.bound.publish, pub.bound.replay)
    try:
        assert sub.catch_up() == 3
        low = [int.from_bytes(_key(i)[-8:], "big") for i in (1, 2)]
        got = [(e["type"], e["medium"], e["block_hashes"]) for e in sub.events()]
        assert got == [("BlockStored", "CPU", low), ("BlockStored", "DISK", low[:1]), ("BlockRemoved", "DISK", low[:1])]
    finally:
        sub.close()
        pub.close()
