"""LOOKUP's scan (``Index.lookup``: runs compared as binaries) against one dict probe per key.

The index's ``visible`` dicts are the truth; the scan takes shortcuts through the runs that commits
recorded. Random stores (some aborted, some overlapping what is there, into a pool small enough to
evict), discards, clears and lookups of key ranges (which follow and cross runs) must always give
the count a plain probe of every key gives, on a namespace of two ranks.
"""

from __future__ import annotations

import hashlib
from itertools import takewhile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffd.cache.index import Index
from kvoffd.pool.allocator import Pool

KEYS = [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(40)]
NEVER = hashlib.sha256(b"never stored").digest()
SLOT = 4096
NS = "scan"

key_range = st.tuples(st.integers(0, 39), st.integers(1, 40)).map(lambda t: list(range(t[0], min(40, t[0] + t[1]))))
# a range, a range broken by a key never stored, or any keys
key_list = st.one_of(key_range, st.tuples(key_range, st.integers(0, 10)).map(lambda t: t[0][:t[1]] + [-1] + t[0][t[1]:]),
                     st.lists(st.integers(0, 39), min_size=1, max_size=30))
step = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 1), key_list, st.booleans()),
    st.tuples(st.just("discard"), st.integers(0, 1), st.integers(0, 39), st.just(False)),
    st.tuples(st.just("load"), st.integers(0, 1), key_list, st.just(False)),  # reorders the LRU
    st.tuples(st.just("clear"), st.just(0), st.just([]), st.just(False)),
    st.tuples(st.just("lookup"), st.just(0), key_list, st.just(False)),
)


def _reference(index: Index, keys: list[bytes]) -> int:
    tables = index.namespaces[NS].tables.values()
    return len(list(takewhile(lambda k: all(k in t.visible for t in tables), keys)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=40))
def test_scan_agrees_with_a_probe_per_key(steps) -> None:
    index = Index(Pool(24 * SLOT, chunk_bytes=8 * SLOT))  # 24 slots for 2 ranks x 40 keys: evictions
    tables = [index.table(NS, r, 2, SLOT, (SLOT,)) for r in (0, 1)]
    for op, rank, picks, fail in steps:
        keys = [KEYS[i] if i >= 0 else NEVER for i in picks] if isinstance(picks, list) else []
        if op == "store":
            keys = [k for k in keys if k != NEVER]
            t = tables[rank]
            p = index.prepare_store(t, keys)
            index.add_pending(p)
            index.complete_store(p, not fail)
        elif op == "discard":
            e = tables[rank].visible.get(KEYS[picks])
            if e is not None:
                index.discard(e)
        elif op == "load":  # what a LOAD does to the entries it reads: a ref each, released as most recent
            index.release(index.prepare_load(tables[rank], keys).entries)
        elif op == "clear":
            index.clear(NS)
        probe = keys or KEYS
        for ks in (probe, KEYS, list(reversed(KEYS)), keys[1:]):
            hits = index.lookup(NS, b"".join(ks), with_entries=True)
            n, by_rank = hits.n, hits.by_rank
            assert n == _reference(index, ks)
            assert {r: [e.key for e in got] for r, got in by_rank.items()} == ({0: ks[:n], 1: ks[:n]} if n else {})
            assert all(e.table.rank == r and e.ready and not e.dead for r, got in by_rank.items() for e in got)
            assert index.lookup(NS, b"".join(ks)).n == n


def test_a_prompt_stored_in_chunks_is_found_whole_and_broken_runs_are_not_trusted() -> None:
    index = Index(Pool(64 * SLOT, chunk_bytes=64 * SLOT))
    t = index.table(NS, 0, 1, SLOT, (SLOT,))
    other = [hashlib.sha256(b"other" + bytes([i])).digest() for i in range(8)]
    # three steps, each storing a chunk of this prompt followed by another request's blocks
    for lo, hi in ((0, 10), (10, 25), (25, 40)):
        keys = KEYS[lo:hi] + other[lo % 8:lo % 8 + 2]
        p = index.prepare_store(t, keys)
        index.add_pending(p)
        index.complete_store(p, True)
    assert index.lookup(NS, b"".join(KEYS)).n == 40
    # the prompt diverges from the first run after 9 of its keys, where the run goes on with others
    assert index.lookup(NS, b"".join(KEYS[:9] + [NEVER] + KEYS[9:])).n == 9
    assert index.lookup(NS, b"".join(KEYS[:12] + [NEVER] + other[:2])).n == 12
    index.discard(t.visible[KEYS[17]])  # a hole in the middle run
    assert index.lookup(NS, b"".join(KEYS)).n == 17
    assert index.lookup(NS, b"".join(KEYS[18:])).n == 22
    hits = index.lookup(NS, b"".join(KEYS[:20]), with_entries=True)
    assert (hits.n, [e.key for e in hits.by_rank[0]], hits.miss_reason) == (17, KEYS[:17], "failed")


def test_a_run_with_an_evicted_member_is_not_trusted() -> None:
    index = Index(Pool(3 * SLOT, chunk_bytes=3 * SLOT))
    t = index.table(NS, 0, 1, SLOT, (SLOT,))

    def store(keys: list[bytes]) -> None:
        p = index.prepare_store(t, keys)
        index.add_pending(p)
        index.complete_store(p, True)

    store(KEYS[:3])
    index.release(index.prepare_load(t, [KEYS[0]]).entries)  # a LOAD reads KEYS[0]: now the most recent
    store([KEYS[3]])  # evicts KEYS[1], the least recently used, from the middle of the run
    assert KEYS[1] not in t.visible and KEYS[2] in t.visible
    assert index.lookup(NS, b"".join(KEYS[:3])).n == 1
