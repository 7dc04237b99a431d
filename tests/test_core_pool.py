"""The pool and the index's sharing of it between slot sizes (issue 18, defects 4 and 5).

Unit level, on a real Pool and Index: lazy carving (a slot costs the same whatever the slot size),
chunks handed from one slot size to another by draining, held entries never touched, and a bound
on the work one store may do.
"""

from __future__ import annotations

import tracemalloc

from daemon import run_daemon
from kvtest import chain_keys

from kvoffd.cache.index import Index, Table
from kvoffd.cache.reclaim import RECLAIM_BUDGET
from kvoffd.pool.allocator import Pool

KB = 1024


def _store(index: Index, table: Table, keys: list[bytes]) -> int:
    """One STORE's bookkeeping, the copy assumed done: returns the blocks that got a slot."""
    p = index.prepare_store(table, keys)
    index.add_pending(p)
    index.complete_store(p, True)
    return len(p.slots)


def _table(index: Index, name: str, slot: int) -> Table:
    return index.table(name, 0, 1, slot, (slot,))


def _chunk_bytes_of(pool: Pool, slot: int) -> int:
    return len(pool.chunks_of(slot)) * pool.chunk_bytes


def test_one_tiny_slot_costs_what_one_slot_costs():
    """The old pool listed every slot offset of a fresh chunk: one 1-byte slot of a 1 MiB chunk cost
    a million Python ints (about 40 MB; 2.6 GB for a 64 MiB chunk)."""
    pool = Pool(4 << 20, chunk_bytes=1 << 20)
    tracemalloc.start()
    try:
        got = [pool.alloc(size, 1) for size in (1, 2, 3, 64)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(len(g) == 1 for g in got)
    assert peak < 64 * KB, f"four one-slot allocations peaked at {peak} bytes"
    pool.close()


def test_lazy_carving_hands_out_consecutive_slots_and_reuses_given_back_ones():
    pool = Pool(256 * KB, chunk_bytes=64 * KB)
    a = pool.alloc(4 * KB, 5)
    assert a == [a[0] + i * 4 * KB for i in range(5)]  # consecutive: neighbours coalesce into one copy run
    pool.free(4 * KB, a[1:3])
    b = pool.alloc(4 * KB, 3)
    assert sorted(b[:2]) == a[1:3] and b[2] == a[4] + 4 * KB  # given-back slots first, then fresh ones
    assert pool.used_bytes == 6 * 4 * KB
    # a chunk that holds nothing any more is free again at once, for any slot size
    rest = pool.alloc(4 * KB, 64 - 6)
    assert len(rest) == 58 and pool.free_chunk_bytes == 0
    pool.free(4 * KB, a[:1] + a[3:] + b + rest)
    assert pool.free_chunk_bytes == 256 * KB and pool.used_bytes == 0
    assert len(pool.alloc(64 * KB, 4)) == 4
    pool.close()


def test_a_second_slot_size_takes_its_fair_share_of_a_full_pool():
    """Model A fills the pool; model B then stores: it gets chunks from A until both hold half, and
    neither starves (the old pool gave B nothing, ever)."""
    pool = Pool(8 * 64 * KB, chunk_bytes=64 * KB)  # 8 chunks: 16 slots of 4 KiB or 8 of 8 KiB each
    index = Index(pool)
    a, b = _table(index, "a", 4 * KB), _table(index, "b", 8 * KB)
    ka, kb = chain_keys(2000, b"a"), chain_keys(2000, b"b")
    assert _store(index, a, ka[:200]) == 128  # the whole pool
    stored_b = stored_a = 0
    for step in range(20):
        stored_a += _store(index, a, ka[200 + 16 * step:216 + 16 * step])
        stored_b += _store(index, b, kb[8 * step:8 * step + 8])
    assert _chunk_bytes_of(pool, 8 * KB) == _chunk_bytes_of(pool, 4 * KB) == 4 * 64 * KB
    assert index.lookup("b", b"".join(kb[152:160])).n == 8  # B's last store is there
    assert index.lookup("a", b"".join(ka[504:520])).n == 16  # and A's
    assert stored_a == 20 * 16 and stored_b >= 19 * 8, (stored_a, stored_b)
    assert pool.reclaimed_chunks == 4
    pool.close()


def test_three_slot_sizes_settle_without_moving_chunks_back_and_forth():
    pool = Pool(8 * 64 * KB, chunk_bytes=64 * KB)
    index = Index(pool)
    sizes = (4 * KB, 8 * KB, 16 * KB)
    tables = [_table(index, f"m{s}", s) for s in sizes]
    keys = [chain_keys(3000, str(s).encode()) for s in sizes]
    pos = [0, 0, 0]
    for step in range(30):
        for i, t in enumerate(tables):
            n = (64 * KB // sizes[i]) * 2
            _store(index, t, keys[i][pos[i]:pos[i] + n])
            pos[i] += n
        if step == 20:
            settled = pool.reclaimed_chunks
    held = [len(pool.chunks_of(s)) for s in sizes]
    assert sorted(held) == [2, 3, 3], held  # 8 chunks among 3 sizes
    assert pool.reclaimed_chunks == settled, "chunks still moving between slot sizes"
    pool.close()


def test_reclaim_skips_a_chunk_with_held_entries_and_never_evicts_them():
    pool = Pool(4 * 64 * KB, chunk_bytes=64 * KB)  # 4 chunks of 16 slots of 4 KiB
    index = Index(pool)
    a, b = _table(index, "a", 4 * KB), _table(index, "b", 8 * KB)
    ka = chain_keys(64, b"a")
    assert _store(index, a, ka) == 64
    oldest_chunk = pool.chunk_of(a.visible[ka[0]].slot)
    held = index.prepare_load(a, [e.key for e in a.visible.values() if pool.chunk_of(e.slot) == oldest_chunk][:1]
                              ).entries  # a ref, as a lease holds it
    kb = chain_keys(64, b"b")
    got = sum(_store(index, b, kb[8 * i:8 * i + 8]) for i in range(4))
    assert got > 0
    assert oldest_chunk in pool.chunks_of(4 * KB), "the chunk holding a held entry was taken"
    assert len(held) == 1 and all(e.key in a.visible and not e.dead for e in held)
    pool.close()


def test_when_every_chunk_holds_a_ref_the_store_drains_around_them_and_waits():
    """All chunks hold a held entry: the asker's store is dropped (never an eviction of a held entry);
    the emptiest chunk is drained around it and changes hands once its ref drops."""
    pool = Pool(2 * 64 * KB, chunk_bytes=64 * KB)
    index = Index(pool)
    a, b = _table(index, "a", 4 * KB), _table(index, "b", 8 * KB)
    ka = chain_keys(32, b"a")
    assert _store(index, a, ka) == 32
    held = index.prepare_load(a, [ka[0], ka[16]]).entries  # one in each chunk
    assert {pool.chunk_of(e.slot) for e in held} == set(pool.chunks_of(4 * KB))
    kb = chain_keys(16, b"b")
    assert _store(index, b, kb[:8]) == 0  # dropped: pool_full
    assert all(e.key in a.visible for e in held)
    assert len(a.visible) == 32 - 15  # the drained chunk lost its 15 unheld entries
    index.release(held)
    assert _store(index, b, kb[:8]) == 8  # the ref dropped: the chunk changed hands
    assert pool.reclaimed_chunks == 1
    pool.close()


def test_one_store_evicts_a_bounded_number_of_entries_for_another_slot_size():
    """256-byte slots in 4 MiB chunks: 16,384 entries per chunk. Reclaiming one takes several stores,
    each evicting at most RECLAIM_BUDGET entries (what a store of that many new blocks evicts from
    its own size anyway), so no store stalls the loop for the whole chunk."""
    pool = Pool(2 * (4 << 20), chunk_bytes=4 << 20)
    index = Index(pool)
    a, b = _table(index, "a", 256), _table(index, "b", 512)
    ka = chain_keys(2 * 16384, b"a")
    assert _store(index, a, ka) == 2 * 16384
    kb = chain_keys(64, b"b")
    steps: list[int] = []
    while True:
        before = index.reclaim_evictions
        got = _store(index, b, kb[:8])
        steps.append(index.reclaim_evictions - before)
        if got:
            break
        assert len(steps) <= 16384 // RECLAIM_BUDGET, steps
    assert max(steps) <= RECLAIM_BUDGET and sum(steps) == 16384, steps
    assert len(a.visible) == 16384 and len(b.visible) == 8
    pool.close()


def test_a_pool_is_the_size_asked_for_or_refused_with_one_line(tmp_path):
    """Issue 13 point 6: 100 MiB used to give 64 MiB silently."""

    import pytest

    from kvoffd.pool.allocator import pool_geometry

    assert pool_geometry(128 << 20) == (64 << 20, 2)
    assert pool_geometry(16 << 20) == (16 << 20, 1)  # below one chunk: one chunk of exactly that
    assert Pool(16 << 20).nbytes == 16 << 20
    with pytest.raises(ValueError, match="not a whole number of 64MiB chunks; use 64MiB or 128MiB"):
        Pool(100 << 20)
    r = run_daemon(["--address", f"ipc://{tmp_path}/d.sock", "--metrics-address", "off", "--pool-size", "100MiB"])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "kvoffd: --pool-size 100MiB is not a whole number of 64MiB chunks; use 64MiB or 128MiB"], r.stderr


def test_only_allocated_chunks_are_handed_out():
    """A pool file is allocated in the background; a slot past what is allocated is never handed out
    (a store there could SIGBUS on a full filesystem)."""
    pool = Pool(4 * 64 * KB, chunk_bytes=64 * KB)
    pool.set_allocated_bytes(64 * KB)
    assert len(pool.alloc(4 * KB, 64)) == 16 and pool.capacity_bytes == 64 * KB
    pool.set_usable_bytes(4 * 64 * KB)  # pinning done: still bounded by the allocation
    assert pool.alloc(4 * KB, 1) == []
    pool.set_allocated_bytes(4 * 64 * KB)
    assert len(pool.alloc(4 * KB, 64)) == 48
