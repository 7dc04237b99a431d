"""The disk tier itself (kvoffd/cache/tiers/disk.py) on a real file, driven through its interface on a
real event loop: CLOCK reuse under pressure never hands one slot to two blocks, every block read back
is the one written, and a second tier on the same directory is refused."""

from __future__ import annotations

import asyncio
import hashlib
import mmap

import numpy as np
import pytest

from kvoffd.cache.tiers.base import SpillResult, TableRef
from kvoffd.cache.tiers.disk import DiskTier

SLOT = 4096
REF = TableRef("unit", 0, 1, (SLOT,))


def _blocks(lo: int, n: int) -> tuple[bytes, list[memoryview], list[bytes]]:
    keys = [hashlib.sha256(b"k%d" % i).digest() for i in range(lo, lo + n)]
    buf = mmap.mmap(-1, n * SLOT)
    arr = np.frombuffer(buf, dtype=np.uint8).reshape(n, SLOT)
    for j, k in enumerate(keys):
        arr[j] = np.frombuffer(hashlib.sha256(k).digest() * (SLOT // 32), dtype=np.uint8)
    view = memoryview(buf)
    return b"".join(keys), [view[j * SLOT:(j + 1) * SLOT] for j in range(n)], [bytes(arr[j]) for j in range(n)]


def _dest(n: int) -> list[memoryview]:
    """``n`` slot-sized views of a fresh anonymous mapping: where a test reads blocks back to."""
    view = memoryview(mmap.mmap(-1, n * SLOT))
    return [view[j * SLOT:(j + 1) * SLOT] for j in range(n)]


async def _pressure(path: str) -> None:
    tier = DiskTier(path, 64 * SLOT, threads=2)  # 64 slots
    tier.start(asyncio.get_running_loop())
    try:
        keys, src, want = _blocks(0, 64)
        assert all(r is SpillResult.WRITTEN for r in await tier.write(REF, keys, src))
        assert (await tier.read(REF, keys, _dest(64))).all()
        # every block just read (a use): the next sweep passes all of them once and must wrap around
        keys2, src2, want2 = _blocks(64, 48)
        res = await tier.write(REF, keys2, src2)
        assert all(r is SpillResult.WRITTEN for r in res)
        c = tier._classes[SLOT]
        owned = c.owner[c.owner != 0xFFFFFFFF]
        assert len(owned) == len(set(owned.tolist())) == c.index.used == 64
        for k_all, w_all in ((keys, want), (keys2, want2)):
            held = tier.contains(REF, k_all)
            n = len(w_all)
            dv = _dest(n)
            ok = await tier.read(REF, k_all, dv)
            assert (ok == held).all()
            for j in np.flatnonzero(ok).tolist():
                assert bytes(dv[j]) == w_all[j]
        st = tier.stats()
        assert st.checksum_failures == 0 and st.evictions == 48 and st.resident_blocks == 64
    finally:
        tier.close()


def test_clock_reuse_under_pressure_keeps_every_block_intact(tmp_path):
    asyncio.run(_pressure(str(tmp_path / "disk")))


def test_one_daemon_per_directory(tmp_path):
    a = DiskTier(str(tmp_path / "disk"), 1 << 20)
    try:
        with pytest.raises(OSError, match="in use by another kvoffd"):
            DiskTier(str(tmp_path / "disk"), 1 << 20)
    finally:
        a.close()


async def _staged(path: str) -> None:
    """The disk tier's I/O threads are not started: every spill stays in flight. The second STORE
    needs its victims' slots at once (more than the reserve kept ahead), so they are copied out to
    staging; a lookup of blocks just evicted is served from there, byte-exact, without a read."""
    from kvoffd.cache.index import Index
    from kvoffd.cache.tiers.manager import Tiers
    from kvoffd.pool.allocator import Pool

    index = Index(Pool(16 * SLOT, chunk_bytes=16 * SLOT), "lru")
    tier = DiskTier(path, 64 * SLOT, threads=1)
    tier._loop = asyncio.get_running_loop()  # futures resolve on this loop; no thread ever runs a write
    tiers = Tiers(index, [tier])
    t = index.table("unit", 0, 1, SLOT, (SLOT,))
    keys = [hashlib.sha256(b"s%d" % i).digest() for i in range(32)]
    for lo, n in ((0, 16), (16, 16)):  # the second evicts the first (a pool this small keeps no reserve)
        ks = keys[lo:lo + n]
        p = _prepare(index, tiers, t, ks)
        entries = index.add_pending(p)
        assert len(entries) == n
        for e in entries:
            index.pool.view(e.slot, SLOT)[:] = np.frombuffer(hashlib.sha256(e.key).digest() * (SLOT // 32), np.uint8)
        index.complete_store(p, True)
    assert tier.stats().spills == 0 and len(tiers.spills.staged) == 16  # all in flight
    assert tiers.spills.copies == 16 and not index.deferral.deferred  # a store's own victims are copied out
    wanted = b"".join(keys[:8])
    below = tiers.find_below("unit", wanted, index.lookup("unit", wanted))  # as a LOOKUP does
    assert below is not None and below.n == 8
    hits = tiers.promote(below)
    assert hits.n == 8 and tiers.staged_hits == 8
    st = tiers.stats()[0]  # the spill path's figures are STATS fields (and /metrics series), not notes
    assert (st.staged_hits, st.spill_copies) == (8, tiers.spills.copies) and st.spill_copies >= 16
    assert st.promotions >= 8 and st.spill_deferred_bytes == index.deferral.deferred_bytes
    for k in keys[:8]:
        e = t.visible[k]  # visible at once: no read to wait for
        assert bytes(index.pool.view(e.slot, SLOT)) == hashlib.sha256(k).digest() * (SLOT // 32)
    assert not tiers.promotions(t, keys[:8])
    tier.close()


def test_a_block_whose_spill_has_not_landed_is_served_from_staging(tmp_path):
    asyncio.run(_staged(str(tmp_path / "disk")))


def _prepare(index, tiers, t, keys: list[bytes]):
    """A STORE's slots as the keyspace takes them under a tier (kvoffd/cache/keyspace.py): its victims
    handed over to the tiers, spilled or freed, before its copy starts."""
    plan = index.prepare_store(t, keys, hand_over=True)
    tiers.after_store(plan)
    return plan


def _fill(index, tiers, t, keys: list[bytes]) -> list[int]:
    """A STORE of ``keys`` whose copy writes each block's own pattern; returns the slots it got."""
    p = _prepare(index, tiers, t, keys)
    for e in index.add_pending(p):
        index.pool.view(e.slot, SLOT)[:] = np.frombuffer(hashlib.sha256(e.key).digest() * (SLOT // 32), np.uint8)
    index.complete_store(p, True)
    return list(p.slots)


async def _gated(path: str, budget_blocks: int) -> None:
    """The tier's writes wait on a gate the test holds: the spills' pool slots stay deferred."""
    import threading

    from kvoffd.cache.index import Index
    from kvoffd.cache.tiers.manager import Tiers
    from kvoffd.pool.allocator import Pool

    index = Index(Pool(128 * SLOT, chunk_bytes=128 * SLOT), "lru")  # 128 slots: a reserve of 4 kept ahead
    tier = DiskTier(path, 64 * SLOT, threads=2)
    gate = threading.Event()
    tier._io.write_gate = gate
    tier.start(asyncio.get_running_loop())
    tiers = Tiers(index, [tier], spill_buffer_bytes=budget_blocks * SLOT)
    t = index.table("unit", 0, 1, SLOT, (SLOT,))
    keys = [hashlib.sha256(b"g%d" % i).digest() for i in range(132)]
    pattern = {k: hashlib.sha256(k).digest() * (SLOT // 32) for k in keys}
    try:
        for lo in range(0, 128, 4):
            assert len(_fill(index, tiers, t, keys[lo:lo + 4])) == 4
        # the last store filled the pool: the 4 oldest were evicted ahead, their writes held by the gate
        deferred = dict(index.deferral.deferred)
        assert len(deferred) == 4 and index.deferral.deferred_bytes == 4 * SLOT and not t.visible.keys() & set(keys[:4])
        got = _fill(index, tiers, t, keys[128:132])  # needs 4 slots now: evicts, and cannot have the deferred ones
        assert len(got) == 4 and not set(got) & set(deferred)
        for s in deferred:  # nothing wrote into a deferred slot: its block's bytes are still there
            assert bytes(index.pool.view(s, SLOT)) in {pattern[k] for k in keys[:4]}
        if budget_blocks == 4:  # the budget is taken by the deferred 4: the store's victims' spills are dropped
            assert tiers.spills.busy == 4 and tiers.spills.copies == 0
        else:  # the store's own victims are copied out (it needs their slots now), the next 4 kept ahead
            assert tiers.spills.busy == 0 and tiers.spills.copies == 4 and len(index.deferral.deferred) == 8
        assert index.deferral.deferred_bytes <= budget_blocks * SLOT
        held = len(deferred) + (0 if budget_blocks == 4 else 8)  # the writes the gate holds, by their blocks
        assert tiers.stats()[0].spills_in_flight == held
        gate.set()
        while tiers.spills.in_flight:
            await asyncio.wait(list(tiers.spills.in_flight))
            await asyncio.sleep(0)  # the done callbacks (a yield, not a wait for time)
        assert not index.deferral.deferred and index.deferral.deferred_bytes == 0 and tiers.stats()[0].spills_in_flight == 0
        wanted = b"".join(keys[:4])
        assert tier.contains(tiers._ref(t), wanted).all()
        dv = _dest(4)
        assert (await tier.read(tiers._ref(t), wanted, dv)).all()
        for j, k in enumerate(keys[:4]):
            assert bytes(dv[j]) == pattern[k]
        free = index.pool.alloc(SLOT, 128)  # given back once written: the pool hands them out again
        assert set(deferred) <= set(free)
        index.pool.free(SLOT, free)
    finally:
        gate.set()
        tier.close()


def test_a_spilled_blocks_slot_is_not_reused_before_its_write_read_it(tmp_path):
    asyncio.run(_gated(str(tmp_path / "disk"), budget_blocks=1024))


def test_spills_past_the_deferred_budget_are_dropped_and_counted(tmp_path):
    asyncio.run(_gated(str(tmp_path / "disk"), budget_blocks=4))


async def _reopen(path: str) -> None:
    tier = DiskTier(path, 64 * SLOT, threads=2)
    tier.start(asyncio.get_running_loop())
    told: list[tuple[str, bytes, bytes]] = []
    tier.changed = lambda ref, stored, removed: told.append((ref.namespace, stored, removed))
    keys, src, _ = _blocks(0, 20)
    other = TableRef("unit", 1, 2, (SLOT,))  # rank 1 of another table: never announced
    try:
        assert all(r is SpillResult.WRITTEN for r in await tier.write(REF, keys, src))
        assert all(r is SpillResult.WRITTEN for r in await tier.write(other, keys[:4 * 32], src[:4]))
        assert b"".join(s for _, s, _ in told if s) == keys + keys[:4 * 32]  # every insert told, with its keys
    finally:
        tier.close()
    tier = DiskTier(path, 64 * SLOT, threads=2)  # the restart: its index reopened
    tier.start(asyncio.get_running_loop())
    told.clear()
    tier.changed = lambda ref, stored, removed: told.append((ref.namespace, stored, removed))
    try:
        assert tier.reopened_namespaces() == set()  # marked only when events are published
        tier.mark_reopened()
        assert tier.reopened_namespaces() == {"unit"}
        tier.remove(REF, keys[3 * 32:4 * 32])  # gone before its announcement: told removed, never announced
        assert told == [("unit", b"", keys[3 * 32:4 * 32])]
        got, more = tier.take_reopened("unit", 8)
        assert more and len(got) in (7 * 32, 8 * 32)  # 8 looked at (in record order): 7 if the removed one was
        rest, more = tier.take_reopened("unit", 100)
        assert not more and sorted(_split(got + rest)) == sorted(set(_split(keys)) - {keys[96:128]})
        assert tier.take_reopened("unit", 100) == (b"", False) and tier.reopened_namespaces() == set()
        assert SLOT not in tier.events.marks  # the marks freed once all were handed out
    finally:
        tier.close()


async def _returning(path: str, policy: str) -> np.ndarray:
    """16 slots: A fills them, B evicts all of A, A[:4] comes back, C and D follow; which of A[:4] are
    still held after D's sweep."""
    tier = DiskTier(path, 16 * SLOT, threads=2, policy=policy)
    tier.start(asyncio.get_running_loop())
    try:
        a, a_src, _ = _blocks(0, 16)
        for keys, src in ((a, a_src), _blocks(100, 16)[:2], (a[:4 * 32], a_src[:4]), _blocks(200, 12)[:2],
                          _blocks(300, 4)[:2]):
            assert all(r is SpillResult.WRITTEN for r in await tier.write(REF, keys, src))
        return tier.contains(REF, a[:4 * 32])
    finally:
        tier.close()


def _split(keys: bytes) -> list[bytes]:
    return [keys[i:i + 32] for i in range(0, len(keys), 32)]


def test_reopened_blocks_are_handed_out_once_while_still_held(tmp_path):
    """KV events: inserts and removals are told with their keys; after a restart the rank-0 blocks found
    are handed out slice by slice, once, those removed meanwhile left out."""
    asyncio.run(_reopen(str(tmp_path / "d")))


def test_clock2_ghost_keeps_a_block_that_came_back_after_its_eviction(tmp_path):
    """The default disk policy: A[:4] were evicted by B and spilled again, so they start at count 2 and
    survive the pass that takes D's slots (C's unreferenced blocks go instead). Plain clock2 starts
    them at 0 and evicts them first."""
    assert asyncio.run(_returning(str(tmp_path / "ghost"), "clock2-ghost")).all()
    assert not asyncio.run(_returning(str(tmp_path / "plain"), "clock2")).any()


def test_an_unknown_disk_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="disk policy"):
        DiskTier(str(tmp_path / "disk"), 1 << 20, policy="lfu")


def test_ghost_filter_remembers_one_to_two_segments_of_victims():
    from kvoffd.cache.tiers.ghost import GhostFilter

    g = GhostFilter(1000)
    rng = np.random.default_rng(5)
    old, new, never = (rng.integers(0, 2**63, size=(1000, 4), dtype=np.int64).astype(np.uint64) for _ in range(3))
    g.add(old)  # one full segment: the filters rotate, old is in the older one
    assert g.contains(old).all()
    g.add(new[:500])
    assert g.contains(old).all() and g.contains(new[:500]).all()
    assert g.contains(never).mean() < 0.03  # ~10 bits per key: about 1% false positives per filter
    g.add(new[500:])  # a second rotation: old's segment is cleared
    assert g.contains(new).all() and g.contains(old).mean() < 0.03
    assert g.nbytes <= 2 * 1300  # 10 bits per key of a segment, per filter


async def _all_hot(path: str) -> None:
    tier = DiskTier(path, 64 * SLOT, threads=2, policy="clock2")  # 64 slots
    tier.start(asyncio.get_running_loop())
    try:
        keys, src, _ = _blocks(0, 64)
        assert all(r is SpillResult.WRITTEN for r in await tier.write(REF, keys, src))
        dv = _dest(64)
        for _ in range(3):  # three reads each: every count at REF_MAX
            assert (await tier.read(REF, keys, dv)).all()
        assert (tier._classes[SLOT].ref == 3).all()
        keys2, src2, want2 = _blocks(64, 8)
        res = await tier.write(REF, keys2, src2)
        assert all(r is SpillResult.WRITTEN for r in res), res  # evicts, never "full" while slots exist
        assert tier.stats().evictions == 8 and tier.stats().resident_blocks == 64
        ok = await tier.read(REF, keys2, dv[:8])
        assert ok.all() and all(bytes(dv[j]) == want2[j] for j in range(8))
    finally:
        tier.close()


def test_a_spill_into_a_disk_whose_every_block_is_hot_evicts_rather_than_drops(tmp_path):
    """CLOCK with 2-bit counts: a block read three times holds 3, and the hand needs four passes over
    such a disk to free a slot. A spill must then evict (within those passes), not be dropped as
    ``full`` as it was when the hand stopped after two."""
    asyncio.run(_all_hot(str(tmp_path / "d")))


async def _counted(path: str, seed: int) -> None:
    """A random mix of blocks on disk, ready in the pool and being stored (pending): ``find_below``'s
    count (the tier's fingerprint probe, the pool's entries asked only where needed) must be the exact
    rule's, and ``promote`` (which walks exactly) must keep it whole with room to spare."""
    import random

    from kvoffd.cache.index import Index
    from kvoffd.cache.tiers.manager import Tiers
    from kvoffd.pool.allocator import Pool

    rng = random.Random(seed)
    index = Index(Pool(256 * SLOT, chunk_bytes=256 * SLOT), "lru")
    tier = DiskTier(path, 256 * SLOT, threads=2)
    tier.start(asyncio.get_running_loop())
    tiers = Tiers(index, [tier])
    t = index.table("unit", 0, 1, SLOT, (SLOT,))
    try:
        keys = [hashlib.sha256(b"c%d-%d" % (seed, i)).digest() for i in range(48)]
        # "both": ready in the pool and on disk; "stored": on disk and being stored again (pending)
        state = [rng.choice(["disk", "disk", "disk", "ready", "pending", "both", "stored", "none"]) for _ in keys]
        on_disk = [k for k, s in zip(keys, state, strict=True) if s in ("disk", "both", "stored")]
        if on_disk:
            blob, src, _ = _blocks(1000 * seed, len(on_disk))
            res = await tier.write(REF, b"".join(on_disk), src)
            assert all(r is SpillResult.WRITTEN for r in res)
        _fill(index, tiers, t, [k for k, s in zip(keys, state, strict=True) if s in ("ready", "both")])
        pending = index.prepare_store(t, [k for k, s in zip(keys, state, strict=True) if s in ("pending", "stored")])
        index.add_pending(pending)
        for lo, w in [(lo, w) for lo in range(0, len(keys), 3) for w in (2, 6, 48)]:
            asked = b"".join(keys[lo:lo + w])
            hits = index.lookup("unit", asked)
            exact = 0  # a ready entry, or no entry and the block on disk; a pending one ends the run
            for s in state[lo:lo + w]:
                if s not in ("disk", "ready", "both"):
                    break
                exact += 1
            below = tiers.find_below("unit", asked, hits)
            got = hits.n if below is None else below.n
            assert got == exact, (lo, state[lo:lo + exact + 2], got, exact)
            if below is not None and tiers.fits(below):
                assert tiers.promote(below, answered=True).n == exact
                await asyncio.gather(*tiers.promotions(t, keys[lo:lo + exact]))
                await asyncio.sleep(0)  # the promotions' commit (a callback)
                state[lo:lo + exact] = ["ready" if s == "disk" else s for s in state[lo:lo + exact]]
        assert tiers.no_room == 0
        index.complete_store(pending, True)
        assert index.refs_taken == 0  # every ref taken (stores, promotions) was given back
    finally:
        tier.close()


@pytest.mark.parametrize("seed", range(8))
def test_a_lookups_count_below_the_pool_follows_the_exact_rule(tmp_path, seed):
    asyncio.run(_counted(str(tmp_path / "disk"), seed))


async def _restart_part_full(path: str) -> None:
    size = 256 * SLOT  # 256 slots
    tier = DiskTier(path, size, threads=2)
    tier.start(asyncio.get_running_loop())
    keys, src, want = _blocks(0, 8)  # 3% full
    try:
        assert all(r is SpillResult.WRITTEN for r in await tier.write(REF, keys, src))
    finally:
        tier.close()
    tier = DiskTier(path, size, threads=2)  # the daemon restarted: the hand and the counts start over
    tier.start(asyncio.get_running_loop())
    try:
        assert tier.contains(REF, keys).all()
        for r in range(5):  # 240 more: every slot but 8 taken, and still no block evicted
            k2, s2, _ = _blocks(100 + 48 * r, 48)
            assert all(x is SpillResult.WRITTEN for x in await tier.write(REF, k2, s2))
        assert tier.stats().evictions == 0 and tier.stats().resident_blocks == 248
        dv = _dest(8)
        assert (await tier.read(REF, keys, dv)).all()  # the adopted blocks, intact
        assert [bytes(v) for v in dv] == want
        k3, s3, _ = _blocks(1000, 16)  # past full: now the hand takes victims, the adopted ones last
        assert all(x is SpillResult.WRITTEN for x in await tier.write(REF, k3, s3))
        assert tier.stats().evictions == 8
        assert tier.contains(REF, keys).all()
    finally:
        tier.close()


def test_a_restarted_tier_fills_its_free_slots_before_evicting_anything(tmp_path):
    """Issue 33 point 2: a tier 3% full restarted, then filled: 0 evictions until it is full (every
    adopted block was evicted before: the hand and the counts restart at zero and took a victim
    before a free slot), and then the adopted blocks are not the first victims."""
    asyncio.run(_restart_part_full(str(tmp_path / "disk")))


async def _free_before_victims(path: str) -> None:
    tier = DiskTier(path, 256 * SLOT, threads=2)
    tier.start(asyncio.get_running_loop())
    try:
        keys, src, _ = _blocks(0, 256)
        assert all(r is SpillResult.WRITTEN for r in await tier.write(REF, keys, src))  # full
        tier.remove(REF, keys[156 * 32:])  # the last 100 freed, far from where the hand stands
        k2, s2, _ = _blocks(500, 50)
        assert all(r is SpillResult.WRITTEN for r in await tier.write(REF, k2, s2))
        assert tier.stats().evictions == 0 and tier.contains(REF, keys[:156 * 32]).all()
    finally:
        tier.close()


def test_free_slots_are_taken_before_any_block_is_evicted(tmp_path):
    asyncio.run(_free_before_victims(str(tmp_path / "disk")))
