"""The index with an admission/eviction policy (issue 15 point 2): a real Index over a real Pool.

What is checked: a refused admission takes no slot (so the server starts no copy); a block asked for a
second time is admitted; victims are the policy's (tail first within a request, not LRU's head
first); held blocks are never evicted and are tracked again when their last ref drops; and after a long
random mix of stores (committed, aborted, cleared while in flight), lookups with leases, loads,
discards, CLEARs and chunk reclamation between two slot sizes, the policy tracks exactly the ready
unheld-or-handed-back entries (``in_lru``) and never names a block that is gone.
"""

from __future__ import annotations

import hashlib
import logging
import random

import pytest

from kvoffd.cache.index import Entry, Index, StorePlan, Table
from kvoffd.cache.policy import DEFAULT_POLICY, GuardedDoorkeeper
from kvoffd.pool.allocator import Pool

SLOT = 4096
NS = "pol"


def key(i: int, tag: bytes = b"k") -> bytes:
    return hashlib.sha256(tag + i.to_bytes(8, "little")).digest()


def small_index(slots: int, policy: str = DEFAULT_POLICY) -> tuple[Index, Table]:
    index = Index(Pool(slots * SLOT, chunk_bytes=slots * SLOT), policy)
    return index, index.table(NS, 0, 1, SLOT, (SLOT,))


def store(index: Index, t: Table, keys: list[bytes]):
    """One STORE, copied at once: plan, pending entries, commit. Returns the plan."""
    p = index.prepare_store(t, keys)
    index.add_pending(p)
    index.complete_store(p, True)
    return p


def load(index: Index, keys: list[bytes]) -> int:
    """LOOKUP then LOAD of the hit prefix (a ref each, released when the copy ends): the hits."""
    hits = index.lookup(NS, b"".join(keys), with_entries=True)
    index.hold(hits)
    index.release(hits.by_rank.get(0, []))
    return hits.n


def test_refused_admission_takes_no_slot_and_a_second_request_is_admitted():
    index, t = small_index(4)
    first = [key(i) for i in range(4)]
    assert store(index, t, first).copy_idx == [0, 1, 2, 3]  # free slots: everything with its parent is admitted
    used = index.pool.used_bytes
    new = [key(i) for i in range(10, 13)]
    assert load(index, new) == 0
    p = store(index, t, new)
    assert (p.copy_idx, p.slots, p.refused, p.dropped) == ([], [], [0, 1, 2], [])  # nothing to copy
    assert index.pool.used_bytes == used and not any(k in t.entries for k in new)
    assert index.refused == 3 and index.evictions == 0
    assert load(index, new) == 0
    p = store(index, t, new)  # asked for again: the doorkeeper opens
    assert p.copy_idx == [0, 1, 2] and not p.refused and len(p.slots) == 3
    assert load(index, new) == 3 and index.evictions == 3 and index.resident == 4


def test_lru_policy_admits_everything():
    index, t = small_index(4, "lru")
    store(index, t, [key(i) for i in range(4)])
    p = store(index, t, [key(i) for i in range(10, 13)])
    assert p.copy_idx == [0, 1, 2] and not p.refused and index.refused == 0


def test_victims_are_the_policys_tail_first_not_lrus_head_first():
    """A request used a, b, c, d (in key order). LRU would evict a, the head, and leave b, c, d
    resident but unreachable; the default evicts from the tail."""
    for policy, gone in ((DEFAULT_POLICY, 3), ("lru", 0)):
        index, t = small_index(4, policy)
        chain = [key(i) for i in range(4)]
        store(index, t, chain)
        assert load(index, chain) == 4
        e = [key(99)]
        for _ in range(2):  # refused on its first request by the default, admitted on its second
            load(index, e)
            store(index, t, e)
        assert e[0] in t.visible and index.evictions == 1, policy
        assert [k in t.visible for k in chain] == [i != gone for i in range(4)], policy
        assert load(index, chain) == (3 if policy == DEFAULT_POLICY else 0)


def test_held_victims_stay_and_are_tracked_again_when_released():
    index, t = small_index(4)
    chain = [key(i) for i in range(4)]
    store(index, t, chain)
    load(index, chain)
    held = index.prepare_load(t, chain).entries  # a ref on all four, as a lease holds them
    assert [e.key for e in held] == chain
    pol = index._policies[SLOT]
    for _ in range(2):
        load(index, [key(50)])
        p = store(index, t, [key(50)])
    assert p.dropped == [0] and not p.copy_idx  # admitted, no room: every victim was held
    assert all(k in t.visible for k in chain) and index.evictions == 0
    assert len(pol) == 0 and not any(e.in_lru for e in held)  # handed over, not evicted
    index.release(held)
    assert len(pol) == 4 and all(e.in_lru and (t, e.key) in pol for e in held)
    load(index, [key(50)])
    assert store(index, t, [key(50)]).copy_idx == [0]  # asked for again, and now a victim can go
    assert index.evictions == 1


def check_consistent(index: Index) -> None:
    """The policy of each slot size tracks exactly the ready entries marked ``in_lru``."""
    for size, pol in index._policies.items():
        tracked = [e for ns in index.namespaces.values() for t in ns.tables.values() if t.slot_bytes == size
                   for e in t.entries.values() if e.in_lru]
        assert all(e.ready and not e.dead for e in tracked)
        assert all((e.table, e.key) in pol for e in tracked)
        assert len(pol) == len(tracked), (size, len(pol), len(tracked))
    ready = sum(len(t.visible) for ns in index.namespaces.values() for t in ns.tables.values())
    assert index.resident == ready


def check_refs(index: Index, in_flight: list[StorePlan], leases: list[list[Entry]]) -> None:
    """``Index.refs_taken`` is every ref held now: on the tables' entries and on unlinked ones that a
    store in flight or a lease still holds (``Tiers.fits`` bounds the evictable blocks with it)."""
    seen = {id(e): e for ns in index.namespaces.values() for t in ns.tables.values() for e in t.entries.values()}
    seen.update((id(e), e) for p in in_flight for e in p.entries)
    seen.update((id(e), e) for lease in leases for e in lease)
    assert index.refs_taken == sum(e.refs for e in seen.values())
    for size in index._policies:
        unheld = sum(1 for e in seen.values() if e.in_lru and not e.refs and e.table.slot_bytes == size)
        assert index.evictable(size) <= unheld  # a lower bound: never more than eviction could free


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_the_policy_consistent(seed, caplog):
    """Stores (some aborted, some cleared while in flight), leased lookups, loads, discards, CLEARs and
    chunk reclamation between two slot sizes sharing 4 chunks: the policy never names a block that
    is gone (the index would log it), and tracks exactly the entries it should after every step."""
    rng = random.Random(seed)
    chunk = 16 * SLOT
    index = Index(Pool(4 * chunk, chunk_bytes=chunk), DEFAULT_POLICY)
    tables = {"a": index.table("a", 0, 1, SLOT, (SLOT,)), "b": index.table("b", 0, 1, 2 * SLOT, (2 * SLOT,))}
    pool_of = {"a": 400, "b": 24}  # key universe per namespace: chains of random length, so stores overlap
    in_flight: list[StorePlan] = []
    leases: list[list[Entry]] = []
    caplog.set_level(logging.ERROR, logger="kvoffd.cache.eviction")
    for step in range(3000):
        ns = "a" if step < 400 else rng.choice("ab")  # "a" takes every chunk first; "b" reclaims its share
        t = tables[ns]
        start = rng.randrange(pool_of[ns])
        keys = [key(start + i, ns.encode()) for i in range(rng.randint(1, 12))]
        op = rng.random()
        if op < 0.3:
            index.lookup(ns, b"".join(keys), with_entries=True)
            p = index.prepare_store(t, keys)
            index.add_pending(p)
            in_flight.append(p)
        elif op < 0.6 and in_flight:
            job = in_flight.pop(rng.randrange(len(in_flight)))
            index.complete_store(job, rng.random() >= 0.1)
        elif op < 0.75:
            hits = index.lookup(ns, b"".join(keys), with_entries=True)
            index.hold(hits)
            got = hits.by_rank.get(0, [])
            if rng.random() < 0.5:
                leases.append(got)  # held for a while, as a lease
            else:
                index.release(got)  # a load that ended
        elif op < 0.85 and leases:
            index.release(leases.pop(rng.randrange(len(leases))))
        elif op < 0.88 and t.visible:
            index.discard(rng.choice(list(t.visible.values())))
        elif op < 0.89 and step > 600:
            index.clear(rng.choice(["", "a", "b"]))
        elif op < 0.95:
            pool_of[ns] = rng.choice([24, 96, 400])  # shift demand between the slot sizes: reclamation
        check_consistent(index)
        check_refs(index, in_flight, leases)
    for job in in_flight:
        index.complete_store(job, True)
    for lease in leases:
        index.release(lease)
    check_consistent(index)
    assert index.refs_taken == 0
    assert index.reclaim_evictions > 0 and index.evictions > index.reclaim_evictions and index.refused > 0
    assert not [r for r in caplog.records if "does not hold" in r.getMessage()]
    for pol in index._policies.values():  # every victim left is a block the index holds
        assert isinstance(pol, GuardedDoorkeeper)
        while (v := pol.victim()) is not None:
            tbl, k = v
            assert k in tbl.visible and tbl.entries[k].in_lru


@pytest.mark.parametrize("policy", ["lru", DEFAULT_POLICY])
def test_evictable_counts_the_unheld_ready_blocks_at_most(policy):
    """A full pool of 16 blocks: all 16 evictable; with 10 held by a lease, at most 6, and evicting for
    6 slots does give 6; released, 16 again."""
    index, t = small_index(16, policy)
    keys = [key(i) for i in range(16)]
    for _ in range(2):  # the doorkeeper admits a block on its second request
        load(index, keys)
        store(index, t, keys)
    assert index.resident == 16 and index.pool.spare_slots(SLOT, 16) == 0
    assert index.evictable(SLOT) == 16
    hits = index.lookup(NS, b"".join(keys[:10]), with_entries=True)
    index.hold(hits)
    assert index.evictable(SLOT) == 6
    assert index.evict(SLOT, 16) == 6  # the bound is met: what it promised, eviction frees
    index.release(hits.by_rank[0])
    assert index.evictable(SLOT) == 10 and index.refs_taken == 0


def test_clear_all_is_one_pass_and_forgets_namespaces_no_engine_uses():
    index = Index(Pool(64 * SLOT, chunk_bytes=64 * SLOT), DEFAULT_POLICY)
    for i in range(600):
        t = index.table(f"ns{i}", 0, 8 if i == 0 else 1, SLOT, (SLOT,))
        store(index, t, [key(i)])
    assert len(index.namespaces) == 600
    index.clear("", in_use={"ns1"})
    assert set(index.namespaces) == {"ns1"}  # the squatter's world size 8 binds nobody now
    index.table("ns0", 0, 1, SLOT, (SLOT,))  # a real engine of world size 1
    assert index.namespaces["ns0"].world_size == 1
    check_consistent(index)


def test_forget_if_idle_keeps_a_namespace_that_holds_entries():
    index, t = small_index(4)
    store(index, t, [key(1)])
    assert not index.forget_if_idle(NS) and NS in index.namespaces
    index.clear(NS)
    assert NS in index.namespaces  # clear without in_use forgets nothing
    assert index.forget_if_idle(NS) and NS not in index.namespaces
