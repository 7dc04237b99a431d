"""The pool file's records (kvoffd/cache/restart/records.py, kvoffd/cache/restart/plan.py), unit level: a record
interrupted at any step of its write is never taken for a sealed one, and adoption keeps only records
whose namespace facts and slot geometry check out."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from kvtest import chain_keys

from kvoffd.cache.index import Index
from kvoffd.cache.restart.plan import plan_adoption
from kvoffd.cache.restart.records import NamespaceFacts, RankFacts, SlotRecords
from kvoffd.pool.allocator import Pool
from kvoffd.pool.format import PoolLayout

CHUNK, SLOT = 1 << 20, 64 << 10  # 16 slots per chunk, all with records


def _records(chunks: int = 4) -> SlotRecords:
    lay = PoolLayout.of(chunks * CHUNK, CHUNK)
    return SlotRecords(np.zeros((lay.num_records, 8), dtype=np.uint64), np.zeros(chunks, dtype=np.uint64), lay)


def _seal(rec: SlotRecords, slots: list[int], keys: list[bytes], ns_id: int = 1, slot: int = SLOT) -> np.ndarray:
    idx = rec.index_of(np.array(slots, dtype=np.int64), slot)
    rec.seal(idx, ns_id, 0, b"".join(keys), np.arange(len(slots), dtype=np.float64) + 100.0,
             np.arange(len(slots), dtype=np.int64) + 7, slot)
    return idx


def test_a_record_interrupted_at_any_step_is_not_sealed():
    rec = _records()
    keys = chain_keys(3, b"torn")
    idx = _seal(rec, [0, SLOT, 2 * SLOT], keys)
    f = rec.scan()
    assert f.offset.tolist() == [0, SLOT, 2 * SLOT] and [bytes(k) for k in f.keys] == keys
    assert f.crc.tolist() == [7, 8, 9] and f.stamp.tolist() == [100.0, 101.0, 102.0]
    whole = rec.words[idx[1]].copy()
    # the three steps of a rewrite of record 1 with another block's fields, interrupted after each store
    other = chain_keys(1, b"other")[0]
    for step in range(8):
        rec.words[idx[1]] = whole
        rec.words[idx[1], 0] = 0  # step 1: invalid first
        rec.words[idx[1], 1:1 + step] = np.frombuffer((other * 2)[:8 * step], dtype=np.uint64) if step else 0
        assert rec.scan().offset.tolist() == [0, 2 * SLOT], step
    rec.words[idx[1]] = whole
    rec.words[idx[1], 3] ^= np.uint64(1 << 17)  # a flipped bit in the record itself: its check fails
    assert rec.scan().offset.tolist() == [0, 2 * SLOT]
    rec.words[idx[1]] = whole
    rec.invalidate(idx[:1])
    assert rec.scan().offset.tolist() == [SLOT, 2 * SLOT]
    rec.touch(idx, 500.0)  # only sealed records get the new stamp; an invalid one stays invalid
    f = rec.scan()
    assert f.offset.tolist() == [SLOT, 2 * SLOT] and f.stamp.tolist() == [500.0, 500.0]


@dataclass
class _Adopted:
    entries: list
    not_adopted: int
    why: str


def _adopt(found, ns, pool, index) -> _Adopted:
    """Plan the adoption and put every block into the index (the daemon does it a slice per loop turn)."""
    plan = plan_adoption(found, ns, pool, index)
    entries = []
    while plan.left:
        got, gone = plan.take(index, pool, 2)  # small slices: the slicing itself is under test too
        assert not len(gone)
        entries += got
    return _Adopted(entries, plan.not_adopted, plan.why)


def test_adoption_keeps_only_records_that_check_out():
    rec = _records()
    good = chain_keys(4, b"good")
    _seal(rec, [0, SLOT, 2 * SLOT, 3 * SLOT], good)
    _seal(rec, [CHUNK], chain_keys(1, b"unknown-ns"), ns_id=9)  # no such namespace
    _seal(rec, [2 * CHUNK], chain_keys(1, b"a"), slot=SLOT)
    _seal(rec, [2 * CHUNK + 2 * SLOT], chain_keys(1, b"b"), ns_id=2, slot=2 * SLOT)  # one chunk, two slot sizes
    _seal(rec, [3 * CHUNK + SLOT], [good[0]])  # the same key again, newer (stamp 100 vs 100: offset decides)
    ns = {1: NamespaceFacts("m", 1, {0: RankFacts(SLOT, (SLOT // 2, SLOT // 2))}),
          2: NamespaceFacts("big", 1, {0: RankFacts(2 * SLOT, (2 * SLOT,))})}
    pool = Pool(4 * CHUNK, CHUNK)
    index = Index(pool, "lru")
    out = _adopt(rec.scan(), ns, pool, index)
    assert sorted(e.slot for e in out.entries) == [0, SLOT, 2 * SLOT, 3 * SLOT]  # the first of two equal stamps
    assert out.not_adopted == 4 and out.why
    t = index.namespaces["m"].tables[0]
    assert sorted(t.visible) == sorted(good) and index.resident == 4
    assert index.lookup("m", b"".join(good)).n == 4
    index.check_table("m", 0, 1, (SLOT // 2, SLOT // 2))  # a re-registering engine of the same layout fits
    assert pool.used_bytes == 4 * SLOT and len(pool.alloc(SLOT, 64)) == 64 - 4  # the rest of the pool is free


def test_a_replicated_namespace_is_adopted_with_its_replicas():
    """REGISTER.replicas (MLA at TP > 1): one table per run of ranks, stored by its first rank. The
    namespace table keeps ``replicas`` so the adopted namespace answers every rank and a re-registering
    engine of the same replicas fits; a record naming a rank that does not store is not adopted."""
    from kvoffd.cache.restart.records import NamespaceArea
    from kvoffd.pool.format import NS_AREA_BYTES

    table = NamespaceArea(memoryview(bytearray(2 * NS_AREA_BYTES)))
    facts = NamespaceFacts("mla", 4, {0: RankFacts(SLOT, (SLOT,)), 2: RankFacts(SLOT, (SLOT,))}, replicas=2)
    assert table.id_for(facts) == 1
    assert table.id_for(NamespaceFacts("mla", 4, {0: RankFacts(SLOT, (SLOT,))})) == 2  # other replicas: another id
    again = NamespaceArea(table.area)
    again.load()
    assert again.by_id[1] == facts and again.by_id[2].replicas == 1
    rec = _records()
    keys = chain_keys(3, b"mla")
    for rank, base in ((0, 0), (2, CHUNK)):
        idx = rec.index_of(np.array([base + i * SLOT for i in range(3)], dtype=np.int64), SLOT)
        rec.seal(idx, 1, rank, b"".join(keys), np.full(3, 100.0), np.arange(3, dtype=np.int64), SLOT)
    idx = rec.index_of(np.array([2 * CHUNK], dtype=np.int64), SLOT)
    rec.seal(idx, 1, 1, keys[0], np.full(1, 100.0), np.zeros(1, dtype=np.int64), SLOT)  # rank 1 reads rank 0's
    pool = Pool(4 * CHUNK, CHUNK)
    index = Index(pool, "lru")
    out = _adopt(rec.scan(), {1: facts}, pool, index)
    assert len(out.entries) == 6 and out.not_adopted == 1
    ns = index.namespaces["mla"]
    assert ns.replicas == 2 and sorted(ns.tables) == [0, 2]
    hits = index.lookup("mla", b"".join(keys), with_entries=True)
    assert hits.n == 3 and sorted(hits.by_rank) == [0, 1, 2, 3] and hits.by_rank[1] is hits.by_rank[0]
    index.check_table("mla", 3, 4, (SLOT,), replicas=2)  # a re-registering rank of the same replicas fits


def _staged(n: int = 10):
    """A pool and index with ``n`` sealed blocks of one namespace, stamps 100, 101, ... (oldest first)."""
    rec = _records()
    keys = chain_keys(n, b"staged")
    _seal(rec, [i * SLOT for i in range(n)], keys)
    pool = Pool(4 * CHUNK, CHUNK)
    index = Index(pool, "lru")
    plan = plan_adoption(rec.scan(), {1: NamespaceFacts("m", 1, {0: RankFacts(SLOT, (SLOT,))})}, pool, index)
    return pool, index, plan, keys


def test_adopted_slices_come_newest_first_and_keep_the_lru_order():
    """The daemon serves while adoption goes on: the newest blocks are found first, and once all are in,
    eviction takes the oldest first, as it would have in the previous daemon."""
    pool, index, plan, keys = _staged()
    assert pool.used_bytes == 10 * SLOT and index.resident == 0  # every slot held before any entry exists
    got, _ = plan.take(index, pool, 3)
    assert [e.key for e in got] == keys[7:] and index.lookup("m", keys[9]).n == 1
    assert index.lookup("m", keys[0]).n == 0  # not in yet: a miss, never a wrong byte
    while plan.left:
        plan.take(index, pool, 3)
    t0 = index.namespaces["m"].tables[0]
    assert list(index.policy_for(SLOT)) == [(t0, k) for k in keys]  # least recently used first
    index.check_table("m", 0, 1, (SLOT,))
    t = index.table("m", 0, 1, SLOT, (SLOT,))
    assert index.prepare_store(t, chain_keys(60, b"new")).evicted == 6  # 54 slots free, 6 blocks must go
    assert [k in t.entries for k in keys] == [False] * 6 + [True] * 4  # the oldest adopted went first


def test_a_block_asked_for_before_its_slice_enters_at_once_and_only_once():
    """``asked`` finds the waiting records of the keys a LOOKUP missed (every rank of the namespace,
    not another namespace's, not one already in the index or given up); ``take_records`` puts them
    in as just used, and the slice that reaches them later skips them."""
    rec = _records()
    keys = chain_keys(10, b"asked")
    _seal(rec, [i * SLOT for i in range(10)], keys)  # rank 0 of namespace 1 ("m")
    idx = rec.index_of(np.array([10 * SLOT, 11 * SLOT], dtype=np.int64), SLOT)
    rec.seal(idx, 1, 1, b"".join(keys[:2]), np.array([50.0, 51.0]), np.array([1, 2], dtype=np.int64), SLOT)  # rank 1
    other = rec.index_of(np.array([12 * SLOT], dtype=np.int64), SLOT)
    rec.seal(other, 2, 0, keys[0], np.array([60.0]), np.array([3], dtype=np.int64), SLOT)  # "o": same key
    pool = Pool(4 * CHUNK, CHUNK)
    index = Index(pool, "lru")
    facts = {1: NamespaceFacts("m", 2, {0: RankFacts(SLOT, (SLOT,)), 1: RankFacts(SLOT, (SLOT,))}),
             2: NamespaceFacts("o", 1, {0: RankFacts(SLOT, (SLOT,))})}
    plan = plan_adoption(rec.scan(), facts, pool, index)
    assert plan.waiting == 13 and index.lookup("m", keys[0]).n == 0
    f = plan.found
    got = plan.asked("m", keys[0] + keys[1] + chain_keys(1, b"never")[0])
    assert sorted(zip(f.rank[got].tolist(), [bytes(k) for k in f.keys[got]], strict=True)) == [
        (0, keys[0]), (0, keys[1]), (1, keys[0]), (1, keys[1])]  # both ranks, not namespace "o"
    entries, gone = plan.take_records(index, pool, got)
    assert len(entries) == 4 and not len(gone) and plan.waiting == 9
    assert index.lookup("m", keys[0] + keys[1] + keys[2]).n == 2  # rank 1 never had keys[2]
    assert not len(plan.asked("m", keys[0] + keys[1]))  # in the index already
    assert len(plan.asked("o", keys[0])) == 1
    while plan.left:
        entries, _ = plan.take(index, pool, 3)
        assert not {e.key for e in entries if e.table.namespace == "m" and e.table.rank == 0} & {keys[0], keys[1]}
    assert plan.waiting == 0 and index.resident == 13 and not len(plan.asked("m", keys[5]))
    pool2, index2, plan2, keys2 = _staged()
    plan2.forget(pool2, keep=set())  # a CLEAR while all wait: nothing is found any more
    assert not len(plan2.asked("m", keys2[0])) and plan2.waiting == 0


def test_blocks_of_a_cleared_or_forgotten_namespace_are_not_adopted_later():
    pool, index, plan, keys = _staged()
    plan.take(index, pool, 4)
    gone = plan.forget(pool, keep=set())  # a CLEAR of the namespace while 6 blocks wait
    assert len(gone) == 6 and plan.left == 0 and pool.used_bytes == 4 * SLOT
    pool, index, plan, keys = _staged()
    plan.take(index, pool, 4)
    index.clear("m")
    assert index.forget_if_idle("m")
    got, gone = plan.take(index, pool, 100)  # its table is gone: nothing enters, the slots go back
    assert not got and len(gone) == 6 and pool.used_bytes == 0 and index.resident == 0


def test_the_namespace_table_keeps_the_kv_event_identity_and_reads_old_or_bad_ones_leniently():
    """The identity is an optional key of a namespace's JSON object: kept across a reload, changed in place
    (not a new namespace id: it is not what a re-registering engine must match), absent in a table
    written without it, and a malformed one loses only itself (one warning), never the namespace."""
    import json
    import zlib

    from kvoffd.cache.identity import EventIdentity, HashForm
    from kvoffd.cache.restart.records import _NS_HEAD, _NS_MAGIC, NamespaceArea
    from kvoffd.pool.format import NS_AREA_BYTES

    table = NamespaceArea(memoryview(bytearray(2 * NS_AREA_BYTES)))
    ident = EventIdentity(HashForm.INT64, 16)
    assert table.id_for(NamespaceFacts("ev", 1, {0: RankFacts(SLOT, (SLOT,))}, events=ident)) == 1
    assert table.id_for(NamespaceFacts("ev", 1, {0: RankFacts(SLOT, (SLOT,))})) == 1  # same facts, same id
    again = NamespaceArea(table.area)
    again.load()
    assert again.by_id[1].events == ident
    again.set_events("ev", EventIdentity(HashForm.BYTES, 32))
    third = NamespaceArea(table.area)
    third.load()
    assert third.by_id[1].events == EventIdentity(HashForm.BYTES, 32)

    def write(doc: dict) -> NamespaceArea:
        area = memoryview(bytearray(2 * NS_AREA_BYTES))
        body = json.dumps(doc).encode()
        area[:_NS_HEAD.size] = _NS_HEAD.pack(_NS_MAGIC, 1, len(body), zlib.crc32(body))
        area[_NS_HEAD.size:_NS_HEAD.size + len(body)] = body
        t = NamespaceArea(area)
        t.load()
        return t

    row = {"id": 3, "name": "old", "world_size": 1, "ranks": {"0": {"slot_bytes": SLOT, "layout": [SLOT]}}}
    assert write({"namespaces": [row]}).by_id[3].events is None  # written before the key existed
    for bad in ({"hash": "md5", "block_size": 16}, {"hash": "int64", "block_size": 0}, ["int64"],
                {"hash": "bytes", "block_size": True}, {"hash": "bytes"}):
        t = write({"namespaces": [{**row, "events": bad}]})
        assert t.by_id[3].name == "old" and t.by_id[3].events is None, bad


def test_a_record_committed_without_its_checksum_stays_valid_while_it_is_filled_in():
    """Issue 29: a block's record is written when its copy completes (COMMITTED, no checksum) and its
    checksum is filled in later; a process that dies between any two stores of that fill leaves a
    valid record, with or without the checksum, never an invalid one (so the block is adopted)."""
    from kvoffd.cache.checksum import NONE
    from kvoffd.cache.restart.records import COMMITTED, SUMMED, _check

    rec = _records()
    keys = chain_keys(3, b"committed")
    slots = np.array([0, SLOT, 2 * SLOT], dtype=np.int64)
    idx = rec.index_of(slots, SLOT)
    rec.seal(idx, 1, 0, b"".join(keys), np.full(3, 100.0), np.array([NONE, 5, NONE], dtype=np.int64), SLOT)
    f = rec.scan()
    assert f.offset.tolist() == slots.tolist() and f.crc.tolist() == [NONE, 5, NONE]
    assert (rec.words[idx, 0] & np.uint64(0xFFFFFFFF)).tolist() == [COMMITTED, SUMMED, COMMITTED]
    before = rec.words[idx[0]].copy()
    after = before.copy()  # what ``fill`` writes, word by word: 6, then 7, then 0
    after[0] = (before[0] & ~np.uint64(0xFFFFFFFF)) | np.uint64(SUMMED)
    after[6] = before[6] | np.uint64(0xABCD)
    after[7] = _check(after[None, :7])[0]
    for step, words in enumerate(([], [6], [6, 7], [6, 7, 0])):
        rec.words[idx[0]] = before
        for w in words:
            rec.words[idx[0], w] = after[w]
        got = rec.scan()
        assert got.offset.tolist() == slots.tolist(), step
        assert got.crc[0] in (NONE, 0xABCD) and (step < 2 or got.crc[0] == 0xABCD), (step, got.crc)
    rec.words[idx[0]] = before
    assert rec.fill(idx, np.array([0xABCD, 9, 0x1234], dtype=np.int64)) == 2  # the SUMMED one is left as it is
    assert rec.scan().crc.tolist() == [0xABCD, 5, 0x1234]
    assert (rec.words[idx[0]] == after).all()
    rec.words[idx[2], 2] ^= np.uint64(1)  # a damaged COMMITTED record (its key) fails its check
    assert rec.scan().offset.tolist() == [0, SLOT]
    rec.touch(idx[:2], 200.0)
    assert rec.scan().stamp.tolist() == [200.0, 200.0]


def test_an_older_daemons_record_keeps_its_crc32_and_is_verified_with_it():
    """Records written before issue 29 (state SEALED, zlib's crc32) are adopted with their checksum
    marked LEGACY_CRC32, which ``matches`` checks with crc32."""
    import zlib

    from kvoffd.cache.checksum import LEGACY_CRC32, block_sum, matches
    from kvoffd.cache.restart.records import SEALED, _check

    rec = _records()
    data = np.random.default_rng(1).integers(0, 255, SLOT, dtype=np.uint8)
    body = np.zeros((1, 7), dtype=np.uint64)
    body[0, 0] = np.uint64(SEALED | (1 << 32))
    body[0, 1:5] = np.frombuffer(chain_keys(1, b"old")[0], dtype=np.uint64)
    body[0, 5] = np.float64(50.0).view(np.uint64)
    body[0, 6] = np.uint64(zlib.crc32(data) | (SLOT << 32))
    rec.chunks[0] = SLOT
    rec.words[0, :7], rec.words[0, 7] = body[0], _check(body)[0]
    f = rec.scan()
    assert f.offset.tolist() == [0] and f.crc[0] == LEGACY_CRC32 | zlib.crc32(data)
    assert matches(data, int(f.crc[0])) and matches(data, block_sum(data))
    data[100] ^= 1
    assert not matches(data, int(f.crc[0]))


def test_the_block_checksum_catches_what_a_stray_write_leaves():
    from kvoffd.cache.checksum import NONE, ROW_WORDS, block_sum, matches

    rng = np.random.default_rng(2)
    for size in (SLOT, SLOT + 3, 256):  # whole rows, a tail of bytes, less than a row
        data = rng.integers(0, 255, size, dtype=np.uint8)
        want = block_sum(data)
        assert 0 <= want < 1 << 32 and block_sum(memoryview(data.tobytes())) == want and not matches(data, NONE)
        for at in (0, size // 2, size - 1):
            bad = data.copy()
            bad[at] ^= 0x10
            assert block_sum(bad) != want, (size, at)
    data = rng.integers(0, 255, SLOT, dtype=np.uint8)
    want = block_sum(data)
    page = ROW_WORDS * 8
    swapped = data.copy()
    swapped[:page], swapped[page:2 * page] = data[page:2 * page], data[:page]  # a page written in another's place
    assert block_sum(swapped) != want
    words = data.copy().view(np.uint64)
    words[3] += np.uint64(1 << 40)
    words[ROW_WORDS + 9] -= np.uint64(1 << 40)  # two changes that cancel in a plain sum
    assert block_sum(words.view(np.uint8)) != want


def test_the_checksums_of_a_run_of_blocks_are_each_blocks_own():
    """``block_sums`` (the checksum threads: a run of neighbouring slots in a few numpy calls) gives
    every block the value ``block_sum`` gives it alone, runs or not, whole rows or not."""
    from kvoffd.cache.checksum import block_sum, block_sums

    buf = np.random.default_rng(3).integers(0, 255, 64 * SLOT, dtype=np.uint8)
    for size in (4096, SLOT, 3 * SLOT, 1000):
        offs = [o for o in range(0, len(buf) - size, size)][:40]
        picked = offs[:10] + offs[12:13] + offs[20:30]  # runs of 10, 1 and 10
        assert block_sums(buf, picked, size) == [block_sum(buf[o:o + size]) for o in picked], size
