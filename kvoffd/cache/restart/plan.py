"""Adoption: the sealed records of a previous daemon's pool become the new daemon's pool and index.

Nothing a record says is trusted beyond what can be checked here: its namespace must be in the
namespace area with a rank (a storing rank, for replicas), world size and slot size that agree
with it; its slot must lie inside one chunk of the pool, on that slot size's grid; every record of a
chunk must name one slot size; a key present twice in one table keeps its newest record. Whatever fails is not adopted (its
record is invalidated) and counted. The bytes themselves are checked later, against each record's
crc32 (kvoffd/cache/restart/verifier.py).

In two steps, so that a restarted daemon serves within a second whatever its pool holds
(``bench/adopt_scale.py``: the index costs ~4 us per block, 17 s for four million 16 KiB blocks):
``plan_adoption`` checks every record with array operations and takes every adopted slot in the
pool at once (so nothing is ever stored over an adopted block), before the daemon serves; then
``AdoptionPlan.take`` turns records into index entries a slice per loop turn, newest first, each
slice placed at the cold end of the LRU order (the next slice is older), so that the blocks most
likely asked for are found first. A LOOKUP that misses a block whose slice is not in yet takes that
block at once (``AdoptionPlan.asked``, ``take_records``), so the first hit does not wait for the
slices whatever the pool holds; a block is a miss only if it was not adopted at all, never a wrong byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvoffd.cache.index import Entry, Index, Table
from kvoffd.cache.restart.adoption import adopt, holds_table
from kvoffd.cache.restart.records import Found, NamespaceFacts
from kvoffd.pool.allocator import Pool


@dataclass
class AdoptionPlan:
    """The records found adoptable (``order``: indices into ``found``, oldest first), the tables they
    go to, and what was left out. ``take`` consumes ``order`` from its newest end."""

    found: Found
    order: np.ndarray
    tables: dict[tuple[int, int], Table] = field(default_factory=dict)  # (namespace id, rank) -> table
    table_ids: dict[Table, int] = field(default_factory=dict)  # every table made, -> its namespace id
    dropped_records: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    not_adopted: int = 0
    why: str = ""  # the first reason records were left out
    left: int = 0  # records of ``order`` the slices have not reached (its first ``left``)
    waiting: int = 0  # records not yet in the index (of those, the ones no LOOKUP asked for)
    done: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # per record: not (or no longer) waiting
    ns_ids: dict[str, int] = field(default_factory=dict)  # namespace name -> its id in the records
    by_digest: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # records, by ``digests``
    digests: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))  # their identity digests, sorted

    def __post_init__(self) -> None:
        self.left = self.waiting = len(self.order)
        if len(self.done) != len(self.found.ns_id):
            self.done = np.ones(len(self.found.ns_id), dtype=bool)
            self.done[self.order] = False

    @property
    def total(self) -> int:
        return len(self.order)

    @property
    def total_bytes(self) -> int:
        return int(self.found.slot_bytes[self.order].sum()) if len(self.order) else 0

    def take(self, index: Index, pool: Pool, n: int) -> tuple[list[Entry], np.ndarray]:
        """The next (newest) ``n`` blocks into the index, at the cold end of its LRU order; returns
        their entries and the records given up: blocks whose table the index no longer has (its
        namespace was CLEARed or forgotten meanwhile), whose slots go back to the pool here."""
        lo = max(0, self.left - n)
        sel = self.order[lo:self.left]
        self.left = lo
        return self._enter(index, pool, sel[~self.done[sel]], cold_end=True)

    def asked(self, namespace: str, keys: bytes) -> np.ndarray:
        """The records not yet in the index, of any rank of ``namespace``, whose key is among ``keys``
        (a LOOKUP's binary of 32-byte keys): what a lookup would have hit had their slice been in. A
        binary search per key and rank in the digests ``plan_adoption`` sorted anyway (no sort here:
        this runs on the loop, at the first miss of a restarted daemon)."""
        n_id = self.ns_ids.get(namespace)
        if n_id is None or not self.waiting:
            return np.zeros(0, dtype=np.int64)
        f = self.found
        q = np.frombuffer(keys, dtype=np.uint8).reshape(-1, 32)
        words = np.ascontiguousarray(q[:, :8]).view(np.uint64).ravel()
        ranks = [r for (n, r) in self.tables if n == n_id]
        qd = np.concatenate([words ^ np.uint64((n_id << 48) | (r << 32)) for r in ranks])
        lo = np.searchsorted(self.digests, qd, "left")
        counts = np.searchsorted(self.digests, qd, "right") - lo
        if not counts.any():
            return np.zeros(0, dtype=np.int64)
        which = np.repeat(np.arange(len(qd)) % len(words), counts)  # (query key, candidate) pairs
        starts = np.repeat(lo - (np.cumsum(counts) - counts), counts)
        cand = self.by_digest[starts + np.arange(len(which))]
        ok = ~self.done[cand] & (f.ns_id[cand] == n_id) & (f.keys[cand] == q[which]).all(axis=1)
        return np.unique(cand[ok])

    def take_records(self, index: Index, pool: Pool, records: np.ndarray) -> tuple[list[Entry], np.ndarray]:
        """``records`` (from ``asked``) into the index now, as just used; as ``take`` otherwise. Their
        places in ``order`` stay: the slice that reaches them skips them."""
        return self._enter(index, pool, records[np.argsort(self.found.stamp[records], kind="stable")], cold_end=False)

    def _enter(self, index: Index, pool: Pool, sel: np.ndarray, cold_end: bool) -> tuple[list[Entry], np.ndarray]:
        self.done[sel] = True
        self.waiting -= len(sel)
        f = self.found
        ids, inverse = np.unique((f.ns_id[sel] << 16) | f.rank[sel], return_inverse=True)
        tabs_of = [self.tables.get((i >> 16, i & 0xFFFF)) for i in ids.tolist()]
        tabs_of = [t if t is not None and holds_table(index, t) else None for t in tabs_of]
        per = np.array(tabs_of + [None], dtype=object)[inverse.ravel()]
        ok = np.array([t is not None for t in tabs_of], dtype=bool)[inverse.ravel()]
        gone = sel[~ok]
        for sb in np.unique(f.slot_bytes[gone]).tolist():
            pool.free(int(sb), f.offset[gone][f.slot_bytes[gone] == sb].tolist())
        sel = sel[ok]
        raw = f.keys[sel].tobytes()
        keys = [raw[i:i + 32] for i in range(0, len(raw), 32)]
        tabs = per[ok].tolist()
        entries = adopt(index, tabs, keys, f.offset[sel].tolist(), f.stamp[sel].tolist(), f.crc[sel].tolist(),
                        cold_end=cold_end)
        return entries, f.record[gone]

    def forget(self, pool: Pool, keep: set[Table]) -> np.ndarray:
        """Give up the records not yet taken whose table is not in ``keep``: their slots go back to the
        pool; returns their record indices (to invalidate)."""
        f = self.found
        pending = self.order[:self.left]
        pending = pending[~self.done[pending]]
        if not len(pending):
            return np.zeros(0, dtype=np.int64)
        keys = {k for k, t in self.tables.items() if t in keep}
        ok = np.fromiter(((int(a), int(b)) in keys for a, b in zip(f.ns_id[pending].tolist(),
                                                                    f.rank[pending].tolist(), strict=True)),
                         dtype=bool, count=len(pending))
        gone = pending[~ok]
        self.done[gone] = True
        self.waiting -= len(gone)
        for sb in np.unique(f.slot_bytes[gone]).tolist():
            pool.free(int(sb), f.offset[gone][f.slot_bytes[gone] == sb].tolist())
        self.order = np.concatenate([pending[ok], self.order[self.left:]])
        self.left = int(ok.sum())
        return f.record[gone]


def _plausible(f: Found, ns: dict[int, NamespaceFacts], pool: Pool) -> tuple[np.ndarray, str]:
    """Mask of the records whose namespace facts and slot geometry check out (one check per distinct
    namespace, rank and slot size, not per record)."""
    why = ""
    if not len(f.ns_id):
        return np.zeros(0, dtype=bool), why
    # one int64 per (namespace id 16 bits, rank 16 bits, slot bytes < 2**32): np.unique of ints is fast
    packed = (f.ns_id << 48) | (f.rank << 32) | f.slot_bytes
    triples, inverse = np.unique(packed, return_inverse=True)
    good = np.zeros(len(triples), dtype=bool)
    for i, t in enumerate(triples.tolist()):
        n, r, sb = t >> 48, (t >> 32) & 0xFFFF, t & 0xFFFFFFFF
        facts = ns.get(n)
        rf = facts.ranks.get(r) if facts is not None and r < facts.world_size and r % facts.replicas == 0 else None
        good[i] = rf is not None and rf.slot_bytes == sb
    ok = good[inverse.ravel()]
    if not ok.all():
        why = "records of namespaces the table does not describe"
    cb = pool.chunk_bytes
    fits = (f.slot_bytes > 0) & ((f.offset % cb) + f.slot_bytes <= cb) & (f.offset + f.slot_bytes <= pool.nbytes)
    if (ok & ~fits).any() and not why:
        why = "records of slots outside the pool's chunks"
    ok &= fits
    chunk = f.offset // cb
    pairs = np.unique((chunk[ok] << 32) | f.slot_bytes[ok])
    chunks, counts = np.unique(pairs >> 32, return_counts=True)
    mixed = chunks[counts > 1]
    if len(mixed):
        ok &= ~np.isin(chunk, mixed)
        why = why or f"{len(mixed)} chunks whose records name two slot sizes"
    return ok, why


def _digest(f: Found, records: np.ndarray) -> np.ndarray:
    """A 64-bit digest of each record's identity (namespace, rank, key): the key's first word (the key
    is already a hash) mixed with the namespace id and rank."""
    ident = (f.ns_id[records].astype(np.uint64) << np.uint64(48)) | (f.rank[records].astype(np.uint64) << np.uint64(32))
    return np.ascontiguousarray(f.keys[records, :8]).view(np.uint64).ravel() ^ ident


def _newest(f: Found, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of the records in ``ok``, the newest per (namespace, rank, key) (of equal stamps, the lower
    slot), oldest first (by stamp, then slot: a commit's blocks share a stamp and sit in the order
    they were stored); and the candidates by identity digest with the sorted digests, which the plan
    keeps to find a block a LOOKUP asks for (``AdoptionPlan.asked``)."""
    cand = np.flatnonzero(ok)
    if not len(cand):
        return cand.astype(np.int64), cand.astype(np.int64), cand.astype(np.uint64)
    order = cand[np.lexsort((-f.offset[cand], f.stamp[cand]))]  # the last of each key: newest, lowest slot
    # A key twice is rare (a crash between a block's re-store and its old record's invalidation): find
    # the candidates by their digest (fast), then compare those few exactly.
    digest = _digest(f, order)
    by = np.argsort(digest, kind="stable")
    digests = digest[by]
    twice = np.zeros(len(order), dtype=bool)
    same = digests[1:] == digests[:-1]
    twice[1:] |= same
    twice[:-1] |= same
    maybe = np.sort(by[twice])
    if not len(maybe):
        return order, order[by], digests
    sub = order[maybe]
    ident = np.concatenate([f.ns_id[sub].astype("<u2").view(np.uint8).reshape(-1, 2),
                            f.rank[sub].astype("<u2").view(np.uint8).reshape(-1, 2), f.keys[sub]], axis=1)
    ident = np.ascontiguousarray(ident).view(np.dtype((np.void, ident.shape[1]))).ravel()
    _, last = np.unique(ident[::-1], return_index=True)  # first in the reversed order: the newest
    drop = np.ones(len(sub), dtype=bool)
    drop[len(sub) - 1 - last] = False
    keep = np.delete(order, maybe[drop])
    return keep[np.lexsort((f.offset[keep], f.stamp[keep]))], order[by], digests


def plan_adoption(f: Found, ns: dict[int, NamespaceFacts], pool: Pool, index: Index) -> AdoptionPlan:
    """Check the sealed records ``f``, make their tables and take their slots in ``pool`` (both empty);
    the entries follow through ``AdoptionPlan.take``."""
    ok, why = _plausible(f, ns, pool)
    keep, by_digest, digests = _newest(f, ok)
    plan = AdoptionPlan(found=f, order=keep, why=why, by_digest=by_digest, digests=digests)
    for n in np.unique(f.ns_id[keep]).tolist():
        facts = ns[n]
        try:
            for r, rf in sorted(facts.ranks.items()):
                t = plan.tables[(n, r)] = index.table(facts.name, r, facts.world_size, rf.slot_bytes, rf.layout,
                                                      facts.replicas)
                plan.table_ids[t] = n
            plan.ns_ids[facts.name] = n
        except ValueError:
            plan.why = plan.why or f"namespace {facts.name!r} described twice"
            keep = keep[f.ns_id[keep] != n]
    plan.order, plan.left, plan.waiting = keep, len(keep), len(keep)
    plan.done[:] = True  # only what is kept waits (a namespace described twice was dropped above)
    plan.done[keep] = False
    for sb in np.unique(f.slot_bytes[keep]).tolist():
        sel = keep[f.slot_bytes[keep] == sb]
        pool.adopt_slots(int(sb), np.sort(f.offset[sel]))
    dropped = np.ones(len(f.ns_id), dtype=bool)
    dropped[keep] = False
    plan.dropped_records = f.record[dropped]
    plan.not_adopted = int(dropped.sum())
    return plan
